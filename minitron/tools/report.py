"""The run report: what the ranks of a `minitron train` run did, measured, next to what
the analysis predicts.

`RunReport` is handed to :func:`minitron.train.train` by the command line. It observes
the steps the training loop runs (:meth:`RunReport.watching`): the first one under the
memory meter (:func:`minitron.tools.measure.measuring`, through the saved-tensor hooks
the Trainer's step takes) with a communication trace installed, the pipeline's compute
actions recorded for a few steps after it, and at the end gathers every rank's facts to
rank 0:

* the layout: each rank's coordinates, the layers it holds and the region of one weight
  matrix it holds (the tensor shard), its data-parallel replica;
* bytes sent per axis in one step (the trace) against ``analysis.comm_bytes_per_step``;
* how much of each axis' communication was hidden under compute, measured over the
  `TIMED_STEPS` steps after the first with a timed trace
  (:func:`minitron.viz.comm.exposure_by_axis`): the time in flight, the time the rank
  stood waiting, and the share it did not wait (``--tp-overlap``, ``--ep-overlap`` and the
  data-parallel buckets post calls early; every other call waits from its issue);
* the measured pipeline bubble (idle time over compute time of the pipeline's ranks)
  against ``analysis.bubble_fraction`` — (p−1)/(v·m) for interleaved 1F1B;
* peak memory per rank (the measured step) against ``minitron memory``'s formulas, and
  the process' peak resident memory (which includes PyTorch itself);
* tokens/s and MFU (model FLOP/s over the world's matmul peak, measured at the start);
* with mixture-of-experts blocks, the load balance: tokens per expert of each MoE layer
  (the step's choices over the global batch, ``Trainer.reduce_routing_and_update_bias``), the
  most loaded expert over the mean, the dropped fraction, and a *collapse* warning when the router
  sends almost every choice to k experts (:func:`routing_summary`).

:func:`format_report` prints it; :func:`plot_losses` (minitron.viz.loss) draws the loss curve next to the
metrics file. With ``tensorboard_dir`` the step scalars also go to TensorBoard.
"""
from __future__ import annotations

import os
import resource
import statistics
from contextlib import ExitStack, contextmanager

import torch

from ..comm import CommTrace, TimedTrace
from ..viz.comm import exposure_by_axis
from ..viz.loss import plot_losses  # noqa: F401 - the figure's home is viz/loss.py; callers import it here too

PIPELINE_STEPS = 10  # steps after the first whose compute actions time the bubble
TIMED_STEPS = 3  # steps after the first whose calls are timed (the first also warms up)


