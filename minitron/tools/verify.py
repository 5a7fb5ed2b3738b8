"""The oracle: a parallel layout must equal the single-device model.

`verify_job` trains the layout for N steps, gathers the full weights to rank 0 and
trains the single-device reference there — the same GPT class with every parallel
degree 1, same seed, same global batches (microbatches of the same size). It reports
the largest difference of the per-step losses and the largest relative difference of
any parameter tensor (max |Δ| / max |reference|) after the last step.

In bfloat16 (``--dtype bfloat16`` or ``--precision bf16``) that relative difference means
nothing for some tensors: the key bias has an exactly-zero gradient (softmax is invariant
to adding a constant to every score of a row), so Adam turns rounding noise into steps of
±lr and two correct runs disagree on it completely. There :func:`bf16_measures` decides:
the *function* the layout trained (its logits on held-out sequences, computed in float64)
must be as close to the reference's as a few units of bf16 rounding per step allow,
measured against how far training moved it, and no single tensor may be as wrong, in what
it does to that function, as if it had not been trained.

In float32 the same direction can fail the parameter test: Adam's eps (1e-8) is the size
of float32 rounding noise in a gradient, so the key bias again steps on noise. A tensor
whose parameters differ beyond the tolerance is then judged by what it does to the
trained function (:func:`blind_tensor_effects`); every other tensor still by its values.
"""
from __future__ import annotations

import sys

import torch

from .. import data as data_mod
from ..checkpoint import gather_full
from ..comm import TimedTrace
from ..config import TOLERANCE, ModelConfig, ParallelConfig, TrainConfig
from ..train import Trainer, single_device_model

# float64 sums in another order agree to ~1e-14; Adam's update amplifies that a little.
# (bfloat16 has bounds of its own: bf16_measures.)

# bfloat16 keeps 8 significant bits: a rounding moves a value by at most u = 2^-8 of itself.
BF16_UNIT = 2.0 ** -8
FLOAT32_UNIT = 2.0 ** -24
# What a bf16 verdict allows, in units of u per step of training: the layout rounds its sums
# in another order (partial sums of a split matmul, bf16 collectives), which changes each
# step's result by a few u; the differences add up over the steps.
BF16_UNITS_PER_STEP = 4
HELD_OUT_SEQUENCES = 8  # the validation sequences the functions are compared on


def one_device(precision) -> ParallelConfig:
    """The single-device layout computing at `precision`: '--precision' ('fp32', 'bf16'), or
    a layout whose --precision and --fp8-recipe it takes (:func:`numerics`)."""
    return precision if isinstance(precision, ParallelConfig) else ParallelConfig(precision=precision)


def numerics(layout: ParallelConfig) -> ParallelConfig:
    """The single device that computes as `layout` does: its --precision and --fp8-recipe."""
    return ParallelConfig(precision=layout.precision, fp8_recipe=layout.fp8_recipe)


def reference_run(model: ModelConfig, train: TrainConfig, corpus, steps: int, precision="fp32"):
    """The single-device run: losses per step and its trainer (at the layout's --precision)."""
    ref = Trainer(model, one_device(precision), train, corpus=corpus)
    return [ref.step(i) for i in range(steps)], ref


def param_rel_diffs(full: dict, ref_trainer) -> dict:
    """{name: max |Δ| / max |reference|} of every parameter tensor (gathered `full` against
    the single-device trainer's)."""
    out = {}
    for p in ref_trainer.params:
        mine = full[p.shard.name]["param"].to(p.dtype)
        scale = p.detach().abs().max().clamp_min(1e-30)
        out[p.shard.name] = float((mine - p.detach()).abs().max() / scale)
    return out


def compare(losses, full: dict, ref_losses, ref_trainer) -> dict:
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    diffs = param_rel_diffs(full, ref_trainer)
    worst_name = max(diffs, key=diffs.get, default="")
    worst = diffs[worst_name] if worst_name and diffs[worst_name] > 0 else 0.0
    return {"max_loss_abs_diff": loss_diff, "max_param_rel_diff": worst, "worst_param": worst_name if worst else ""}


def is_bf16(layout: ParallelConfig, train: TrainConfig) -> bool:
    """Whether the run computes in bfloat16 (bf16 storage, or bf16 autocast over fp32 weights)."""
    return train.dtype == "bfloat16" or layout.precision == "bf16"


class _Float64Function:
    """The single-device model in float64 on fixed inputs `x` (so that comparing adds no
    rounding of its own), holding `base`'s weights; any of them can be swapped for a call."""

    def __init__(self, model: ModelConfig, train: TrainConfig, base: dict, x):
        self.gpt = single_device_model(model, base, train.replace(dtype="float64")).eval()
        self.params = {p.shard.name: p for p in self.gpt.parameters()}
        self.x = x

    @torch.no_grad()
    def logits(self, weights: dict | None = None) -> torch.Tensor:
        """The logits with {name: {"param": tensor}} in place of the base weights (put back after)."""
        weights = weights or {}
        kept = {n: self.params[n].detach().clone() for n in weights}
        for n, rec in weights.items():
            self.params[n].copy_(rec["param"])
        try:
            return self.gpt(self.x)
        finally:
            for n, v in kept.items():
                self.params[n].copy_(v)


