"""Analytical models of distributed GPT training, one concept per module.

* :mod:`.params`  parameter counts (PTD-P Eq. 2; minitron's GPT exactly, per rank)
* :mod:`.flops`   FLOPs per iteration (PTD-P Eq. 3) and training time
* :mod:`.memory`  memory per rank: model states (ZeRO), activations (Korthikanti Table 2)
* :mod:`.calls`   collective calls: ring wire volume, pipeline and data-parallel calls, a step's sum
* :mod:`.comm`    communication volume per axis; 1-D/2-D/3-D tensor parallel compared
* :mod:`.bubble`  pipeline bubble and stashed microbatches, per schedule
* :mod:`.cluster` a throughput model of GPU clusters, calibrated on Megatron-LM 2019
* :mod:`.software` the software stack as a value: fused kernels, recomputation, overlap
* :mod:`.explain` one predicted iteration part by part
* :mod:`.planner` enumerate and rank (t, p, d, v, b) layouts

Everything here is pure Python: no processes, no tensors, no global mutable state.
"""
from .bubble import bubble_fraction, bubble_time, ideal_bubble, peak_stashed_microbatches, stashed_on_rank
from .cluster import CLUSTERS, Cluster, PlannedLayout, Prediction, get_cluster, matmul_efficiency, predict
from .calls import (dp_bytes_per_step, ring_allgather_wire_bytes, ring_allreduce_wire_bytes,
                    ring_reduce_scatter_wire_bytes)
from .comm import (comm_bytes_per_step, comm_items, cube_linear_elements, one_d_layer_elements,
                   pp_boundary_bytes, summa_linear_elements, tensor_parallel_comparison, tp_layer_bytes)
from .explain import explain, format_explain
from .flops import (flops_per_iteration, hardware_flops_per_iteration, layer_forward_flops,
                    logit_forward_flops, model_flops_per_iteration, training_time_s)
from .memory import (activation_bytes_on_rank, activation_bytes_per_layer,
                     distributed_optimizer_bytes_per_param, korthikanti_activation_bytes_per_layer,
                     memory_estimate, memory_on_rank, memory_per_rank, zero_bytes_per_param)
from .params import (chunk_layers, layer_param_count, layers_on_rank, padded_vocab, param_count,
                     params_on_rank, params_per_rank, ptdp_param_count, rank_layers, split_layers)
from .planner import plan, valid_layouts
from .software import SOFTWARE, Software, get_software

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
