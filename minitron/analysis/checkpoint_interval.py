"""How often a run that fails should checkpoint: Young (1974) and Daly (2006).

A job of N GPUs is interrupted, on average, every M seconds (its mean time between
failures, MTBF). It saves a checkpoint every τ seconds of work, each save costing δ; an
interruption costs the restart R and the work since the last checkpoint, τ/2 on average.
To first order the fraction of the wall clock lost is

    δ/τ  +  (τ/2 + R)/M,

smallest at Young's τ* = √(2·δ·M) (J. W. Young, "A first order approximation to the
optimum checkpoint interval", CACM 17(9), 1974); Daly ("A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3), 2006) refines it to
√(2·δ·M) − δ for δ < M/2. At τ* the checkpoints and the lost work cost the same, √(2δ/M)
together.

Failures are taken as independent per GPU, so a job's MTBF scales as 1/N: the rate a
published run reports is the rate per GPU times its GPU count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DAY_S = 86_400.0


@dataclass(frozen=True)
class Interruptions:
    """A published count of a run's interruptions over a period."""

    source: str
    gpus: int
    days: float
    interruptions: int  # all of them, planned maintenance included
    unexpected: int  # the failures
    hardware_share: float  # of the unexpected ones

    def mtbf_s(self, gpus: int | None = None) -> float:
        """The mean time between unexpected interruptions of a job of `gpus` GPUs (default: the
        run's own), failures independent per GPU."""
        return mtbf_s(self.unexpected, self.days * DAY_S, self.gpus, gpus or self.gpus)


# Grattafiori et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), §3.3.4 and Table 5:
# a 54-day snapshot of the 405B model's pre-training on 16,384 H100s
LLAMA3_405B = Interruptions(source="Llama 3 (arXiv 2407.21783, §3.3.4)", gpus=16_384, days=54,
                            interruptions=466, unexpected=419, hardware_share=0.78)


def mtbf_s(failures: int, period_s: float, gpus: int, job_gpus: int | None = None) -> float:
    """MTBF of a job of `job_gpus` GPUs (default `gpus`) from `failures` seen in `period_s` on
    `gpus` GPUs: failures independent per GPU, so the rate scales with the GPU count."""
    return period_s / failures * gpus / (job_gpus or gpus)


def young_daly_interval_s(save_s: float, mtbf: float, daly: bool = False) -> float:
    """The checkpoint interval that loses the least: Young's √(2·δ·M), or Daly's √(2·δ·M) − δ."""
    if save_s <= 0 or mtbf <= 0:
        raise ValueError(f"the save time ({save_s}) and the MTBF ({mtbf}) must be positive")
    tau = math.sqrt(2 * save_s * mtbf)
    return tau - save_s if daly else tau


def lost_fraction(interval_s: float, save_s: float, mtbf: float, restart_s: float = 0.0) -> float:
    """The first-order fraction of the wall clock a restarting run loses: the saves (δ/τ) and,
    per failure, half an interval of work and the restart ((τ/2 + R)/M)."""
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf


def live_recovery_lost_fraction(replicas: int, rejoin_s: float, mtbf: float) -> float:
    """The fraction of the samples a live-recovering run (torchft's) does not train on: each
    failure takes one of `replicas` out for `rejoin_s` (its restart and recovery from a peer)
    while the others go on; nothing is redone and no checkpoint interval is paid."""
    return rejoin_s / replicas / mtbf
