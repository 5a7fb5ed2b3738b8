"""2-D (SUMMA) and 2.5-D (Tesseract) tensor parallelism (parallel/summa.py, analysis/summa.py,
analysis/tp_schemes.py).

* pure: the grid's lines partition the ranks; a SUMMA linear's calls give Optimus'
  (q−1)/q²·(|X| + |W|) per product; the four schemes side by side;
* bad input: one line, exit 2, before any process starts;
* one 8-rank launch on the 2×2×2 grid (q = 2, d = 2): every layer type alone against
  the single-device torch op (outputs, input gradients, parameter gradients after the
  depth/column sums), its trace call by call against the analysis, then a whole training
  step's trace and the saved activation bytes against the analysis, and a bf16 step's
  trace (activation blocks in bf16, weight blocks in fp32);
* the oracle, each traced and compared per rank and step with the analysis:
  ``minitron verify --dtype float64`` of 2-D × data parallel with tied embeddings and a
  padded vocabulary, 2.5-D × pipeline (zb-h1's split backward) with tied embeddings, and
  2-D on 16 ranks.
"""
from collections import Counter

import pytest
import torch

from minitron.analysis import summa as A
from minitron.analysis.tp_schemes import compare_tp_schemes, project_tp_schemes, scheme_shapes
from minitron.comm import read_trace
from minitron.config import ModelConfig, ParallelConfig, PRESETS, TrainConfig
from minitron.grid import ProcessGrid
from minitron.tools.testing import last_json, run_cli, run_on_ranks

GRID = ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2)
BF16 = ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2, precision="bf16")
B, S, H, F_, V = 8, 4, 16, 32, 29  # per-layer checks: V = 29 pads to 30 (a multiple of q = 2)


# --- pure --------------------------------------------------------------------------------
def test_grid_lines_partition_the_ranks():
    g = ProcessGrid(tp=8, dp=2, summa_depth=2)
    assert g.summa_q == 2
    assert g.all_groups("summa_row")[:2] == [[0, 1], [2, 3]]
    assert g.all_groups("summa_col")[:2] == [[0, 2], [1, 3]]
    assert g.all_groups("summa_dep")[:2] == [[0, 4], [1, 5]]
    for axis in ("summa_row", "summa_col", "summa_dep"):
        groups = g.all_groups(axis)
        assert sorted(r for grp in groups for r in grp) == list(range(16))
        for grp in groups:  # a line stays inside one data-parallel replica
            assert len({g.coord(r).dp for r in grp}) == 1
    assert [g.summa_coord(r) for r in range(8)] == [(r, c, k) for k in range(2) for r in range(2) for c in range(2)]


@pytest.mark.parametrize("q,b,s,d_in,d_out", [(2, 4, 8, 16, 48), (3, 9, 5, 18, 36), (4, 16, 2, 32, 16)])
def test_linear_calls_give_optimus_formula(q, b, s, d_in, d_out):
    w = A.linear_wire_bytes(b, s, d_in, d_out, q, bytes_per_el=4)
    assert w["fwd"] == pytest.approx(w["formula"]) and w["bwd"] == pytest.approx(2 * w["formula"])
    assert A.linear_calls(b, s, d_in, d_out, 1) == []
    assert {c["calls"] for c in A.linear_calls(b, s, d_in, d_out, q)} == {q}


def test_four_schemes_side_by_side():
    assert scheme_shapes(64) == {"1d": {"t": 64}, "2d": {"q": 8, "depth": 1}, "2.5d": {"q": 4, "depth": 4},
                                 "3d": {"q": 4}}
    assert scheme_shapes(8)["2d"] is None and scheme_shapes(8)["2.5d"] == {"q": 2, "depth": 2}
    tokens = ModelConfig(layers=2, hidden=64, heads=16, seq_len=64)
    rows = {r["scheme"]: r for r in compare_tp_schemes(tokens, 16, 16)}
    assert not rows["3d"]["feasible"] and rows["2.5d"]["grid"] == {"q": 2, "depth": 4}  # 16 is not a cube
    assert rows["2d"]["layer_wire_bytes"] < rows["1d"]["layer_wire_bytes"]
    assert rows["2d"]["layer_sync_wire_bytes"] < rows["2.5d"]["layer_sync_wire_bytes"]  # depth sums weights
    # 2.5-D holds on each of its d copies what 2-D on q² devices holds
    four = {r["scheme"]: r for r in compare_tp_schemes(tokens, 16, 4)}
    assert rows["2.5d"]["layer_param_bytes"] == four["2d"]["layer_param_bytes"]
    assert rows["2.5d"]["model_param_bytes"] == four["2d"]["model_param_bytes"]
    # activations: 2-D and 2.5-D split every saved block over P (LayerNorm's 1/σ over q·d)
    assert max(rows["2d"]["layer_activation_bytes"], rows["2.5d"]["layer_activation_bytes"]) < \
        rows["1d"]["layer_activation_bytes"]
    proj = {r["scheme"]: r for r in project_tp_schemes(ModelConfig(layers=24, hidden=4096, heads=64, seq_len=512,
                                                                   vocab=51200), 64, 64)}
    assert all(r["feasible"] and r["layer_s"] == r["compute_s"] + r["comm_s"] for r in proj.values())
    assert proj["3d"]["speedup_vs"]["1d"] > 1 and proj["3d"]["speedup_vs"]["2d"] > 1