class TrainedFunction:
    """What the single-device run `ref` trained, seen as logits on held-out sequences in
    float64: z_ref (its weights), z_0 (the initial ones), and any weights swapped in."""

    def __init__(self, model: ModelConfig, train: TrainConfig, precision, ref: Trainer, unit: float):
        self.init = gather_full(Trainer(model, one_device(precision), train, corpus=ref.corpus))
        self.ref_full = gather_full(ref)
        x, _ = data_mod.batch(ref.val_data, model.seq_len, HELD_OUT_SEQUENCES, train.seed, data_mod.VALIDATION_STEP)
        self.fn = _Float64Function(model, train, self.ref_full, x)
        self.z_ref = self.fn.logits()
        self.moved = float((self.fn.logits(self.init) - self.z_ref).norm())  # what training did
        self.unit, self._trained = unit, {}

    def rel_diff(self, weights: dict) -> float:
        """||z - z_ref|| / ||z_ref - z_0|| with `weights` in place of the reference's."""
        return float((self.fn.logits(weights) - self.z_ref).norm()) / max(self.moved, 1e-30)

    def tensor_effect(self, weights: dict, name: str) -> float:
        """What `weights`' tensor `name` does to the function over what its training did:
        ||z(ref, T from weights) - z_ref|| / ||z(ref, T from the start) - z_ref|| (floor:
        `unit` of the function's move)."""
        if name not in self._trained:
            self._trained[name] = max(float((self.fn.logits({name: self.init[name]}) - self.z_ref).norm()),
                                      self.unit * self.moved)
        return float((self.fn.logits({name: weights[name]}) - self.z_ref).norm()) / self._trained[name]

    def measures(self, weights: dict) -> dict:
        per_tensor = {n: self.tensor_effect(weights, n) for n in self.ref_full}
        worst = max(per_tensor, key=per_tensor.get)
        return {"fn_rel_diff": self.rel_diff(weights), "max_tensor_fn_rel_diff": per_tensor[worst],
                "worst_tensor": worst}


def bf16_measures(model: ModelConfig, train: TrainConfig, precision, losses, full: dict,
                  ref_losses, ref: Trainer) -> dict:
    """The bf16 verdict's measures on a run (`losses`, gathered weights `full`) against the
    single-device run `ref` (its trainer after the same steps). Functions are compared as
    logits on held-out sequences, in float64: z (the layout's weights), z_ref, z_0 (initial).

    * ``fn_rel_diff`` = ||z - z_ref|| / ||z_ref - z_0||: the layout's distance from the
      reference as a fraction of how far training moved the function. A direction the loss
      cannot see (the key bias) does not count, by construction. Bound ``fn_bound`` =
      BF16_UNITS_PER_STEP * u * steps.
    * ``max_tensor_fn_rel_diff``, per tensor T: ||z(ref, T from the layout) - z_ref|| /
      ||z(ref, T from the start) - z_ref||, what the layout's error in T does to the function
      over what T's whole training did (floor: u of the function's move). Bound 1: no tensor
      may be as wrong as if it had not been trained. (A tensor near 1 in bf16 storage, as
      LayerNorm's weight, moves about one bf16 spacing per step: a correct layout reaches ~0.3.)
    * ``loss_abs_diffs``: step i (from 0) may differ by BF16_UNITS_PER_STEP * u * (i + 1) * |loss|.
    * ``rounding_*`` (reported, not judged; only without dropout, whose masks follow the split):
      the same measures between the reference and a single-device run whose microbatch split
      alone differs, i.e. what reordered bf16 sums do to a correct run.
    """
    steps = len(ref_losses)
    probe = TrainedFunction(model, train, precision, ref, BF16_UNIT)
    res = {"criterion": "bf16: losses, function and every tensor's effect within bf16 rounding",
           **probe.measures(full), "fn_bound": BF16_UNITS_PER_STEP * BF16_UNIT * steps, "tensor_bound": 1.0,
           "loss_abs_diffs": [abs(a - b) for a, b in zip(losses, ref_losses)],
           "loss_bounds": [BF16_UNITS_PER_STEP * BF16_UNIT * (i + 1) * abs(b) for i, b in enumerate(ref_losses)]}
    if not model.dropout:
        other_m = 1 if train.microbatches > 1 else train.global_batch
        torch.manual_seed(train.seed)
        other_losses, other = reference_run(model, train.replace(microbatches=other_m), ref.corpus, steps, precision)
        res.update({f"rounding_{k}": v for k, v in probe.measures(gather_full(other)).items()},
                   rounding_loss_abs_diff=max(abs(a - b) for a, b in zip(other_losses, ref_losses)))
    return res


