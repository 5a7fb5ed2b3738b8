"""What the model holds, read from the model itself: a dry run on fake tensors.

The exact figures of the analysis (parameters per rank, the bytes a block saves for its
backward, the communication of the tensor-parallel and context-parallel layers) are not
written here a second time: they are read off minitron's own modules. For one rank of a
layout, the model is built under PyTorch's ``FakeTensorMode`` (tensors with a shape, a
dtype and a device but no data: the CPU's kernels are chosen as in a real run, so what
autograd saves is what a real step saves) with a communication door in dry mode (``Comm(dry=True)``: each call recorded with its real
shape, nothing sent), then

* its parameters are counted (:func:`block_params`, :func:`ends_params`),
* one block runs forward under saved-tensor hooks, which count the distinct storages
  autograd keeps (:func:`block_saved_bytes`, :func:`ends_saved_bytes`),
* one microbatch runs forward and backward with a trace (:func:`dry_trace`).

No FLOP is computed and no byte moves, so the published shapes (a 405B model, a
sequence of 8,192 tokens) cost what the tiny ones do. A new architecture knob in
``model.py`` is thereby known to the analysis, the report and the planner at once. The
papers' closed forms (``params.ptdp_param_count``, ``memory.saved_bytes_per_layer``,
Korthikanti's Table 2) stay explicit as course material, and the tests check them against
these figures for GPT-2 shapes.
"""
from __future__ import annotations

import functools
import math
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..comm import Comm, CommTrace, wire_dtype_for
from ..config import ModelConfig, ParallelConfig
from ..context import Context
from ..grid import ProcessGrid
from ..model import GPT, Block, layers_for
from ..mtp import targets_on_rank
from ..parallel import fp8

CPU = torch.device("cpu")
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _shape_only(layout: ParallelConfig) -> ParallelConfig:
    """The fields of a layout that decide one rank's modules and saved tensors (the cache
    key: data parallelism, ZeRO and the schedule do not change a block)."""
    return ParallelConfig(tp=layout.tp, cp=layout.cp, ep=layout.ep, tp_mode=layout.tp_mode,
                          tp_depth=layout.tp_depth, sp=layout.sp, tp_overlap=layout.tp_overlap,
                          recompute=layout.recompute,
                          precision=layout.precision, fp8_recipe=layout.fp8_recipe,
                          dropout_rng=layout.dropout_rng,
                          cp_mode=layout.cp_mode, cp_a2a=layout.cp_a2a,
                          zero=3 if fp8.gathers_fp8_weights(layout) else 0)  # the FP8 linears' weight scales


def _runnable(model: ModelConfig, i: int | None) -> tuple[ModelConfig, int | None]:
    """The block a dry run can run for block `i`. A mixture of experts routes by the data
    (how many tokens each expert gets is known only once the router has run), which fake
    tensors cannot follow: its forward is read off a dense twin of the active width, one
    MLP of top_k·f_e + the shared width — the expectation under balanced routing, an estimate where
    the dense figures are exact. (Its parameters are counted exactly, from the block itself;
    the experts' all-to-all is priced from routing counts in analysis/experts.py.)"""
    if i is None or not model.is_moe_block(i):
        return model, i
    return model.replace(experts=0, ffn=model.top_k * model.moe_ffn_hidden + model.shared_ffn_hidden,
                         dense_blocks=""), 0


def dry_context(layout: ParallelConfig, rank: int = 0, dtype: torch.dtype = torch.float32,
                trace: CommTrace | None = None, wire_dtype: torch.dtype | None = None) -> Context:
    """Rank `rank`'s view of the tensor and context axes of `layout`, with a dry
    communication door (no process group; activations on the wire in `wire_dtype`);
    build and run under ``FakeTensorMode``."""
    grid = ProcessGrid.for_layout(layout, rank)
    return Context(Comm(grid, trace, dry=True, wire_dtype=wire_dtype), layout, dtype, CPU)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def kind_block(model: ModelConfig, i: int) -> int:
    """The first block of block `i`'s kind (dense or MoE), which stands for every block of
    that kind in the counts read off one built block (a dense block need not be block 0:
    Qwen2-MoE's ``dense_blocks``, DeepSeek-V3's first dense ones come first)."""
    return next(j for j in range(model.layers) if model.is_moe_block(j) == model.is_moe_block(i))