class RunReport:
    """The observer of one training run on one rank (see the module's docstring)."""

    def __init__(self, model, layout, train, tensorboard_dir: str = "", peak_flops: float | None = None,
                 measure_peak: bool = False):
        self.model, self.layout, self.train = model, layout, train
        self.first = None
        self.memory, self.trace_records, self.peak_flops = None, [], peak_flops
        self.measure_peak = measure_peak and peak_flops is None  # MFU's denominator, on rank 0, at the start
        self.tensorboard_dir, self.writer = tensorboard_dir, None
        self.routing: list[dict] = []  # the MoE routing of each step (rank 0)
        self.step_flops_per_token: list[float] = []  # model FLOPs per token of each step, as the loop counts them
        self.timed = TimedTrace()  # the calls of the steps after the first, timed

    # --- called by the training loop -----------------------------------------------------
    def start(self, tr) -> None:
        """Before the first step: this machine's matmul peak (MFU's denominator), on rank 0."""
        if self.measure_peak and tr.comm.grid.rank == 0:
            from .bench import matmul_peak, probe_dtype

            self.peak_flops = matmul_peak(probe_dtype(self.layout, self.train))

    @contextmanager
    def watching(self, tr, step: int):
        """What the report observes of step `step`, which the training loop runs inside
        (``Trainer.step_async(step, saved_tensors=hooks)``): the first step traced and its
        memory measured (yields the meter's saved-tensor hooks), then `TIMED_STEPS` steps
        timed and `PIPELINE_STEPS` steps' pipeline actions recorded (all of them under
        --timeline); yields None where nothing is measured through the step's hooks."""
        if self.first is None:
            self.first = step
            with self._first_step(tr) as hooks:
                yield hooks
            return
        with ExitStack() as scopes:
            if tr.pipeline is not None:  # time the pipeline for a few steps (the bubble)
                scopes.enter_context(tr.pipeline.recording(step <= self.first + PIPELINE_STEPS))
            if step <= self.first + TIMED_STEPS and tr.comm.trace is None:
                scopes.enter_context(tr.comm.tracing(self.timed))
            yield None

    @contextmanager
    def _first_step(self, tr):
        """The first step's trace (a long run must not keep every record, so one step's, or
        the run's own) and its memory (not under --compile: compiled blocks do not run the
        saved-tensor hooks the meter needs)."""
        from .measure import measuring

        with tr.comm.tracing(tr.comm.trace or CommTrace()) as trace:
            mark = len(trace.records)
            if tr.layout.compile:
                yield None
            else:
                with measuring(tr) as memory:
                    yield memory.hooks
                self.memory = memory.bytes
        self.trace_records = [r for r in trace.records[mark:] if r.get("phase") != "log"]

    def records(self, tr, recs: list[dict]) -> None:
        """Add MFU to the step records (rank 0's, before they are written) and mirror them
        to TensorBoard."""
        if tr.comm.grid.rank != 0:
            return
        self.routing += [{k: r[k] for k in ("step", "tokens_per_expert", "dropped")} for r in recs
                         if "tokens_per_expert" in r]
        self.step_flops_per_token += [r["model_flops_per_s"] / r["tokens_per_s"] for r in recs
                                      if r.get("tokens_per_s")]  # --pack: each step's documents
        if self.peak_flops:
            for r in recs:
                r["mfu"] = r["model_flops_per_s"] / (self.peak_flops * tr.comm.grid.world)
        if self.tensorboard_dir:
            if self.writer is None:
                from .tensorboard_log import ScalarWriter

                self.writer = ScalarWriter(self.tensorboard_dir)
            self.writer.write(recs)

    def _timed_records(self, tr) -> list[dict]:
        """The calls of the timed steps: this report's own timed trace, or the run's when it
        times every call (``--timeline``)."""
        if self.timed.records or not isinstance(tr.comm.trace, TimedTrace):
            return self.timed.records
        return [r for r in tr.comm.trace.records if self.first < r["step"] <= self.first + TIMED_STEPS]

    def finish(self, tr) -> dict | None:
        """Gather every rank's facts to rank 0 (collective); rank 0 returns the report."""
        if self.writer is not None:
            self.writer.close()
        facts = rank_facts(tr, self.memory, self.trace_records)
        facts["exposure"] = exposure_by_axis([r for r in self._timed_records(tr) if r.get("phase") != "log"])
        everyone = tr.comm.gather_object(facts)
        if everyone is None:
            return None
        from ..model_flops import model_flops_per_step

        flops_per_token = statistics.fmean(self.step_flops_per_token) if self.step_flops_per_token else \
            model_flops_per_step(self.model, self.train.global_batch) / (self.train.global_batch * self.model.seq_len)
        return {"model": self.model.name, "layout": self.layout.describe(), "world": tr.comm.grid.world,
                "flops_per_token": flops_per_token,
                "ranks": everyone, "bubble": measured_bubble(everyone),
                "peak_flops": self.peak_flops, "routing": routing_summary(self.routing, self.model),
                **predictions(self.model, self.layout, self.train)}


def routing_summary(steps: list[dict], model) -> dict | None:
    """The load balance of a run's MoE layers: per layer, the tokens per expert of the last
    step and summed over all steps, the most loaded expert's share over the mean (1 is
    perfect balance; E/k means k experts take every choice), and whether the router has
    collapsed (that ratio at 90 % of E/k or more); the mean dropped fraction."""
    if not steps:
        return None
    layers = [i for i in range(model.layers) if model.is_moe_block(i)]
    out = []
    for n, layer in enumerate(layers):
        total = [sum(s["tokens_per_expert"][n][e] for s in steps) for e in range(model.experts)]
        mean = sum(total) / model.experts
        ratio = max(total) / mean if mean else 0.0
        out.append({"layer": layer, "last_step": steps[-1]["tokens_per_expert"][n], "total": total,
                    "max_over_mean": ratio, "busiest": total.index(max(total)),
                    "collapsed": ratio >= 0.9 * model.experts / model.top_k})
    return {"layers": out, "dropped": sum(s["dropped"] for s in steps) / len(steps), "steps": len(steps)}


# --- facts of one rank ---------------------------------------------------------------------
def _region(p) -> str:
    info = p.shard
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in info.slices) + "] of " + str(list(info.full_shape))