def bf16_ok(res: dict, tol: float | None = None) -> bool:
    """The bf16 verdict on :func:`bf16_measures`' dict: the function within `tol` (default
    its ``fn_bound``), every tensor within ``tensor_bound`` and every step's loss within its bound."""
    return (res["fn_rel_diff"] <= (tol or res["fn_bound"]) and res["max_tensor_fn_rel_diff"] <= res["tensor_bound"]
            and all(d <= b for d, b in zip(res["loss_abs_diffs"], res["loss_bounds"])))


def versus_one_device(comm, tr, losses, model: ModelConfig, train: TrainConfig,
                      tol: float | None = None) -> dict | None:
    """A trainer's run (`losses`, its parameters gathered from every rank: collective)
    against the single-device model trained on the same data: :func:`compare`'s dict plus
    ``reference_losses`` on rank 0 (and :func:`bf16_measures`' in bf16; in float32, when a
    tensor differs beyond `tol`, ``judged_by_effect``: :func:`blind_tensor_effects`), None on
    the other ranks. `train` describes the reference's steps (its microbatches: the whole
    global batch accumulated on one device); the reference computes at the trainer's --precision."""
    full = gather_full(tr)
    if comm.grid.rank != 0:
        return None
    torch.manual_seed(train.seed)
    ref_losses, ref = reference_run(model, train, tr.corpus, train.steps, numerics(tr.layout))
    progress(comm, "the single-device reference is done: comparing the losses and the parameters")
    res = {**compare(losses, full, ref_losses, ref), "reference_losses": ref_losses}
    if is_bf16(tr.layout, train):  # the parameters' relative difference means little there
        res.update(bf16_measures(model, train, numerics(tr.layout), losses, full, ref_losses, ref))
    elif train.dtype == "float32" and res["max_param_rel_diff"] > (tol or TOLERANCE["float32"]):
        res["judged_by_effect"] = blind_tensor_effects(model, train, numerics(tr.layout), full, ref,
                                                       tol or TOLERANCE["float32"])
    return res


def progress(comm, what: str) -> None:
    """One line on stderr from rank 0: what the verification is doing (it takes tens of seconds)."""
    if comm.grid.rank == 0:
        print(f"verify: {what}", file=sys.stderr, flush=True)


def verify_job(comm, model, layout, train, corpus, extra) -> dict | None:
    """Run on every rank; rank 0 returns the verdict (a dict), others None."""
    tr = Trainer(model, layout, train, comm, corpus)
    losses = []
    with comm.tracing(TimedTrace() if train.timeline else comm.trace):  # --timeline: every call timed
        for i in range(train.steps):
            losses.append(tr.step(i))
            progress(comm, f"{layout.describe()} on {comm.grid.world} ranks: step {i + 1}/{train.steps} done")
        progress(comm, f"gathering the weights to rank 0; then the single-device reference, {train.steps} steps")
        if comm.trace is not None and train.trace:
            comm.trace.write(train.trace)
        if train.timeline and tr.pipeline is not None:
            tr.pipeline.write_timeline(train.timeline)
        if train.timeline:
            comm.write_spans(train.timeline)
    # one reference microbatch per replica's microbatch (a MoE routes, balances and drops per microbatch)
    reference = train.replace(microbatches=train.microbatches * layout.data_replicas, trace="")
    tol = (extra or {}).get("tol")
    res = versus_one_device(comm, tr, losses, model, reference, tol)
    if res is None:
        return None
    if "fn_rel_diff" in res:  # bfloat16: judged by bf16_measures (the function and the losses)
        ok, tol = bf16_ok(res, tol), tol or res["fn_bound"]
    else:
        tol = tol or TOLERANCE[train.dtype]
        ok = res["max_loss_abs_diff"] <= tol and res["max_param_rel_diff"] <= tol
        if not ok and "judged_by_effect" in res:  # float32: tensors the loss cannot see
            ok = res["max_loss_abs_diff"] <= tol and all(e <= tol for e in res["judged_by_effect"].values())
    res.update(ok=ok, tolerance=tol, steps=train.steps, layout=layout.describe(), losses=losses)
    return res


def blind_tensor_effects(model: ModelConfig, train: TrainConfig, precision, full: dict, ref: Trainer,
                         tol: float) -> dict:
    """float32: {name: effect on the trained function} of every tensor whose parameters
    differ from the reference's by more than `tol` (:meth:`TrainedFunction.tensor_effect`).

    Adam divides by sqrt(v) + eps with eps = 1e-8, the size of float32 rounding noise in a
    gradient: where the true gradient is exactly zero (the key bias: softmax does not change
    when every score of a row moves by the same amount) two correct runs step by ±lr on
    their own noise and their parameters disagree. Such a tensor passes when what the
    layout's values do to the function is within `tol` of what its training did: the
    key-bias direction does nothing, by construction; a wrong tensor does a lot. (float64
    noise is far below eps: there the parameters agree and the strict test stands.)"""
    over = [n for n, d in param_rel_diffs(full, ref).items() if d > tol]
    probe = TrainedFunction(model, train, precision, ref, FLOAT32_UNIT)
    return {n: probe.tensor_effect(full, n) for n in over}
