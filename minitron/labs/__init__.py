"""Lab checkers: each runs the learner's version of one engine function (given as source
text) inside the real engine, on local gloo ranks, and compares the run with the
single-device model and with the engine's closed forms.

==========================  ==========================================  =================
lab                         checker                                     module
==========================  ==========================================  =================
02a the 1F1B schedule       ``check_one_f_one_b(SOURCE)``               :mod:`.pipeline`
02b interleaved 1F1B        ``check_interleaved(SOURCE)``               :mod:`.interleaved`
03a bucketed, overlapped DP ``check_bucketed_dp(SOURCE)``               :mod:`.bucketed_dp`
03b ZeRO-1 over a bucket    ``check_zero1(SOURCE)``                     :mod:`.zero`
04a f and g                 ``check_f_and_g(SOURCE)``                   :mod:`.f_and_g`
04b vocab-parallel CE       ``check_vocab_parallel_ce(SOURCE)``         :mod:`.cross_entropy`
04c the all-gather linear   ``check_all_gather_linear(SOURCE)``         :mod:`.seq_parallel`
05 the 3-D linear           ``check_linear3d(SOURCE)``                  :mod:`.linear3d`
09 the online softmax       ``check_online_softmax(SOURCE)``            :mod:`.online_softmax`
==========================  ==========================================  =================

Every checker returns a dict with ``ok`` and a one-line ``message``, also when the
learner's code does not compile, raises, returns something malformed or hangs; what they
share (the guarded ranks, deadlines, one-line failures, the run against the single-device
model) is :mod:`.runner`.
"""
from .bucketed_dp import check_bucketed_dp
from .cross_entropy import check_vocab_parallel_ce
from .f_and_g import check_f_and_g
from .interleaved import check_interleaved
from .linear3d import check_linear3d
from .online_softmax import check_online_softmax
from .pipeline import check_one_f_one_b
from .runner import LabError
from .seq_parallel import check_all_gather_linear
from .zero import check_zero1

__all__ = ["check_f_and_g", "check_one_f_one_b", "check_zero1", "check_vocab_parallel_ce",
           "check_all_gather_linear", "check_online_softmax", "check_interleaved", "check_bucketed_dp", "check_linear3d", "LabError"]
