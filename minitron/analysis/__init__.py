"""Analytical models of distributed GPT training, one concept per module.

* :mod:`.params`  parameter counts (PTD-P Eq. 2; minitron's GPT exactly, per rank)
* :mod:`.flops`   FLOPs per iteration (PTD-P Eq. 3) and training time
* :mod:`.memory`  memory per rank: model states (ZeRO), activations (Korthikanti Table 2)
* :mod:`.calls`   collective calls: ring wire volume, pipeline and data-parallel calls, a step's sum
* :mod:`.comm`    communication volume per axis; 1-D/2-D/3-D tensor parallel compared
* :mod:`.bubble`  pipeline bubble and stashed microbatches, per schedule
* :mod:`.pipeline_sim` a schedule timed (`simulate`): its timeline, bubble and peak stash
* :mod:`.planned_layout` a layout as the cluster model prices it: a ParallelConfig and more
* :mod:`.cluster` a throughput model of GPU clusters, calibrated on Megatron-LM 2019
* :mod:`.software` the software stack as a value: fused kernels, recomputation, overlap
* :mod:`.breakdown` one predicted iteration part by part (`explain`)
* :mod:`.planner` enumerate and rank (t, p, d, v, b) layouts
* :mod:`.checkpoint_interval` failures at scale: MTBF, Young/Daly's checkpoint interval

Everything here is pure Python: no processes, no tensors, no global mutable state.
"""
import importlib

# Each public name's module, imported on first use (PEP 562), so that a command's --help can read
# the software stacks and clusters without importing the analysis that needs torch.
_HOMES = {
    "bubble_fraction": "bubble",
    "bubble_time": "bubble",
    "ideal_bubble": "bubble",
    "peak_stashed_microbatches": "bubble",
    "stashed_on_rank": "bubble",
    "CLUSTERS": "cluster",
    "Cluster": "cluster",
    "PlannedLayout": "planned_layout",
    "Prediction": "cluster",
    "get_cluster": "cluster",
    "matmul_efficiency": "cluster",
    "predict": "cluster",
    "dp_bytes_per_step": "calls",
    "ring_allgather_wire_bytes": "calls",
    "ring_allreduce_wire_bytes": "calls",
    "ring_reduce_scatter_wire_bytes": "calls",
    "comm_bytes_per_step": "comm",
    "comm_items": "comm",
    "cube_linear_elements": "comm",
    "one_d_layer_elements": "comm",
    "pp_boundary_bytes": "comm",
    "summa_linear_elements": "comm",
    "tensor_parallel_comparison": "comm",
    "tp_layer_bytes": "comm",
    "explain": "breakdown",
    "format_explain": "breakdown",
    "flops_per_iteration": "flops",
    "hardware_flops_per_iteration": "flops",
    "layer_forward_flops": "flops",
    "logit_forward_flops": "flops",
    "model_flops_per_iteration": "flops",
    "training_time_s": "flops",
    "activation_bytes_on_rank": "memory",
    "activation_bytes_per_layer": "memory",
    "distributed_optimizer_bytes_per_param": "memory",
    "korthikanti_activation_bytes_per_layer": "memory",
    "memory_estimate": "memory",
    "memory_on_rank": "memory",
    "memory_per_rank": "memory",
    "zero_bytes_per_param": "memory",
    "chunk_layers": "params",
    "layer_param_count": "params",
    "layers_on_rank": "params",
    "padded_vocab": "params",
    "param_count": "params",
    "params_on_rank": "params",
    "params_per_rank": "params",
    "ptdp_param_count": "params",
    "rank_layers": "params",
    "split_layers": "params",
    "plan": "planner",
    "valid_layouts": "planner",
    "SOFTWARE": "software",
    "Software": "software",
    "get_software": "software",
}


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_HOMES))


__all__ = [
    # params
    "ptdp_param_count", "param_count", "layer_param_count", "padded_vocab", "split_layers",
    "chunk_layers", "layers_on_rank", "rank_layers", "params_on_rank", "params_per_rank",
    # flops
    "layer_forward_flops", "logit_forward_flops", "flops_per_iteration", "model_flops_per_iteration",
    "hardware_flops_per_iteration", "training_time_s",
    # memory
    "memory_per_rank", "memory_on_rank", "memory_estimate", "activation_bytes_per_layer",
    "activation_bytes_on_rank", "korthikanti_activation_bytes_per_layer", "zero_bytes_per_param",
    "distributed_optimizer_bytes_per_param",
    # calls, comm
    "ring_allreduce_wire_bytes", "ring_allgather_wire_bytes", "ring_reduce_scatter_wire_bytes",
    "tp_layer_bytes", "pp_boundary_bytes", "dp_bytes_per_step", "comm_items", "comm_bytes_per_step",
    "cube_linear_elements", "summa_linear_elements", "one_d_layer_elements", "tensor_parallel_comparison",
    # bubble
    "bubble_fraction", "bubble_time", "ideal_bubble", "peak_stashed_microbatches", "stashed_on_rank",
    # cluster, planner
    "Cluster", "CLUSTERS", "PlannedLayout", "Prediction", "get_cluster", "matmul_efficiency", "predict",
    "plan", "valid_layouts",
    # software, explain
    "Software", "SOFTWARE", "get_software", "explain", "format_explain",
]
