"""Explaining a prediction: where one iteration's time goes, part by part.

:func:`~minitron.analysis.cluster.predict` prices the slowest pipeline stage piece by
piece; :func:`explain` lays those pieces out as rows — the matrix multiplies by kind
(the four linears of a layer, the attention products, the logit layer), the element-wise
kernels, the recomputed forward, each parallel axis's communication (tensor, context,
expert, FSDP, pipeline, data) (what stays on the
critical path, and what the software hides behind computation), the time the GPU waits
for the host to issue its kernels, the pipeline bubble and
the optimizer step — with their seconds and their share of the iteration. The exposed
rows add up to the iteration time; hidden communication is shown for information and
takes no share.
"""
from __future__ import annotations

from .cluster import Prediction

__all__ = ["explain", "format_explain", "EXPLAIN_PARTS"]

# (key in Prediction.breakdown["parts"], label, group); hidden rows take no share.
EXPLAIN_PARTS = [
    ("qkv", "matmul: QKV projection", "matmul"),
    ("proj", "matmul: attention output projection", "matmul"),
    ("fc1", "matmul: MLP up (gate and up with SwiGLU; MoE: shared experts)", "matmul"),
    ("fc2", "matmul: MLP down (MoE: shared experts)", "matmul"),
    ("experts", "matmul: routed experts and router", "matmul"),
    ("attention", "matmul: attention scores and values", "matmul"),
    ("logits", "matmul: logit layer", "matmul"),
    ("elementwise", "element-wise kernels (norms, softmax, dropout, activation, loss)", "elementwise"),
    ("recompute", "recomputed forward", "recompute"),
    ("tp_comm", "tensor-parallel communication, exposed", "communication"),
    ("tp_comm_hidden", "tensor-parallel communication, hidden", "hidden"),
    ("cp_comm", "context-parallel K/V exchange, exposed", "communication"),
    ("cp_comm_hidden", "context-parallel K/V exchange, hidden", "hidden"),
    ("ep_comm", "expert-parallel all-to-all, exposed", "communication"),
    ("ep_comm_hidden", "expert-parallel all-to-all, hidden", "hidden"),
    ("fsdp_comm", "FSDP weight all-gathers and reduce-scatters, exposed", "communication"),
    ("fsdp_comm_hidden", "FSDP weight all-gathers and reduce-scatters, hidden", "hidden"),
    ("pp_comm", "pipeline sends, exposed", "communication"),
    ("pp_comm_hidden", "pipeline sends, hidden", "hidden"),
    ("dp_comm", "data-parallel gradient reduction, exposed", "communication"),
    ("dp_comm_hidden", "data-parallel gradient reduction, hidden", "hidden"),
    ("host_wait", "waiting for the host to issue kernels (launch-bound MoE layers)", "host"),
    ("bubble", "pipeline bubble", "bubble"),
    ("optimizer", "optimizer step", "optimizer"),
]


def explain(pred: Prediction) -> list[dict]:
    """One row per part of the predicted iteration: ``part, label, group, seconds,
    share`` (of ``pred.iteration_s``; 0 for hidden communication). The exposed rows'
    seconds add up to the iteration time."""
    parts = pred.breakdown["parts"]
    rows = []
    for key, label, group in EXPLAIN_PARTS:
        sec = parts[key]
        rows.append({"part": key, "label": label, "group": group, "seconds": sec,
                     "share": 0.0 if group == "hidden" else sec / pred.iteration_s})
    return rows


def format_explain(pred: Prediction, kernels: bool = False) -> str:
    """:func:`explain` as a text table, with the iteration's total and its software; with
    `kernels`, a line per kind of work naming the kernel assumed and where its speed comes
    from (``minitron plan --explain``)."""
    rows = explain(pred)
    width = max(len(r["label"]) for r in rows)
    lines = [f"{'part':<{width}} {'seconds':>9} {'share':>7}"]
    for r in rows:
        share = "(hidden)" if r["group"] == "hidden" else f"{r['share']:>7.1%}"
        lines.append(f"{r['label']:<{width}} {r['seconds']:>9.3f} {share:>7}")
    bd = pred.breakdown
    lines.append(f"{'iteration':<{width}} {pred.iteration_s:>9.3f} {1:>7.1%}")
    lines.append(f"software {bd['software']}{' (FP8 matmuls)' if bd.get('fp8') else ''}, recompute "
                 f"{bd['recompute']}, {bd['microbatches']} microbatches "
                 f"per pipeline, bubble fraction {pred.bubble_fraction:.3f}, "
                 f"{pred.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {bd['mfu']:.1%}")
    lines += [f"kernel assumed, {group}: {what}" for group, what in bd["kernels"].items()] if kernels else []
    return "\n".join(lines)
