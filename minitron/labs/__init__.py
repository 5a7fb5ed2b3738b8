"""Lab checkers: each runs the learner's version of one engine function (given as source
text) inside the real engine, on local gloo ranks, and compares the run with the
single-device model and with the engine's closed forms.

==========================  ==========================================  =================
lab                         checker                                     module
==========================  ==========================================  =================
00 the ring all-reduce      ``check_ring_allreduce(SOURCE)``            :mod:`.ring_allreduce`
01 the memory estimator     ``check_memory_estimator(SOURCE)``          :mod:`.memory_estimator`
02a the 1F1B schedule       ``check_one_f_one_b(SOURCE)``               :mod:`.pipeline`
02b interleaved 1F1B        ``check_interleaved(SOURCE)``               :mod:`.interleaved`
03a bucketed, overlapped DP ``check_bucketed_dp(SOURCE)``               :mod:`.bucketed_dp`
03b ZeRO-1 over a bucket    ``check_zero1(SOURCE)``                     :mod:`.zero`
04a f and g                 ``check_f_and_g(SOURCE)``                   :mod:`.f_and_g`
04b vocab-parallel CE       ``check_vocab_parallel_ce(SOURCE)``         :mod:`.cross_entropy`
04c the all-gather linear   ``check_all_gather_linear(SOURCE)``         :mod:`.seq_parallel`
04d all-gather-matmul       ``check_all_gather_matmul(SOURCE)``         :mod:`.collective_matmul`
05 the 3-D linear           ``check_linear3d(SOURCE)``                  :mod:`.linear3d`
06 the trillion layout      ``check_trillion_layout(SOURCE)``           :mod:`.trillion_layout`
07a FP8 tensorwise scaling  ``check_fp8_scaling(SOURCE)``               :mod:`.fp8_scaling`
08a the ft replay's rows    ``check_ft_replay(SOURCE)``                 :mod:`.ft_replay`
09 the online softmax       ``check_online_softmax(SOURCE)``            :mod:`.online_softmax`
09b Ulysses' all-to-all     ``check_ulysses(SOURCE)``                   :mod:`.ulysses`
09c packed documents        ``check_packed_documents(SOURCE)``          :mod:`.packed_documents`
10a GQA under tp            ``check_gqa(SOURCE)``                       :mod:`.gqa`
10b rotary under cp         ``check_rope_cp(SOURCE)``                   :mod:`.rope_cp`
11a token dispatch          ``check_dispatch(SOURCE)``                  :mod:`.dispatch`
11b node-limited routing    ``check_node_routing(SOURCE)``              :mod:`.node_routing`
11c the hidden all-to-all   ``check_overlapped_dispatch(SOURCE)``       :mod:`.expert_overlap`
==========================  ==========================================  =================

Every checker returns a dict with ``ok`` and a one-line ``message``, also when the
learner's code does not compile, is still the stub, hands the engine its own piece back,
raises, returns something malformed or hangs; what they share (the screen before any rank
starts, the guarded ranks, deadlines, one-line failures, the one verdict rule for a run
against the single-device model) is :mod:`.runner`.
"""
from .bucketed_dp import check_bucketed_dp
from .collective_matmul import check_all_gather_matmul
from .cross_entropy import check_vocab_parallel_ce
from .dispatch import check_dispatch
from .expert_overlap import check_overlapped_dispatch
from .f_and_g import check_f_and_g
from .fp8_scaling import check_fp8_scaling
from .ft_replay import check_ft_replay
from .gqa import check_gqa
from .interleaved import check_interleaved
from .linear3d import check_linear3d
from .memory_estimator import check_memory_estimator
from .node_routing import check_node_routing
from .online_softmax import check_online_softmax
from .packed_documents import check_packed_documents
from .pipeline import check_one_f_one_b
from .ring_allreduce import check_ring_allreduce
from .rope_cp import check_rope_cp
from .runner import LabError
from .seq_parallel import check_all_gather_linear
from .trillion_layout import check_trillion_layout
from .ulysses import check_ulysses
from .zero import check_zero1

__all__ = ["check_ring_allreduce", "check_memory_estimator", "check_one_f_one_b", "check_interleaved",
           "check_bucketed_dp", "check_zero1", "check_f_and_g", "check_vocab_parallel_ce", "check_all_gather_linear",
           "check_all_gather_matmul", "check_linear3d", "check_trillion_layout", "check_fp8_scaling", "check_ft_replay",
           "check_online_softmax", "check_gqa", "check_ulysses", "check_packed_documents", "check_rope_cp",
           "check_dispatch", "check_node_routing", "check_overlapped_dispatch", "LabError"]