@functools.lru_cache(maxsize=4096)
def _block_params(model: ModelConfig, layout: ParallelConfig, i: int) -> int:
    with FakeTensorMode():
        return _count(Block(i, model, dry_context(layout), layers_for(layout)))


def block_params(model: ModelConfig, layout: ParallelConfig, i: int = 0) -> int:
    """Parameter elements of block `i` on one tensor rank of `layout` (every tensor rank
    holds as many), read from the module built under FakeTensorMode (one block of each
    kind: every dense block holds what block 0 holds, every MoE block what the first does)."""
    kind = kind_block(model, i)
    return _block_params(model, _shape_only(layout), kind)


@functools.lru_cache(maxsize=1024)
def _ends_params(model: ModelConfig, layout: ParallelConfig, first: bool, last: bool) -> int:
    with FakeTensorMode():
        return _count(GPT(model, dry_context(layout), layer_ids=[], first=first, last=last))


def ends_params(model: ModelConfig, layout: ParallelConfig, first: bool, last: bool) -> int:
    """Parameter elements of one pipeline chunk's ends on one tensor rank: the embedding
    (`first`) and the final norm and output layer (`last`). Tied embeddings: a chunk
    holding both ends has one matrix; a last chunk without the first keeps its own copy."""
    return _ends_params(model, _shape_only(layout), first, last) if (first or last) else 0


def _fp8_gathered(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules()
               if isinstance(getattr(m, "fp8", None), fp8.Fp8State) and m.fp8.weight_gathered)


@functools.lru_cache(maxsize=1024)
def _fp8_weight_split(model: ModelConfig, layout: ParallelConfig, i: int | None, first: bool, last: bool) -> tuple:
    with FakeTensorMode():
        ctx = dry_context(layout)
        part = (Block(i, model, ctx, layers_for(layout)) if i is not None
                else GPT(model, ctx, layer_ids=[], first=first, last=last))
        return _fp8_gathered(part), sum(isinstance(getattr(m, "fp8", None), fp8.Fp8State) and m.fp8.weight_gathered
                                        for m in part.modules())


def fp8_gathered_weights(model: ModelConfig, layout: ParallelConfig, i: int | None = 0, first: bool = False,
                         last: bool = False) -> tuple[int, int]:
    """(elements, linears) of the weights ZeRO-3 gathers in FP8 (``fp8.gathers_fp8_weights``)
    in block `i` on one tensor rank, or with `i` None in a chunk's ends; (0, 0) otherwise."""
    lay = _shape_only(layout)
    if not fp8.gathers_fp8_weights(lay) or (i is None and not (first or last)):
        return 0, 0
    if i is not None:  # one block of each kind, as block_params
        i = kind_block(model, i)
    return _fp8_weight_split(model, lay, i, first, last)


def model_params(model: ModelConfig, layout: ParallelConfig = ParallelConfig()) -> int:
    """Parameter elements of the whole model on one tensor rank (each tied weight once)."""
    return ends_params(model, layout, True, True) + sum(block_params(model, layout, i) for i in range(model.layers))


@functools.lru_cache(maxsize=1024)
def _named_params(model: ModelConfig, layout: ParallelConfig, ids: tuple[int, ...], first: bool,
                  last: bool) -> tuple[tuple[str, int], ...]:
    with FakeTensorMode():
        stage = GPT(model, dry_context(layout), layer_ids=list(ids), first=first, last=last)
        return tuple((name, p.numel()) for name, p in stage.named_parameters())


def named_params(model: ModelConfig, layout: ParallelConfig, chunks) -> list[tuple[str, int]]:
    """(name, local elements) of every parameter a rank holds on one tensor rank of `layout`
    (``blocks.3.attn.qkv.bias``, ``ln_f.weight``, ...), for the chunks ``(layer ids, first,
    last)`` it holds (:func:`~minitron.analysis.params.rank_chunks`), read from the modules
    built under FakeTensorMode; a last chunk's copy of a tied ``wte`` is listed again."""
    lay = _shape_only(layout)
    return [named for ids, first, last in chunks for named in _named_params(model, lay, tuple(ids), first, last)]


