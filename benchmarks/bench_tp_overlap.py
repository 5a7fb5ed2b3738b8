"""--tp-overlap side by side: the step time of 1-D tensor parallelism with sequence
parallelism, its all-gathers and reduce-scatters as whole collectives (plain) and
decomposed into chunks on a ring under their matmuls (``--tp-overlap``,
``parallel/collective_matmul.py``), in one launch of t gloo ranks, the two trainers on the
same grid stepping in alternation. Per round a variant's time is its slowest rank's; the
ratio overlap/plain is the median over rounds of the ratio within the round (harness.py).
Beside it, from the traces: the tensor-axis messages per step and the bytes each rank
sent (equal by construction: the ring moves what the collective moved).

    .venv/bin/python benchmarks/bench_tp_overlap.py --tp 2 --rounds 8          # the small GPT
    .venv/bin/python benchmarks/bench_tp_overlap.py --smoke                    # tiny, 2 rounds (the tests)
    .venv/bin/python benchmarks/bench_tp_overlap.py --append benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
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


def job(comm, model, tp: int, train: TrainConfig, rounds: int) -> dict:
    """On each rank: both trainers built on one grid, a warm-up step each, then `rounds`
    rounds of one step of each (a barrier before every step); their step times and the
    tensor-axis messages and sent bytes of the last step."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer

    corpus = load_corpus("")
    grid = ProcessGrid.for_layout(ParallelConfig(tp=tp, sp=True), comm.grid.rank).build_groups()
    trainers, comms = {}, {}
    for name in VARIANTS:
        comms[name] = Comm(grid, CommTrace())
        trainers[name] = Trainer(model, ParallelConfig(tp=tp, sp=True, tp_overlap=name == "overlap", device="cpu"),
                                 train, comms[name], corpus)
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
        recs = [r for r in comms[name].trace.records if r["axis"] == "tp"]
        wire[name] = {"messages": len([r for r in recs if r["op"] != "recv"]),
                      "sent_bytes": sent_bytes_by_axis(recs, {"tp": tp}).get("tp", 0)}
    return {"times": times, "wire": wire}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--append", default="", help="append the markdown to this results file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, two rounds (the tests)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.seq_len, args.rounds, args.global_batch = "tiny", 32, 2, 2
    model = preset(args.model).replace(seq_len=args.seq_len)
    train = TrainConfig(steps=args.rounds + 1, global_batch=args.global_batch, progress=False, eval_every=0,
                        sample_tokens=0)
    res = run_on_ranks(job, ParallelConfig(tp=args.tp), model, args.tp, train, args.rounds)
    rounds = slowest_rank_rounds(res, VARIANTS)
    ratio = paired_ratio(rounds["overlap"], rounds["plain"])
    wire = res[0]["wire"]
    med = {v: sorted(x)[len(x) // 2] for v, x in rounds.items()}
    cmd = "benchmarks/bench_tp_overlap.py " + " ".join(sys.argv[1:])
    md = (f"\n`{cmd}` — {args.model} (seq {args.seq_len}, batch {args.global_batch}), tp {args.tp} + sp, "
          f"{args.rounds} rounds; {cpu_name()}, gloo; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"commit {checkout_commit()}\n\n"
          "| variant | step (s, median of slowest rank) | tp calls and sends / step | tp bytes sent / step / rank |\n"
          "|---|---|---|---|\n"
          + "".join(f"| {v} | {med[v]:.3f} | {wire[v]['messages']} | {wire[v]['sent_bytes']:,.0f} |\n" for v in VARIANTS)
          + f"\noverlap / plain: paired median {ratio['paired_median']:.3f}, "
            f"ratio of medians {ratio['ratio_of_medians']:.3f}\n")
    publish(md, {"rounds": rounds, "ratio": ratio, "wire": wire}, args.json, "" if args.smoke else args.append)


if __name__ == "__main__":
    main()
