"""Communication hidden under compute, side by side: the step time of a layout with its
collectives whole (plain) and with one overlap option on, in one launch of gloo ranks,
the two trainers on the same grid stepping in alternation. Per round a variant's time is
its slowest rank's; the ratio overlap/plain is the median over rounds of the ratio within
the round (harness.py). Beside it, from the traces: the option's axis' messages per step
and the bytes each rank sent (equal by construction: an overlap moves what the whole
collectives moved, in more, smaller messages).

* ``--overlap tp``: 1-D tensor parallelism with sequence parallelism, its all-gathers and
  reduce-scatters decomposed into chunks on a ring under their matmuls (``--tp-overlap``,
  ``parallel/collective_matmul.py``; Wang et al. 2022).
* ``--overlap ep``: each MoE call's dispatch and combine all-to-alls in two halves by
  local expert, one in flight under the other half's experts (``--ep-overlap``,
  ``parallel/expert_overlap.py``; DeepSeek-V3 §3.2.1).

    .venv/bin/python benchmarks/bench_overlap.py --overlap tp --tp 2 --rounds 8     # the small GPT
    .venv/bin/python benchmarks/bench_overlap.py --overlap ep --ep 2 --rounds 8     # a wider moe-tiny
    .venv/bin/python benchmarks/bench_overlap.py --smoke                            # tiny, 2 rounds each (the tests)
    .venv/bin/python benchmarks/bench_overlap.py --overlap ep --append benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import checkout_commit, cpu_name, paired_ratio, publish, slowest_rank_rounds  # noqa: E402
from minitron.analysis.calls import sent_bytes_by_axis  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset  # noqa: E402
from minitron.tools.testing import run_on_ranks  # noqa: E402

VARIANTS = ("plain", "overlap")
# each option: the layout it overlaps (from the launch's size n), its flag, the axis it hides
OPTIONS = {
    "tp": (lambda n: ParallelConfig(tp=n, sp=True), "tp_overlap", "tp"),
    "ep": (lambda n: ParallelConfig(ep=n), "ep_overlap", "ep"),
}


def layouts(option: str, n: int) -> dict:
    """The plain layout and its overlapped twin for `option` on n ranks."""
    base, flag, _ = OPTIONS[option]
    plain = dataclasses.replace(base(n), device="cpu")
    return {"plain": plain, "overlap": dataclasses.replace(plain, **{flag: True})}


def job(comm, model, option: str, train: TrainConfig, rounds: int) -> dict:
    """On each rank: both trainers built on one grid, a warm-up step each, then `rounds`
    rounds of one step of each (a barrier before every step); their step times and the
    option axis' messages and sent bytes of the last step."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer

    corpus = load_corpus("")
    variants = layouts(option, comm.grid.world)
    axis = OPTIONS[option][2]
    grid = ProcessGrid.for_layout(variants["plain"], comm.grid.rank).build_groups()
    trainers, comms = {}, {}
    for name, layout in variants.items():
        comms[name] = Comm(grid, CommTrace())
        trainers[name] = Trainer(model, layout, train, comms[name], corpus)
        trainers[name].step(0)  # warm-up
    times = {v: [] for v in VARIANTS}
    for i in range(1, rounds + 1):
        for name in VARIANTS:
            comms[name].trace.records.clear()
            comm.barrier()
            t0 = time.perf_counter()
            trainers[name].step(i)
            times[name].append(time.perf_counter() - t0)
    wire = {}
    for name in VARIANTS:
        recs = [r for r in comms[name].trace.records if r["axis"] == axis]
        wire[name] = {"messages": len([r for r in recs if r["op"] != "recv"]),
                      "sent_bytes": sent_bytes_by_axis(recs, {axis: comm.grid.world}).get(axis, 0)}
    return {"times": times, "wire": wire}


def bench(option: str, model, n: int, train: TrainConfig, rounds: int, cmd: str) -> tuple[str, dict]:
    """One option's side-by-side run on n ranks: its markdown and its numbers."""
    res = run_on_ranks(job, layouts(option, n)["plain"], model, option, train, rounds)
    per_round = slowest_rank_rounds(res, VARIANTS)
    ratio = paired_ratio(per_round["overlap"], per_round["plain"])
    wire = res[0]["wire"]
    med = {v: sorted(x)[len(x) // 2] for v, x in per_round.items()}
    where = "tp {n} + sp" if option == "tp" else "ep {n}"
    md = (f"\n`{cmd}` — {model.name} (hidden {model.hidden}, seq {model.seq_len}, batch {train.global_batch}), "
          f"{where.format(n=n)}, {rounds} rounds; {cpu_name()}, gloo; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {checkout_commit()}\n\n"
          f"| variant | step (s, median of slowest rank) | {option} calls and sends / step "
          f"| {option} bytes sent / step / rank |\n|---|---|---|---|\n"
          + "".join(f"| {v} | {med[v]:.3f} | {wire[v]['messages']} | {wire[v]['sent_bytes']:,.0f} |\n"
                    for v in VARIANTS)
          + f"\noverlap / plain: paired median {ratio['paired_median']:.3f}, "
            f"ratio of medians {ratio['ratio_of_medians']:.3f}\n")
    return md, {"rounds": per_round, "ratio": ratio, "wire": wire}


DEFAULT_MODEL = {"tp": "small", "ep": "moe-tiny"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--overlap", choices=tuple(OPTIONS), default="tp", help="which overlap option to measure")
    ap.add_argument("--model", default="", help="a preset (default: small for tp, moe-tiny for ep)")
    ap.add_argument("--hidden", type=int, default=0, help="override the preset's width (and ffn = 4 x hidden)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--append", default="", help="append the markdown to this results file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny models, two rounds, every option (the tests)")
    args = ap.parse_args()
    cmd = "benchmarks/bench_overlap.py " + " ".join(sys.argv[1:])
    options = tuple(OPTIONS) if args.smoke else (args.overlap,)
    for option in options:
        name = args.model or DEFAULT_MODEL[option]
        seq, rounds, batch = (32, 2, 2) if args.smoke else (args.seq_len, args.rounds, args.global_batch)
        model = preset("tiny" if args.smoke and option == "tp" else name).replace(seq_len=seq)
        if args.hidden:
            model = model.replace(hidden=args.hidden, ffn=4 * args.hidden)
        train = TrainConfig(steps=rounds + 1, global_batch=batch, progress=False, eval_every=0, sample_tokens=0)
        md, numbers = bench(option, model, args.tp if option == "tp" else args.ep, train, rounds, cmd)
        publish(md, numbers, args.json, "" if args.smoke else args.append)


if __name__ == "__main__":
    main()