# --- bad input -----------------------------------------------------------------------------
BAD = [
    (["--tp-mode", "2d", "--tp", "8", "--nproc", "8"], "needs a square number of tensor ranks (4, 9, 16...), got --tp 8"),
    (["--tp-mode", "2.5d", "--tp", "12", "--tp-depth", "2", "--nproc", "12"], "--tp 12 is not a square times 2"),
    (["--tp-mode", "2d", "--tp", "4", "--tp-depth", "2"], "--tp-depth is the depth of --tp-mode 2.5d"),
    (["--tp-mode", "2d", "--tp", "9", "--hidden", "32", "--heads", "4"], "hidden 32 divisible by q = 3"),
    (["--tp-mode", "2d", "--tp", "4", "--hidden", "36", "--heads", "3"], "3 heads divisible by q = 2"),
    (["--tp-mode", "2.5d", "--tp", "8", "--tp-depth", "2", "--global-batch", "6"], "microbatch size 6"),
]


def test_bad_input_is_one_line(capsys):
    """The CLI in this process (main() returns before any rank starts), then one case in its
    own `python -m minitron` process for the exit status."""
    from minitron.tools.cli import main

    for argv, words in BAD:
        code = main(["verify", *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("minitron: error:") and words in lines[0], lines
    code, out, err = run_cli(["verify", *BAD[0][0]], timeout=300)
    assert code == 2 and err.strip().splitlines() == [f"minitron: error: --tp-mode 2d {BAD[0][1]}"], err


# --- every layer alone, and a whole step, on the 2×2×2 grid ----------------------------------
def _saved_bytes(fn):
    """Bytes autograd saves while `fn()` runs (each storage once, parameters excluded)."""
    seen, total = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _grid_job(comm):
    import torch.nn.functional as F

    from minitron.context import Context, init_full
    from minitron.optim import sync_replicated_grads
    from minitron.parallel import summa as P
    from minitron.train import Trainer

    torch.manual_seed(0)  # every rank draws the same full tensors
    f64 = torch.float64
    ctx = Context(comm, GRID, f64, seed=5)
    q, _, c, _ = P.grid_of(comm)
    piece, pieces = P.batch_piece(comm), q * comm.size(P.DEP)
    errors, calls = {}, {}

    def block(t):  # this rank's block of a full [b, s, n] tensor: batch piece, last-dim slice c
        return t.chunk(pieces, 0)[piece].chunk(q, -1)[c]

    def err(name, a, b):
        errors[name] = max(errors.get(name, 0.0), float((a - b).abs().max()))

    def traced(name, fwd, grad=None):
        comm.trace.records.clear()
        with comm.in_phase("fwd"):
            y = fwd()
        with comm.in_phase("bwd"):
            y.backward(grad)
        calls[name] = sorted((r["phase"], r["op"], r["axis"], r["bytes"]) for r in comm.trace.records)
        return y

    def synced(*params):  # the once-per-step sums over the copies (column, depth)
        sync_replicated_grads(params, comm)
        return [p.grad for p in params]

    for name, d_in, d_out in [("qkv", H, 3 * H), ("proj", H, H), ("fc", H, F_), ("fc2", F_, H)]:
        lin = P.LinearSumma(name, d_in, d_out, ctx)
        with torch.no_grad():
            lin.bias.copy_(torch.randn(d_out, dtype=f64)[lin.bias.shard.slices])
        X, dY = torch.randn(B, S, d_in, dtype=f64), torch.randn(B, S, d_out, dtype=f64)
        W = init_full(f"{name}.weight", (d_out, d_in), 0.02, ctx).requires_grad_()
        bias = torch.zeros(d_out, dtype=f64, requires_grad=True)
        with torch.no_grad():
            bias[lin.bias.shard.slices] = lin.bias.detach()
        F.linear(X.requires_grad_(), W, bias).backward(dY)
        x = block(X.detach()).clone().requires_grad_()
        y = traced(name, lambda: lin(x), block(dY))
        err("linear out", y, block(F.linear(X.detach(), W.detach(), bias.detach())))
        err("linear dX", x.grad, block(X.grad))
        dw, db = synced(lin.weight, lin.bias)
        err("linear dW", dw, W.grad[lin.weight.shard.slices])
        err("linear dbias", db, bias.grad[lin.bias.shard.slices])

    ln = P.LayerNormSumma("ln", H, ctx)
    X = (1.5 + torch.randn(B, S, H, dtype=f64)).requires_grad_()
    dY = torch.randn(B, S, H, dtype=f64)
    w, b = torch.ones(H, dtype=f64, requires_grad=True), torch.zeros(H, dtype=f64, requires_grad=True)
    ref = F.layer_norm(X, (H,), w, b)
    ref.backward(dY)
    x = block(X.detach()).clone().requires_grad_()
    y = traced("layernorm", lambda: ln(x), block(dY))
    err("layernorm out", y, block(ref.detach()))
    err("layernorm dX", x.grad, block(X.grad))
    dw, db = synced(ln.weight, ln.bias)
    err("layernorm dW", dw, w.grad.chunk(q)[c])
    err("layernorm db", db, b.grad.chunk(q)[c])

    emb = P.EmbeddingSumma("wte", V, H, ctx)
    Wf = init_full("wte.weight", (V, H), 0.02, ctx).requires_grad_()
    ids, tgt = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    E, dE = F.embedding(ids, Wf), torch.randn(B, S, H, dtype=f64)
    E.backward(dE)
    e = traced("embedding", lambda: emb(ids), block(dE))
    err("embedding out", e, block(E.detach()))
    (dw,) = synced(emb.weight)
    region = emb.weight.shard.local_region
    err("embedding dW", dw[region], Wf.grad[emb.weight.shard.slices])
    pad = dw[len(range(V)[emb.weight.shard.slices[0]]):]
    if pad.numel():  # the padded row (id 29, on the second vocabulary slice) never learns
        err("embedding dW padding", pad, 0.0)

    emb.weight.grad, Wf.grad = None, None
    Xh = torch.randn(B, S, H, dtype=f64, requires_grad=True)
    logits = F.linear(Xh, Wf)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    loss.backward()
    x = block(Xh.detach()).clone().requires_grad_()
    comm.trace.records.clear()
    with comm.in_phase("fwd"):
        lg = emb.logits(x)
        head_fwd = [(r["phase"], r["op"], r["axis"], r["bytes"]) for r in comm.trace.records]
        comm.trace.records.clear()
        mine = emb.loss(lg, tgt)
    calls["loss"] = sorted((r["phase"], r["op"], r["axis"], r["bytes"]) for r in comm.trace.records)
    comm.trace.records.clear()
    with comm.in_phase("bwd"):
        mine.backward()
    calls["output layer"] = sorted(head_fwd + [(r["phase"], r["op"], r["axis"], r["bytes"])
                                              for r in comm.trace.records])
    err("output layer logits", lg, block(F.pad(logits.detach(), (0, emb.padded - V))))
    err("loss", mine, loss.detach())
    err("output layer + loss dX", x.grad, block(Xh.grad))
    (dw,) = synced(emb.weight)
    err("output layer dW", dw[region], Wf.grad[emb.weight.shard.slices])

    # a whole training step: tied embeddings, padded vocabulary, two microbatches
    model = PRESETS["tiny"].replace(vocab=257, tied_embeddings=True)
    train = TrainConfig(global_batch=8, microbatches=2, dtype="float64", warmup=1)
    tr = Trainer(model, GRID, train, comm)
    (x0, y0), _ = tr.microbatches(0)
    _, acts = _saved_bytes(lambda: tr.model(x0, y0))
    comm.trace.records.clear()
    tr.step(0)
    step = _per_axis_op(comm.trace.records)

    # the same grid under bf16: activations travel in bf16, weights and their gradients in fp32
    tr = Trainer(PRESETS["tiny"], BF16, TrainConfig(global_batch=4, microbatches=1, warmup=1), comm)
    comm.trace.records.clear()
    tr.step(0)
    dtypes = sorted({(r["op"], r["dtype"]) for r in comm.trace.records if r["op"] == "broadcast"})
    return {"errors": errors, "calls": calls, "acts": acts, "step": step,
            "bf16": _per_axis_op(comm.trace.records), "bf16 broadcasts": dtypes}


def _per_axis_op(records) -> dict:
    """Bytes and calls per (axis, op) of trace records or analysis items (the 'log'
    all-reduce of the loss aside)."""
    out = Counter()
    for r in records:
        if r.get("phase") != "log":
            out[(r["axis"], r["op"], "bytes")] += r["bytes"]
            out[(r["axis"], r["op"], "calls")] += r.get("calls", 1)
    return dict(out)


def _expand(items):
    return sorted((c["phase"], c["op"], c["axis"], c["bytes"]) for c in items for _ in range(c["calls"]))


@pytest.mark.multirank
def test_layers_traces_and_memory_on_the_grid():
    res = run_on_ranks(_grid_job, GRID, trace=True)
    q, d, e = 2, 2, 8
    expected = {
        "qkv": A.linear_calls(B, S, H, 3 * H, q, d, e), "proj": A.linear_calls(B, S, H, H, q, d, e),
        "fc": A.linear_calls(B, S, H, F_, q, d, e), "fc2": A.linear_calls(B, S, F_, H, q, d, e),
        "layernorm": A.layer_norm_calls(B, S, q, d, e), "embedding": A.embedding_calls(B, S, H, q, d, e),
        "output layer": A.output_calls(B, S, H, 30, q, d, e), "loss": A.loss_calls(B, S, q, d, e)}
    model = PRESETS["tiny"].replace(vocab=257, tied_embeddings=True)
    train = TrainConfig(global_batch=8, microbatches=2, dtype="float64")
    step = _per_axis_op(A.summa_comm_items(model, GRID, train))
    bf16 = _per_axis_op(A.summa_comm_items(PRESETS["tiny"], BF16, TrainConfig(global_batch=4, microbatches=1)))
    acts = sum(A.saved_bytes_per_microbatch(model, 4, 8, 2, e).values())
    for rank, r in res.items():
        for name, worst in r["errors"].items():
            assert worst < 1e-12, (rank, name, worst)
        for name, want in expected.items():
            assert r["calls"][name] == _expand(want), (rank, name)
        assert r["step"] == step, rank
        assert r["bf16"] == bf16 and r["bf16 broadcasts"] == [("broadcast", "bfloat16"), ("broadcast", "float32")]
        assert r["acts"] == acts, rank


# --- the oracle, traced ---------------------------------------------------------------------------
def _verify_traced(tmp_path, argv, model, layout, train):
    """`minitron verify --dtype float64 --trace` of a layout: equal to one device, and every
    rank's every step sends per (axis, op) exactly what summa_comm_bytes_per_step says."""
    trace = tmp_path / "trace.jsonl"
    code, out, err = run_cli(["verify", "--json", "--timeout", "300", "--dtype", "float64", "--trace", str(trace),
                              *argv], timeout=900)
    assert code == 0, err[-3000:]
    res = last_json(out)
    assert res["ok"] and res["max_loss_abs_diff"] <= 1e-9 and res["max_param_rel_diff"] <= 1e-9, res
    got: dict = {}
    for r in read_trace(str(trace)):
        if r["phase"] != "log":
            ops = got.setdefault((r["rank"], r["step"]), {}).setdefault(r["axis"], {})
            ops[r["op"]] = ops.get(r["op"], 0) + r["bytes"]
    assert len(got) == layout.world * res["steps"]
    per_stage = layout.tp * layout.dp
    for (rank, step), sent in got.items():
        assert sent == A.summa_comm_bytes_per_step(model, layout, train, pp_rank=rank // per_stage), (rank, step)
    return res


@pytest.mark.multirank
def test_verify_2d_times_data_parallel_tied(tmp_path):
    model = PRESETS["tiny"].replace(vocab=258, tied_embeddings=True)
    layout = ParallelConfig(dp=2, tp=4, tp_mode="2d")
    res = _verify_traced(tmp_path, ["--nproc", "8", "--dp", "2", "--tp", "4", "--tp-mode", "2d", "--vocab", "258",
                                    "--tied", "--microbatches", "2"],
                         model, layout, TrainConfig(global_batch=8, microbatches=2, dtype="float64"))
    assert res["layout"] == "dp2.tp4.pp1.summa"


@pytest.mark.multirank
def test_verify_2p5d_times_pipeline_tied(tmp_path):
    """zb-h1: B asks for input gradients only, W for weight gradients only; the layers
    communicate for what is asked (the output layer broadcasts its logit gradients in both)."""
    model = PRESETS["tiny"].replace(tied_embeddings=True)
    layout = ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2, pp=2, schedule="zb-h1")
    res = _verify_traced(tmp_path, ["--nproc", "16", "--tp", "8", "--tp-mode", "2.5d", "--tp-depth", "2",
                                    "--pp", "2", "--schedule", "zb-h1", "--tied", "--microbatches", "2"],
                         model, layout, TrainConfig(global_batch=8, microbatches=2, dtype="float64"))
    assert res["layout"].startswith("dp1.tp8.pp2.tesseract-d2")


@pytest.mark.multirank
def test_verify_2d_on_16_ranks(tmp_path):
    layout = ParallelConfig(tp=16, tp_mode="2d")
    res = _verify_traced(tmp_path, ["--nproc", "16", "--tp", "16", "--tp-mode", "2d"],
                         PRESETS["tiny"], layout, TrainConfig(global_batch=4, microbatches=1, dtype="float64"))
    assert res["layout"] == "dp1.tp16.pp1.summa"
