"""What the tensor-parallel modes share: the differentiable collectives (all-gather and
reduce-scatter along any axis, used by 1-D sequence parallelism and by the cube), the
norms over a hidden dimension split across ranks (the cube and the SUMMA grid), the
vocabulary-parallel cross-entropy (Megatron's; 1-D, the cube and the grid), the mean of a
scalar over grid axes, and the small helpers. Each mode file (``tensor.py``, ``cube.py``,
``summa.py``) imports from here and never from a sibling mode.

What each operation sends is stated next to it, in its docstring: the analysis reads the
same calls off the model (``analysis/dry_run.py``) and the tests hold the two equal.
"""
from __future__ import annotations

import torch


class _AllGather(torch.autograd.Function):
    """All-gather along `axis` on dimension `dim` forward; reduce-scatter the gradient
    backward (the 3-D cube's gathers; sequence parallelism's f is fused into the linear
    it feeds, `_AllGatherLinear`). A parameter (`param`) and its gradient travel in
    the master dtype, an activation in the wire dtype."""

    @staticmethod
    def forward(fctx, x, comm, axis, dim, param):
        fctx.comm, fctx.axis, fctx.dim, fctx.param = comm, axis, dim, param
        return comm.all_gather(x, axis, dim, activation=not param)

    @staticmethod
    def backward(fctx, dy):
        return fctx.comm.reduce_scatter(dy, fctx.axis, fctx.dim, activation=not fctx.param), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along `axis` on dimension `dim` forward; all-gather the gradient
    backward (sequence parallelism's g; the 3-D cube's output reduction)."""

    @staticmethod
    def forward(fctx, x, comm, axis, dim):
        fctx.comm, fctx.axis, fctx.dim = comm, axis, dim
        return comm.reduce_scatter(x, axis, dim, activation=True)

    @staticmethod
    def backward(fctx, dy):
        return fctx.comm.all_gather(dy.contiguous(), fctx.axis, fctx.dim, activation=True), None, None, None


def gather(x, comm, axis: str, dim: int, param: bool = False):
    """Differentiable all-gather of `x` along `axis` on dimension `dim`; `param`: x is a
    parameter (its gradient's reduce-scatter is a gradient reduction: master dtype)."""
    return _AllGather.apply(x, comm, axis, dim, param)


def reduce_scatter(x, comm, axis: str, dim: int):
    """Differentiable reduce-scatter of `x` along `axis` on dimension `dim`."""
    return _ReduceScatter.apply(x, comm, axis, dim)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a mode's own products run in (SUMMA's, the cube's under --tp-overlap):
    autocast's (bf16) when it is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def over_tokens(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aᵀ·b`` summed over every token, [..., n] and [..., m] -> [n, m]: a weight gradient
    (dY and X) of the products SUMMA and the cube write themselves."""
    return a.reshape(-1, a.shape[-1]).t() @ b.reshape(-1, b.shape[-1])


def wants_grad(fctx, i: int) -> bool:
    """Does the running backward pass want the gradient of input `i` of this node?

    Usually whenever the input requires one. But zb-h1 (``pipeline.py``) runs a node
    twice: B asks only for the input gradient, W only for the weight gradients, and
    only the engine knows which edges it follows this time (the question torch's own
    ``register_multi_grad_hook`` asks it). F.linear's backward skips the rest by itself;
    a Function written in Python must ask, or it would do (and communicate) both twice.
    """
    node, _ = fctx.next_functions[i]
    if node is None:  # needs no gradient at all
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # raised only for a leaf that autograd.grad() returns: wanted
        return True


def grouped_rows(t, parts: int):
    """A weight's (or bias') rows stored interleaved, [unit][part] (SwiGLU's [gate|up] pairs:
    any contiguous slice holds whole units), regrouped [part][unit] for the matmul, so that
    each part of the output is one contiguous block: ``y.chunk(parts, -1)`` is then each
    part with unit-stride rows, the fast path of the elementwise kernels that follow (read
    interleaved, silu and its backward are ~10x slower on a CPU). A copy of the local rows
    per forward; autograd moves the gradient back to the stored order."""
    if parts == 1 or t is None:
        return t
    return t.unflatten(0, (-1, parts)).transpose(0, 1).flatten(0, 1)


class ShardedLayerNormFn(torch.autograd.Function):
    """LayerNorm over a hidden dimension split along `axis` (n features in all).

    Forward: one all-reduce of (Σx, Σx²) per token; backward: one all-reduce of
    (Σg, Σg·x̂) with g = dy·w, for the input gradient only (the weight and bias gradients
    are local sums: zb-h1's W pass, which asks for them alone, sends nothing). Saves x̂
    and 1/σ only."""

    @staticmethod
    def forward(fctx, x, weight, bias, comm, axis, n, eps):
        stats = torch.cat([x.sum(-1, keepdim=True), (x * x).sum(-1, keepdim=True)], dim=-1)
        comm.all_reduce(stats, axis)
        mean = stats[..., :1] / n
        rstd = torch.rsqrt(stats[..., 1:] / n - mean * mean + eps)
        xhat = (x - mean) * rstd
        fctx.save_for_backward(xhat, rstd, weight)
        fctx.comm, fctx.axis, fctx.n = comm, axis, n
        return xhat * weight + bias if bias is not None else xhat * weight

    @staticmethod
    def backward(fctx, dy):
        xhat, rstd, weight = fctx.saved_tensors
        rows = tuple(range(dy.dim() - 1))
        dw = (dy * xhat).sum(rows) if wants_grad(fctx, 1) else None
        db = dy.sum(rows) if wants_grad(fctx, 2) else None
        dx = None
        if wants_grad(fctx, 0):
            g = dy * weight
            sums = torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], dim=-1)
            fctx.comm.all_reduce(sums, fctx.axis)
            dx = rstd * (g - sums[..., :1] / fctx.n - xhat * (sums[..., 1:] / fctx.n))
        return dx, dw, db, None, None, None, None


class ShardedRMSNormFn(torch.autograd.Function):
    """RMSNorm over a hidden dimension split along `axis` (n features in all): forward one
    all-reduce of Σx² per token, backward one of Σ(g·x̂) (g = dy·w), for the input
    gradient only. ``dx = rstd·(g − x̂·Σ(g·x̂)/n)``. 16-bit inputs in float32."""

    @staticmethod
    def forward(fctx, x, weight, comm, axis, n, eps):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        ss = (xf * xf).sum(-1, keepdim=True)
        comm.all_reduce(ss, axis)
        rstd = torch.rsqrt(ss / n + eps)
        xhat = xf * rstd
        fctx.save_for_backward(xhat, rstd, weight)
        fctx.comm, fctx.axis, fctx.n, fctx.dtype = comm, axis, n, x.dtype
        return weight * xhat.to(x.dtype)

    @staticmethod
    def backward(fctx, dy):
        xhat, rstd, weight = fctx.saved_tensors
        rows = tuple(range(dy.dim() - 1))
        dw = (dy * xhat.to(dy.dtype)).sum(rows) if wants_grad(fctx, 1) else None
        dx = None
        if wants_grad(fctx, 0):
            g = (dy * weight).to(xhat.dtype)
            s = (g * xhat).sum(-1, keepdim=True)
            fctx.comm.all_reduce(s, fctx.axis)
            dx = (rstd * (g - xhat * (s / fctx.n))).to(fctx.dtype)
        return dx, dw, None, None, None, None


def sharded_norm(x, weight, bias, comm, axis: str, n: int, eps: float, rms: bool):
    """LayerNorm (``rms`` False) or RMSNorm of x whose n hidden features are split along `axis`."""
    if rms:
        return ShardedRMSNormFn.apply(x, weight, comm, axis, n, eps)
    return ShardedLayerNormFn.apply(x, weight, bias, comm, axis, n, eps)


class MeanOverAxes(torch.autograd.Function):
    """Mean of one scalar per batch piece over `axes` (the cube's (i, k) plane, the SUMMA
    grid's column and depth): forward one scalar all-reduce per axis; backward 1/n (every
    rank backpropagates the same global loss)."""

    @staticmethod
    def forward(fctx, x, comm, axes):
        out = x.detach().clone()
        n = 1
        for axis in axes:
            comm.all_reduce(out, axis)
            n *= comm.size(axis)
        fctx.n = n
        return out / n

    @staticmethod
    def backward(fctx, dy):
        return dy / fctx.n, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without gathering them
    (Megatron: all-reduce the max, the target logit and the sum of exponentials)."""

    @staticmethod
    def forward(fctx, logits, target, start, vocab, comm, axis="tp"):
        # logits: [N, V/t] local slice covering vocabulary ids [start, start + V/t)
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        n_local = logits.shape[-1]
        valid = torch.arange(start, start + n_local, device=logits.device) < vocab
        logits = logits.masked_fill(~valid, float("-inf"))  # padded ids never count
        lmax = logits.max(dim=-1).values
        comm.all_reduce(lmax, axis, op="max")
        shifted = logits - lmax.unsqueeze(-1)
        local_t = target - start
        mine = (local_t >= 0) & (local_t < n_local)
        rows = torch.arange(target.shape[0], device=logits.device)
        # where(), not `* mine`: a clamped index may hit a padded id (-inf · 0 = nan)
        tlogit = torch.where(mine, shifted[rows, local_t.clamp(0, n_local - 1)], 0.0)
        comm.all_reduce(tlogit, axis)
        exp = shifted.exp()
        sumexp = exp.sum(dim=-1)
        comm.all_reduce(sumexp, axis)
        softmax = exp / sumexp.unsqueeze(-1)
        fctx.save_for_backward(softmax, local_t.clamp(0, n_local - 1), mine)
        return sumexp.log() - tlogit  # per-token loss

    @staticmethod
    def backward(fctx, dloss):
        softmax, local_t, mine = fctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= mine.to(grad.dtype)
        return grad * dloss.unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, start: int, vocab: int, comm, axis: str = "tp"):
    """Per-token loss from vocabulary-split logits [N, V/t] (start = this rank's first id),
    the vocabulary split over `axis` ('tp'; the 3-D cube uses 'cube_j')."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, vocab, comm, axis)


def bias_keywords(bias: bool) -> dict:
    """The linear's keywords for ``bias``: none when it has one (a learner's linear in a lab
    keeps the engine's signature), ``bias=False`` otherwise."""
    return {} if bias else {"bias": False}