class _Packed:
    """What a saved-tensor pack hook hands autograd: freed when autograd drops it."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        # detached: a saved *output* would otherwise point back at the node saving it (node ->
        # this -> tensor -> grad_fn = node), a cycle through C++ that only a backward without
        # retain_graph breaks; zb-h1's and the V schedules' split backward retains the graph
        self.t = t.detach()


class SavedBytes:
    """The bytes saved for the backward and alive, one count per storage however many
    tensors view it (the parameters' storages excluded), and their peak since creation or
    :meth:`reset_peak`: the dry run's count on fake tensors and the measured step's on real
    ones (``tools/measure.py``).

    Every saved tensor is wrapped (pack hook); when autograd releases it (its node ran, or
    the graph went) the wrapper dies and its storage's count drops. A storage is known by
    its identity, not its address: a fake tensor's storage has none, and ZeRO-3 frees and
    re-allocates a parameter's. ``hold``/``release`` add other owners (the pipeline stash).
    """

    def __init__(self, params):
        self.exclude = {p.untyped_storage()._cdata for p in params}
        self.alive: dict[int, list] = {}  # storage -> [bytes, owners]
        self.now = self.peak = 0
        self._held: dict = {}

    def _add(self, t) -> int | None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.exclude:
            return None
        entry = self.alive.setdefault(key, [st.nbytes(), 0])
        if entry[1] == 0:  # a storage counts once, however many tensors view it
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return key

    def _drop(self, key: int) -> None:
        entry = self.alive[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.alive[key]

    def pack(self, t):
        packed = _Packed(t)
        key = self._add(t)
        if key is not None:
            weakref.finalize(packed, self._drop, key)
        return packed

    @staticmethod
    def unpack(packed):
        return packed.t

    def hold(self, key, tensors) -> None:
        self._held[key] = [k for k in (self._add(t) for t in tensors if t is not None and t.numel()) if k is not None]

    def release(self, key) -> None:
        for k in self._held.pop(key, []):
            self._drop(k)

    def reset_peak(self) -> None:
        self.peak = self.now


@functools.lru_cache(maxsize=4096)
def _block_saved(model: ModelConfig, i: int, layout: ParallelConfig, b: int, e: int) -> tuple[int, int]:
    """(held, rebuilt): what one block keeps from its forward to its backward, and the
    most its backward holds on top of that at any moment (recomputation's rebuilt tensors)."""
    with FakeTensorMode():
        ctx = dry_context(layout, dtype=_DTYPES[e])
        stage = GPT(model, ctx, layer_ids=[i], first=False, last=False)  # runs the block as training does
        stage.train()
        x = _hidden_input(stage, ctx, b)
        counter = SavedBytes(stage.parameters())
        ctx.saved_tensors = (counter.pack, counter.unpack)  # what recomputation saves again
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            y = stage(x, None, (0, 0))
            held = counter.now
            counter.reset_peak()
            y.backward(torch.ones_like(y))
        return held, counter.peak - held


def _hidden_input(stage: GPT, ctx: Context, b: int) -> torch.Tensor:
    """The hidden states a block receives on this rank, shaped as between pipeline stages
    (the layer namespace decides: a sequence shard under --sp, batch and hidden blocks on
    the cube and the grid)."""
    return torch.empty(stage.boundary_shape(b), dtype=ctx.dtype, device=CPU, requires_grad=True)


def block_saved_bytes(model: ModelConfig, layout: ParallelConfig, micro_batch: int, bytes_per_el: int = 4,
                      i: int = 0) -> int:
    """Bytes block `i` saves for its backward on one tensor rank of `layout`, for one
    microbatch of `micro_batch` sequences with activations of `bytes_per_el` bytes: its
    own forward run on fake tensors (the layout's recomputation applied)."""
    return _block_saved(*_runnable(model, i), _shape_only(layout), micro_batch, bytes_per_el)[0]


def block_rebuilt_bytes(model: ModelConfig, layout: ParallelConfig, micro_batch: int, bytes_per_el: int = 4,
                        i: int = 0) -> int:
    """The most that block `i`'s backward saves on top of what its forward kept: under
    recomputation the rebuilt part of the block (0 without recomputation)."""
    return _block_saved(*_runnable(model, i), _shape_only(layout), micro_batch, bytes_per_el)[1]


def _targets(model: ModelConfig, b: int, s: int) -> torch.Tensor:
    """The targets a last stage is handed for `s` positions, as the Trainer hands them (with
    multi-token prediction the tokens ahead beside each: ``mtp.targets_on_rank``)."""
    return targets_on_rank(torch.zeros(b, s, dtype=torch.long), model.mtp_depths, Comm())


@functools.lru_cache(maxsize=1024)
def _ends_saved(model: ModelConfig, layout: ParallelConfig, b: int, e: int, first: bool, last: bool) -> int:
    with FakeTensorMode():
        ctx = dry_context(layout, dtype=_DTYPES[e])
        stage = GPT(model, ctx, layer_ids=[], first=first, last=last)
        stage.train()
        s = model.seq_len // layout.cp
        x = torch.zeros(b, s, dtype=torch.long) if first else _hidden_input(stage, ctx, b)
        counter = SavedBytes(stage.parameters())
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            out = stage(x, _targets(model, b, s) if last else None, (0, 0))
            return counter.now


def ends_saved_bytes(model: ModelConfig, layout: ParallelConfig, micro_batch: int, bytes_per_el: int = 4,
                     first: bool = True, last: bool = True) -> int:
    """Bytes the embedding (`first`) or the final norm, output layer and loss (`last`)
    save for the backward on one tensor rank, for one microbatch: their own forward run
    on fake tensors."""
    if not (first or last):
        return 0
    return _ends_saved(model, _shape_only(layout), micro_batch, bytes_per_el, first, last)


def dry_trace(model: ModelConfig, layout: ParallelConfig, micro_batch: int, rank: int = 0, bytes_per_el: int = 4,
              layer_ids=None, first: bool = True, last: bool = True) -> CommTrace:
    """The calls one microbatch's forward and backward make on rank `rank` of `layout`'s
    tensor and context axes (one pipeline chunk: `layer_ids`, `first`, `last`), recorded
    by a dry run: the tensor-parallel and context-parallel traffic, by axis and op.
    `bytes_per_el`: the parameters' dtype; under ``precision='bf16'`` the step runs as the
    Trainer runs it, in autocast with bf16 activations on the wire."""
    lay, trace = layout, CommTrace()
    with FakeTensorMode():
        ctx = dry_context(_shape_only(lay), rank, _DTYPES[bytes_per_el], trace, wire_dtype_for(lay))
        stage = GPT(model, ctx, layer_ids=layer_ids, first=first, last=last)
        stage.train()
        s = model.seq_len // lay.cp
        x = torch.zeros(micro_batch, s, dtype=torch.long) if first else _hidden_input(stage, ctx, micro_batch)
        targets = _targets(model, micro_batch, s) if last else None
        with ctx.comm.in_phase("fwd"), ctx.autocast():
            out = stage(x, targets, (0, 0))
        with ctx.comm.in_phase("bwd"):
            out.backward(None if last else torch.ones_like(out))
    return trace


# --------------------------------------------------------------------------------------
# The tensor- and context-parallel calls of a step, read off the model
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2048)
def _part_calls(model: ModelConfig, layout: ParallelConfig, b: int, e: int, i: int | None,
                first: bool, last: bool) -> tuple[tuple[str, str, int, int], ...]:
    """(axis, op, calls, bytes) of one microbatch's forward and backward through block `i`
    (None: no block) with the ends `first`/`last`, on tensor rank 0."""
    trace = dry_trace(model, layout, b, 0, e, [] if i is None else [i], first, last)
    out: dict[tuple[str, str], list[int]] = {}
    for r in trace.records:
        acc = out.setdefault((r["axis"], r["op"]), [0, 0])
        acc[0] += 1
        acc[1] += r["bytes"]
    return tuple((axis, op, n, nbytes) for (axis, op), (n, nbytes) in out.items())  # in the order first called


@functools.lru_cache(maxsize=256)
def _mlp_calls(model: ModelConfig, layout: ParallelConfig, b: int, e: int, moe: bool) -> tuple:
    """(axis, op, calls, bytes) of one MLP's forward and backward alone, on tensor rank 0:
    the dense MLP, or (`moe`) a mixture's tensor-parallel region — its entry (the sequence
    gathered under --sp), its exit, and its shared experts' MLP — the routing and the
    experts' all-to-all apart (their bytes come from the routing counts)."""
    from ..model import MLP
    from ..moe import MoE

    trace = CommTrace()
    with FakeTensorMode():
        ctx = dry_context(layout, 0, _DTYPES[e], trace)
        layers = layers_for(layout)
        x = torch.empty(layers.boundary_shape(b, model.seq_len // layout.cp, model.hidden, ctx), dtype=ctx.dtype,
                        requires_grad=True)
        with ctx.comm.in_phase("fwd"):
            if moe:
                mix = MoE("blocks.0.mlp", model, ctx, layers, MLP)
                y = layers.leave(mix.enter(x), ctx)
                y = y if mix.shared is None else y + mix.shared(x)
            else:
                y = MLP("blocks.0.mlp", model, ctx, layers)(x)
        with ctx.comm.in_phase("bwd"):
            y.backward(torch.ones_like(y))
    out: dict[tuple[str, str], list[int]] = {}
    for r in trace.records:
        acc = out.setdefault((r["axis"], r["op"]), [0, 0])
        acc[0], acc[1] = acc[0] + 1, acc[1] + r["bytes"]
    return tuple((axis, op, n, nbytes) for (axis, op), (n, nbytes) in out.items())


def _swap_calls(calls: tuple, out: tuple, into: tuple) -> tuple:
    """A block's calls with the calls `out` taken away and `into` added, per (axis, op)."""
    acc: dict[tuple[str, str], list[int]] = {}
    for sign, part in ((1, calls), (-1, out), (1, into)):
        for axis, op, n, nbytes in part:
            a = acc.setdefault((axis, op), [0, 0])
            a[0], a[1] = a[0] + sign * n, a[1] + sign * nbytes
    return tuple((axis, op, n, nbytes) for (axis, op), (n, nbytes) in acc.items() if n)


def _fp8_histories(model: ModelConfig, layout: ParallelConfig, ids: tuple, first: bool, last: bool) -> int:
    with FakeTensorMode():
        stage = GPT(model, dry_context(layout), layer_ids=list(ids), first=first, last=last)
        return len(fp8.delayed_states([stage]))


def fp8_histories(model: ModelConfig, layout: ParallelConfig, chunks) -> int:
    """The linears with a delayed-scaling amax history on one pipeline rank's `chunks`
    ((layer ids, first, last) each), counted on the built model."""
    lay = _shape_only(layout)
    return sum(_fp8_histories(model, lay, tuple(ids), first, last) for ids, first, last in chunks)


@functools.lru_cache(maxsize=1024)
def _grad_sync_calls(model: ModelConfig, layout: ParallelConfig, i: int | None, first: bool, last: bool,
                     e: int) -> tuple[tuple[str, str, int, int], ...]:
    """(axis, op, calls, bytes) of summing the replicated gradients of block `i` (None: no
    block) and the ends `first`/`last` (``ShardInfo.grad_sync``: norms and biases under
    sequence parallelism, replicated key/value heads, the tied embedding), read off their
    parameters: one all-reduce per parameter and axis (``optim.sync_replicated_grads``)."""
    with FakeTensorMode():
        stage = GPT(model, dry_context(layout, dtype=_DTYPES[e]), layer_ids=[] if i is None else [i],
                    first=first, last=last)
        out: dict[tuple[str, str], list[int]] = {}
        for p in {id(p): p for p in stage.parameters()}.values():
            for axis in p.shard.grad_sync:
                acc = out.setdefault((axis, "all_reduce"), [0, 0])
                acc[0] += 1
                acc[1] += p.numel() * e
    return tuple((axis, op, n, nbytes) for (axis, op), (n, nbytes) in sorted(out.items()))


def model_calls(model: ModelConfig, layout: ParallelConfig, micro_batch: int, microbatches: int, chunks,
                bytes_per_el: int = 4) -> list[dict]:
    """The calls that one pipeline rank's model chunks make in one step, read off the model:
    the forward and backward of `microbatches` microbatches through every block and end
    (the tensor- and context-parallel collectives, recomputation's replays included), then
    the sums of replicated gradients. `chunks`: (layer ids, first, last) of each chunk the
    rank holds; `bytes_per_el`: the parameters' dtype. Items ``{what, axis, op, calls,
    bytes}`` as :func:`analysis.comm.comm_items` lists them; the axes the model does not
    speak (pipeline, data, the tied embedding's sum) are not here. Blocks of one kind send
    the same, so one of each kind is run."""
    lay = _shape_only(layout)
    m, e, items = microbatches, bytes_per_el, []

    def add(what: str, calls, times: int) -> None:
        for axis, op, n, nbytes in calls:
            if axis != "embed":  # the tied embedding's sum crosses stages: analysis.comm counts it
                items.append({"what": what, "axis": axis, "op": op, "calls": times * n, "bytes": times * nbytes})

    for ids, first, last in chunks:
        kinds: dict[object, list[int]] = {}
        for i in ids:  # dense blocks of one window are all alike; a MoE block is its own kind
            kinds.setdefault(i if model.is_moe_block(i) else ("dense", model.window_of(i)), []).append(i)
        for same in kinds.values():
            twin, i = _runnable(model, same[0])
            calls = _part_calls(twin, lay, micro_batch, e, i, False, False)
            if model.is_moe_block(same[0]):  # the twin's MLP traded for the mixture's own region
                calls = _swap_calls(calls, _mlp_calls(twin, lay, micro_batch, e, False),
                                    _mlp_calls(model, lay, micro_batch, e, True))
            add("transformer layers", calls, m * len(same))
            add("replicated parameter gradients", _grad_sync_calls(model, lay, same[0], False, False, e), len(same))
        if first or last:
            what = " and ".join(w for w, held in (("embedding", first), ("output layer and loss", last)) if held)
            add(what, _part_calls(model, lay, micro_batch, e, None, first, last), m)
            add("replicated parameter gradients", _grad_sync_calls(model, lay, None, first, last, e), 1)
    return items


@functools.lru_cache(maxsize=1024)
def _boundary(model: ModelConfig, layout: ParallelConfig, b: int) -> int:
    with FakeTensorMode():
        return math.prod(GPT(model, dry_context(layout), layer_ids=[], first=False, last=False).boundary_shape(b))


def boundary_elements(model: ModelConfig, layout: ParallelConfig, micro_batch: int) -> int:
    """Elements of the hidden states one rank sends to the next pipeline stage for one
    microbatch, as the layout's layer namespace shapes them (a sequence shard under --sp,
    a block of batch and hidden on the grid and the cube)."""
    return _boundary(model, _shape_only(layout), micro_batch)


@functools.lru_cache(maxsize=1024)
def _embedding(model: ModelConfig, layout: ParallelConfig) -> int:
    with FakeTensorMode():
        return _count(GPT(model, dry_context(layout), layer_ids=[], first=True, last=False).wte)


def embedding_elements(model: ModelConfig, layout: ParallelConfig) -> int:
    """Elements of the token embedding's shard on one rank (what a tied embedding's
    gradient sum between the first and the last stage moves)."""
    return _embedding(model, _shape_only(layout))


@functools.lru_cache(maxsize=1024)
def _by_data_axes(model: ModelConfig, layout: ParallelConfig, i: int | None, first: bool, last: bool) -> tuple:
    with FakeTensorMode():
        stage = GPT(model, dry_context(layout), layer_ids=[] if i is None else [i], first=first, last=last)
        out: dict[tuple, int] = {}
        for p in {id(p): p for p in stage.parameters()}.values():
            if p.requires_grad:  # (a router's selection bias moves by counts, not by a gradient)
                out[p.shard.data_axes] = out.get(p.shard.data_axes, 0) + p.numel()
    return tuple(sorted(out.items()))


def unit_params_by_data_axes(model: ModelConfig, layout: ParallelConfig, i: int | None = 0, first: bool = False,
                             last: bool = False) -> dict[tuple, int]:
    """Trained parameter elements of block `i` on one rank (or, with `i` None, of a chunk's
    ends), by the data axes their gradients are averaged over (``ShardInfo.data_axes``: a
    dense weight over dp, cp and ep, an expert over dp and cp only)."""
    if i is None and not (first or last):
        return {}
    if i is not None:  # one block of each kind, as block_params
        i = kind_block(model, i)
    return dict(_by_data_axes(model, _shape_only(layout), i, first, last))


def params_by_data_axes(model: ModelConfig, layout: ParallelConfig, chunks) -> dict[tuple, int]:
    """A rank's trained parameter elements grouped by the data axes their gradients are
    averaged over (:func:`unit_params_by_data_axes`), for the chunks ``(layer ids, first,
    last)`` it holds: every block, and the ends once per rank (a V's rank 0 holds both, its
    last stage reading the first's embedding)."""
    chunks = list(chunks)
    first, last = any(c[1] for c in chunks), any(c[2] for c in chunks)
    out: dict[tuple, int] = {}
    for i, f, l in [(i, False, False) for ids, _, _ in chunks for i in ids] + [(None, first, last)]:
        for axes, n in unit_params_by_data_axes(model, layout, i, f, l).items():
            out[axes] = out.get(axes, 0) + n
    return out