def rank_facts(tr, memory: dict | None, trace_records: list[dict]) -> dict:
    """This rank's coordinates, model pieces, shard, bytes per axis, memory and timeline."""
    grid = tr.comm.grid
    coord = grid.coord()
    chunks = []
    for c in tr.chunks:
        parts = (["embed"] if c.first else []) + [f"{c.layer_ids[0]}-{c.layer_ids[-1]}" if len(c.layer_ids) > 1
                                                  else str(c.layer_ids[0])] * bool(c.layer_ids)
        chunks.append(",".join(parts + (["head"] if c.last else [])))
    shard = next((p for p in tr.params if p.shard.name.endswith("mlp.fc.weight")), None)
    per_axis: dict[str, int] = {}
    for r in trace_records:
        per_axis[r["axis"]] = per_axis.get(r["axis"], 0) + r["bytes"]
    spans: dict[int, list] = {}
    pipe = tr.pipeline
    for r in (pipe.records if pipe is not None else []):
        s = spans.setdefault(r["step"], [r["start"], r["end"], 0.0])
        s[0], s[1], s[2] = min(s[0], r["start"]), max(s[1], r["end"]), s[2] + r["end"] - r["start"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if tr.ctx.device.type == "cuda":
        rss = torch.cuda.max_memory_allocated(tr.ctx.device)
    return {"rank": grid.rank, "tp": coord.tp, "cp": coord.cp, "ep": coord.ep, "dp": coord.dp, "pp": coord.pp,
            "cube": list(grid.cube_coord()) if grid.cube else None, "chunks": chunks,
            "shard": (shard.shard.name.split(".", 3)[-1] + _region(shard)) if shard is not None else "",
            "bytes_per_axis": per_axis, "memory": memory, "process_peak_bytes": rss,
            "pipeline_spans": spans, "first_pipeline": coord.dp == 0 and coord.tp == 0 and coord.cp == 0}


def measured_bubble(ranks: list[dict]) -> dict | None:
    """Idle over compute time of the first pipeline's ranks, per recorded step (the step's
    span from the first action's start to the last one's end, on any of them): the
    median over steps of the mean over ranks, which is how ``bubble_fraction`` counts."""
    pipe = [r for r in ranks if r["first_pipeline"] and r["pipeline_spans"]]
    if len(pipe) < 2:
        return None
    steps = set.intersection(*(set(r["pipeline_spans"]) for r in pipe))
    per_step = []
    for s in sorted(steps)[1:] or sorted(steps):  # the first recorded step also warms up
        t0 = min(r["pipeline_spans"][s][0] for r in pipe)
        t1 = max(r["pipeline_spans"][s][1] for r in pipe)
        per_step.append(statistics.mean((t1 - t0 - r["pipeline_spans"][s][2]) / r["pipeline_spans"][s][2]
                                        for r in pipe))
    return {"measured": statistics.median(per_step), "steps": len(per_step)} if per_step else None


def predictions(model, layout, train) -> dict:
    """What the analysis says of this run: bytes per axis per step, memory per stage, bubble.
    A layout the formulas do not cover gives None for that part."""
    from .. import analysis

    out = {"predicted_bytes": None, "predicted_memory": None, "predicted_bubble": None}
    try:
        per_stage = [analysis.comm_bytes_per_step(model, layout, train, pp_rank=r) for r in range(layout.pp)]
        out["predicted_bytes"] = {ax: max(sum(s.get(ax, {}).values()) for s in per_stage)
                                  for ax in set().union(*per_stage)}  # the most any stage sends
    except Exception:  # a layout without a formula here (e.g. one added after this report)
        pass
    try:
        out["predicted_memory"] = {r: analysis.memory_on_rank(model, layout, train, r)["total_bytes"]
                                   for r in range(layout.pp)}
    except Exception:
        pass
    if layout.pp > 1:
        out["predicted_bubble"], out["bubble_formula"] = analysis.ideal_bubble(layout.schedule, layout.pp,
                                                                               train.microbatches, layout.vpp)
    return out


# --- printing and drawing ----------------------------------------------------------------------
def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _exposure_lines(ranks: list[dict]) -> list[str]:
    """The measured hiding of each axis' calls: the rank that waited longest on it."""
    axes = sorted({a for r in ranks for a in r.get("exposure") or {}})
    if not axes:
        return []
    steps = max(e["steps"] for r in ranks for e in (r.get("exposure") or {}).values())
    lines = [f"communication hidden under compute, by axis ({steps} timed steps after the first, the rank that "
             f"waited longest; in flight: issue to done; waited: the rank stood still):"]
    for a in axes:
        e = max((r["exposure"][a] for r in ranks if a in (r.get("exposure") or {})), key=lambda x: x["exposed_s"])
        lines.append(f"  {a:<8} {e['calls']:>5} calls   in flight {e['in_flight_s'] * 1e3:>9.1f} ms   "
                     f"waited {e['exposed_s'] * 1e3:>9.1f} ms   hidden {e['hidden']:>4.0%}")
    return lines


def format_report(rep: dict, tokens_per_s: list[float] | None = None) -> str:
    """The report as text (a few lines per rank)."""
    lines = [f"--- run report: {rep['model']} on {rep['layout']} ({rep['world']} ranks) ---",
             "layout (tensor fastest, then data, then pipeline; one row per rank):",
             f"  {'rank':>4} {'tp':>3} {'dp':>3} {'pp':>3}  {'layers per chunk':<22} {'its first MLP weight holds':<40}"
             f" {'MiB measured':>12} {'predicted':>9} {'process':>8}"]
    ep = any(r.get("ep") for r in rep["ranks"])  # expert parallel: the data coordinate is (ep, dp)
    if ep:
        lines[-1] = lines[-1].replace(f"{'dp':>3}", f"{'ep,dp':>5}")
    pm = rep.get("predicted_memory") or {}
    for r in sorted(rep["ranks"], key=lambda r: r["rank"]):
        mem = (r["memory"] or {}).get("total_bytes")
        data = f"{r['ep']},{r['dp']}" if ep else r["dp"]
        lines.append(f"  {r['rank']:>4} {r['tp']:>3} {data:>{5 if ep else 3}} {r['pp']:>3}  {' | '.join(r['chunks']):<22} "
                     f"{r['shard']:<40} {_mib(mem):>12} {_mib(pm.get(r['pp'])):>9} "
                     f"{r['process_peak_bytes'] / 2**20:>8.0f}")
    lines.append("  (MiB measured: parameters, gradients, optimizer state, buffers and the peak of saved "
                 "activations in the first step; predicted: `minitron memory`'s formulas; process: peak "
                 "resident memory, PyTorch included)")
    axes = sorted({a for r in rep["ranks"] for a in r["bytes_per_axis"]})
    if axes:
        pred = rep.get("predicted_bytes") or {}
        lines.append("bytes sent per step, by axis (traced first step, the most any rank sent; predicted: "
                     "analysis.comm_bytes_per_step):")
        for a in axes:
            most = max(r["bytes_per_axis"].get(a, 0) for r in rep["ranks"])
            p = pred.get(a)
            lines.append(f"  {a:<8} {_mib(most):>10} MiB   predicted {_mib(p)} MiB")
    lines += _exposure_lines(rep["ranks"])
    b = rep.get("bubble")
    if rep.get("predicted_bubble") is not None:
        measured = f"{b['measured']:.3f} (median of {b['steps']} steps)" if b else "not measured"
        lines.append(f"pipeline bubble (idle / compute time): measured {measured}, "
                     f"predicted {rep['predicted_bubble']:.3f} = {rep.get('bubble_formula', '')} for an ideal machine; "
                     f"the measured one also counts waiting for messages and, with more ranks than cores, "
                     f"for a core")
    moe = rep.get("routing")
    if moe:
        lines.append(f"load balance of the experts (choices per expert over {moe['steps']} steps; max/mean 1.0 "
                     f"is perfect), dropped by capacity {100 * moe['dropped']:.2f} %:")
        for lay in moe["layers"]:
            flag = (f"   ROUTING COLLAPSE: expert {lay['busiest']} and few others take every choice "
                    f"(balancing off or too weak?)" if lay["collapsed"] else "")
            lines.append(f"  layer {lay['layer']:>3}: {' '.join(f'{x:.0f}' for x in lay['total'])}   "
                         f"max/mean {lay['max_over_mean']:.2f}{flag}")
    if tokens_per_s:
        tps = statistics.median(tokens_per_s)
        line = f"throughput: {tps:,.0f} tokens/s (median over steps)"
        if rep.get("peak_flops"):
            mfu = tps * rep["flops_per_token"] / (rep["peak_flops"] * rep["world"])
            line += (f", MFU {mfu:.3f} (model FLOP/s over {rep['world']} x the matmul peak of one rank, "
                     f"{rep['peak_flops'] / 1e9:.1f} GFLOP/s, measured at the start)")
            line += _core_cap(rep["world"])
        lines.append(line)
    return "\n".join(lines)


def _core_cap(world: int, cores: int | None = None) -> str:
    """What caps the MFU when the ranks outnumber the cores: each rank's peak was measured
    with a core to itself, so `world` ranks on `cores` cores reach at most cores/world of it."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if world <= cores:
        return ""
    return (f"; here {world} ranks share {cores} cores, which caps the MFU at {cores}/{world} = {cores / world:.2f} "
            f"(a GPU per rank has no such cap)")
