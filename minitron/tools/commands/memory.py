"""`minitron memory`: the predicted bytes per rank of a layout, the data-parallel traffic of
its ZeRO stage, and whether a rank fits the GPUs it would run on."""
from __future__ import annotations

import json

from ...config import ConfigError, validate
from .options import add_run_args, layout_from, model_from, model_label, train_from


def add_parser(sub) -> None:
    """`memory`: the layout flags and the cluster whose GPU memory a rank is held against."""
    me = sub.add_parser("memory", help="predicted bytes per rank for a layout")
    add_run_args(me)
    me.add_argument("--json", action="store_true")
    me.add_argument("--cluster", default="", help="warn against this cluster's GPU memory (v100-dgx2, a100-dgx, "
                    "h100-dgx; default: against the common training GPUs)")
    me.set_defaults(fn=cmd_memory)


def cmd_memory(args) -> int:
    """`minitron memory`: the bytes per rank of `analysis.memory_per_rank` and the ZeRO traffic."""
    from ...analysis import memory_per_rank

    model, layout = model_from(args), layout_from(args)
    train = train_from(args)
    validate(model, layout, train)
    if args.cluster:
        from ...analysis.cluster import get_cluster

        try:
            get_cluster(args.cluster)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    mem = memory_per_rank(model, layout, train)
    traffic = dp_traffic(model, layout, train)
    warning, fits = memory_warning(mem["total_bytes"], args.cluster)
    if args.json:
        print(json.dumps({"model": model_label(args, model), "layout": layout.describe(), **mem, **traffic,
                          "fits": fits, "warning": warning}))
    else:
        print(f"memory per rank, {model.name} on {layout.describe()} ({train.dtype}, global batch {train.global_batch}, "
              f"{train.microbatches} microbatches):")
        for k, v in mem.items():
            print(f"  {k:<18} {v / 2**20:12.3f} MiB")
        if traffic["dp_call_bytes"]:
            calls = ", ".join(f"{op} {b / 2**20:.3f}" for op, b in traffic["dp_call_bytes"].items())
            print(f"data-parallel traffic per step (ZeRO stage {layout.zero}): calls {calls} MiB; on the wire "
                  f"{traffic['dp_wire_over_all_reduce']:.2f}x one ring all-reduce of the gradients")
        if warning:
            print(warning)
    return 0


def memory_warning(total_bytes: float, cluster: str = "") -> tuple[str, dict]:
    """(A warning line, or "" when the rank fits; {GPU: fits}) for a rank of `total_bytes`
    against the GPU of `cluster`, or, with none named, the common training GPUs
    (analysis.cluster.GPU_MEMORY_BYTES)."""
    from ...analysis.cluster import GPU_MEMORY_BYTES, get_cluster

    gpus = {get_cluster(cluster).gpu: get_cluster(cluster).memory_bytes} if cluster else GPU_MEMORY_BYTES
    fits = {g: total_bytes <= cap for g, cap in gpus.items()}
    size = f"{total_bytes / 2**20:,.0f} MiB ({total_bytes / 1e9:.1f} GB) per rank"
    fix = "split the model further (--tp, --pp), recompute activations (--recompute) or shard states (--zero)"
    if all(fits.values()):
        return "", fits
    if not any(fits.values()):
        names = ", ".join(f"{g} {cap / 1e9:.0f} GB" for g, cap in gpus.items())
        return f"warning: {size} fits no GPU of {names}: {fix}", fits
    small = ", ".join(f"{g} {gpus[g] / 1e9:.0f} GB" for g, ok in fits.items() if not ok)
    return f"warning: {size} does not fit {small} (only {', '.join(g for g, ok in fits.items() if ok)}): {fix}", fits


def dp_traffic(model, layout, train) -> dict:
    """Data-parallel call bytes per step (the largest stage) and the wire bytes of the ZeRO
    stage over one all-reduce's (1 for stages 0-2, 1.5 for stage 3, one microbatch)."""
    from ...analysis.comm import comm_bytes_per_step
    from ...analysis.zero import zero_wire_bytes

    d = layout.dp * layout.cp
    calls = comm_bytes_per_step(model, layout, train).get("dp_cp" if layout.cp > 1 else "dp", {})
    ratio = zero_wire_bytes(1, d, layout.zero) / zero_wire_bytes(1, d, 0) if d > 1 else 0.0
    return {"dp_call_bytes": calls, "dp_wire_over_all_reduce": ratio}
