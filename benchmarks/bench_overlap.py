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
* ``--overlap 2d`` / ``3d``: ``--tp-overlap`` on SUMMA (each step's broadcasts under the step
  before's product; ``--tp 4``) and on the cube (a product's two gathers at once, the
  weight's second half gathered under the first half's product, dX's reduce-scatter under
  dW's product; ``--tp 8``). Not in ``--smoke`` (4 and 8 ranks).

    .venv/bin/python benchmarks/bench_overlap.py --overlap tp --rounds 8            # the small GPT, tp 2
    .venv/bin/python benchmarks/bench_overlap.py --overlap ep --hidden 256 --rounds 8  # a wider moe-tiny, ep 2
    .venv/bin/python benchmarks/bench_overlap.py --overlap 2d --rounds 8            # the small GPT, 2-D tp 4
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
# each option: the layout it overlaps (from the launch's size n), its flag, the axes it hides
OPTIONS = {
    "tp": (lambda n: ParallelConfig(tp=n, sp=True), "tp_overlap", ("tp",)),
    "ep": (lambda n: ParallelConfig(ep=n), "ep_overlap", ("ep",)),
    "2d": (lambda n: ParallelConfig(tp=n, tp_mode="2d"), "tp_overlap", ("summa_row", "summa_col")),
    "3d": (lambda n: ParallelConfig(tp=n, tp_mode="3d"), "tp_overlap", ("cube_i", "cube_j", "cube_k")),
}
SMOKE = ("tp", "ep")  # the options the suite's smoke run measures (2 ranks each)


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
    axes = OPTIONS[option][2]
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
        recs = [r for r in comms[name].trace.records if r["axis"] in axes]
        sent = sent_bytes_by_axis(recs, {a: comms[name].size(a) for a in axes})
        wire[name] = {"messages": len([r for r in recs if r["op"] != "recv"]), "sent_bytes": sum(sent.values())}
    return {"times": times, "wire": wire}


def bench(option: str, model, n: int, train: TrainConfig, rounds: int, cmd: str) -> tuple[str, dict]:
    """One option's side-by-side run on n ranks: its markdown and its numbers."""
    res = run_on_ranks(job, layouts(option, n)["plain"], model, option, train, rounds)
    per_round = slowest_rank_rounds(res, VARIANTS)
    ratio = paired_ratio(per_round["overlap"], per_round["plain"])
    wire = res[0]["wire"]
    med = {v: sorted(x)[len(x) // 2] for v, x in per_round.items()}
    where = {"tp": "tp {n} + sp", "ep": "ep {n}", "2d": "tp {n}, 2-D", "3d": "tp {n}, 3-D"}[option]
    md = (f"\n`{cmd}` — {model.name} (hidden {model.hidden}, seq {model.seq_len}, batch {train.global_batch}), "
          f"{where.format(n=n)}, {rounds} rounds; {cpu_name()}, gloo; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {checkout_commit()}\n\n"
          f"| variant | step (s, median of slowest rank) | {'+'.join(OPTIONS[option][2])} calls and sends / step "
          f"| bytes sent on them / step / rank |\n|---|---|---|---|\n"
          + "".join(f"| {v} | {med[v]:.3f} | {wire[v]['messages']} | {wire[v]['sent_bytes']:,.0f} |\n"
                    for v in VARIANTS)
          + f"\noverlap / plain: paired median {ratio['paired_median']:.3f}, "
            f"ratio of medians {ratio['ratio_of_medians']:.3f}\n")
    return md, {"rounds": per_round, "ratio": ratio, "wire": wire}


DEFAULT_MODEL = {"tp": "small", "ep": "moe-tiny", "2d": "small", "3d": "small"}
DEFAULT_RANKS = {"tp": 2, "ep": 2, "2d": 4, "3d": 8}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--overlap", choices=tuple(OPTIONS), default="tp", help="which overlap option to measure")
    ap.add_argument("--model", default="", help="a preset (default: small for tp, moe-tiny for ep)")
    ap.add_argument("--hidden", type=int, default=0, help="override the preset's width (and ffn = 4 x hidden)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=0, help="the option's group size (default: tp 2, ep 2, 2d 4, 3d 8)")
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--append", default="", help="append the markdown to this results file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny models, two rounds, the tp and ep options (the tests)")
    args = ap.parse_args()
    cmd = "benchmarks/bench_overlap.py " + " ".join(sys.argv[1:])
    options = SMOKE if args.smoke else (args.overlap,)
    for option in options:
        name = args.model or DEFAULT_MODEL[option]
        seq, rounds, batch = (32, 2, 2) if args.smoke else (args.seq_len, args.rounds, args.global_batch)
        model = preset("tiny" if args.smoke and option == "tp" else name).replace(seq_len=seq)
        if args.hidden:
            model = model.replace(hidden=args.hidden, ffn=4 * args.hidden)
        train = TrainConfig(steps=rounds + 1, global_batch=batch, progress=False, eval_every=0, sample_tokens=0)
        md, numbers = bench(option, model, args.ranks or DEFAULT_RANKS[option], train, rounds, cmd)
        publish(md, numbers, args.json, "" if args.smoke else args.append)


if __name__ == "__main__":
    main()
