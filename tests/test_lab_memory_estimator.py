"""Lab 1's checker (``minitron.labs.memory_estimator``): the reference estimate meets the
bytes measured on real ranks, the usual mistakes each get their own line (the component,
the layout, the stage, by how much).

What needs no measurement (a stub, the engine's own estimate, a malformed answer) is
refused before any rank starts; the rest shares one launch of 2 ranks (three layouts).
"""
import pytest

from minitron.analysis import memory_on_rank
from minitron.labs.memory_estimator import (ACT_TOL, GENERAL, GENERAL_LAYOUTS, GENERAL_TRAIN, LAYOUTS, MODEL, TRAIN,
                                           check_memory_estimator, counted, measure)
from planted import broken_in

REFERENCE = '''
def estimate(model, layout, train, stage):
    h, s, a, V, L, f = model.hidden, model.seq_len, model.heads, model.vocab, model.layers, model.ffn_hidden
    t, p, d = layout.tp, layout.pp, layout.dp
    e = 8 if train.dtype == "float64" else 4
    m = train.microbatches
    b = train.global_batch // (d * m)
    Vp = -(-V // t) * t
    layer = 2 * h + 3 * h * h // t + 3 * h // t + h * h // t + h + 2 * h + f * h // t + f // t + h * f // t + h
    layers = L // p
    n = layers * layer
    if stage == 0:
        n += Vp // t * h + s * h
    if stage == p - 1:
        n += 2 * h + Vp // t * h
    sbh = s * b * h
    ts = t if layout.sp else 1
    inside = (4 * e + 2 * e * f / h) * sbh / t + (2 * e + 1) * a * s * s * b / t
    outside = (4 * e + 2) * sbh / ts
    stash = min(p - stage, m)
    acts = stash * layers * (inside + outside)
    if stage == 0:
        acts += stash * s * b * h / ts
    if stage == p - 1:
        acts += 2 * e * sbh / ts + 4 * b * s * Vp / t
    return {"params_bytes": e * n, "grads_bytes": e * n, "optimizer_bytes": 2 * e * n, "activations_bytes": acts}
'''


broken = broken_in(REFERENCE)


def test_refused_before_any_rank_starts():
    stub = "def estimate(model, layout, train, stage):\n    raise NotImplementedError  # your code here\n"
    assert check_memory_estimator(stub)["message"].startswith("estimate is not written yet")
    engine = "from minitron.analysis import memory_on_rank\ndef estimate(model, layout, train, stage):\n    return 0\n"
    assert "your code uses the engine's own minitron.analysis" in check_memory_estimator(engine)["message"]
    syntax = broken("def estimate(model, layout, train, stage):", "def estimate(model, layout, train, stage)")
    assert check_memory_estimator(syntax)["message"].startswith("your code does not compile")
    malformed = broken('"activations_bytes": acts}', '"activation_bytes": acts}')
    assert "return a dict with the keys params_bytes" in check_memory_estimator(malformed)["message"]


@pytest.mark.parametrize("module", ["importlib.import_module('minitron.' + 'analysis')",
                                    "sys.modules['minitron.' + 'analysis.memory']",
                                    "__import__('minitron.' + 'analysis', fromlist=['x'])"])
def test_the_engines_estimate_is_refused_whatever_the_route(module):
    """Before any rank starts: the estimate runs in this process, watched."""
    source = (f"import importlib, sys\ndef estimate(model, layout, train, stage):\n    A = {module}\n"
              "    return A.memory_on_rank(model, layout, train, stage)\n")
    res = check_memory_estimator(source, measured={})
    assert res["message"].startswith("your code runs the engine's own minitron.analysis.memory (from line 4 of "
                                     "your code: `return A.memory_on_rank(model, layout, train, stage)`)"), res


def test_the_general_sizes_are_what_they_claim():
    """A vocabulary that needs padding on t = 3, m < p: what the old sizes could not tell apart."""
    assert GENERAL.vocab % GENERAL_LAYOUTS["--tp 3 --sp"][0].tp
    lay = GENERAL_LAYOUTS["--tp 2 --pp 3 --sp"][0]
    assert GENERAL_TRAIN.microbatches < lay.pp
    assert sorted(counted()["--tp 2 --pp 3 --sp"]) == [0, 1, 2]


@pytest.mark.multirank
def test_reference_meets_the_measurement_and_mistakes_get_one_line():
    measured = measure()
    for name, (layout, _) in LAYOUTS.items():  # the measurement is the engine's own model of itself
        assert sorted(measured[name]) == list(range(layout.pp))
        for stage, got in measured[name].items():
            want = memory_on_rank(MODEL, layout, TRAIN, stage)
            assert all(got[k] == want[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")), (name, stage)
    ok = check_memory_estimator(REFERENCE, measured=measured)
    assert ok["ok"], ok
    for row in ok["rows"]:
        for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert row[f"{k} est"] == row[f"{k} measured"]
        if row["activations compared"]:
            assert abs(row["activations_bytes est"] / row["activations_bytes measured"] - 1) <= ACT_TOL
    assert {row["model"] for row in ok["rows"]} == {MODEL.name, GENERAL.name}
    cases = {
        "parameters not divided by t": (
            broken("layer = 2 * h + 3 * h * h // t + 3 * h // t + h * h // t + h + 2 * h + f * h // t + f // t "
                   "+ h * f // t + h", "layer = 12 * h * h + 13 * h"),
            "params_bytes on --tp 2 --sp, stage 0: your estimate 240384, measured 140288 (1.71x; must agree "
            "exactly): tensor parallelism splits"),
        "one Adam moment": (
            broken('"optimizer_bytes": 2 * e * n', '"optimizer_bytes": e * n'),
            "optimizer_bytes on --dp 2, stage 0: your estimate 273152, measured 546304 (0.50x; must agree exactly): "
            "AdamW keeps two moments per parameter"),
        "no pipeline stash": (
            broken("stash = min(p - stage, m)", "stash = 1"),
            "activations_bytes on --pp 2, stage 0: your estimate"),
        "sequence parallelism ignored outside": (
            broken("outside = (4 * e + 2) * sbh / ts", "outside = (4 * e + 2) * sbh"),
            "activations_bytes on --tp 2 --sp, stage 0: your estimate"),
    }
    layer = ("layer = 2 * h + 3 * h * h // t + 3 * h // t + h * h // t + h + 2 * h + f * h // t + f // t "
             "+ h * f // t + h")
    cases |= {  # what the old fixed sizes (V = 256 on t = 2, m > p) or the old 5 % let through, and omissions
        "vocabulary unpadded": (
            broken("Vp = -(-V // t) * t", "Vp = V"),
            "params_bytes on --tp 3 --sp of a 6-layer GPT with h = 48, vocabulary 257, m = 2, stage 0: your estimate "
            "268416, the engine counts 268800 (1.00x; must agree exactly): you count the vocabulary unpadded: the "
            "embedding and the output layer hold it padded to a multiple of t (257 → 258 rows, 86 per rank)"),
        "attention's dropout mask forgotten (4 %)": (
            broken("(2 * e + 1) * a * s * s * b / t", "2 * e * a * s * s * b / t"),
            "activations_bytes on --dp 2, stage 0: your estimate 443392, measured 463140 (0.96x; must agree within "
            "1.5%): you leave out the attention's dropout mask"),
        "p - stage in flight when m < p": (
            broken("stash = min(p - stage, m)", "stash = p - stage"),
            "activations_bytes on --tp 2 --pp 3 --sp of a 6-layer GPT with h = 48, vocabulary 257, m = 2, stage 0: "
            "your estimate 1938816, the engine counts 1299744 (1.49x; must agree within 1.5%): you keep p − stage = 3 "
            "microbatches in flight, but there are only m = 2: 1F1B keeps min(p − stage, m)"),
        "fp32 master copy forgotten under bf16": (
            broken('e = 8 if train.dtype == "float64" else 4',
                   'e = 8 if train.dtype == "float64" else (2 if layout.precision == "bf16" else 4)'),
            "params_bytes on --dp 3 --precision bf16 of a 6-layer GPT with h = 48, vocabulary 257, m = 2, stage 0: "
            "your estimate 391104, the engine counts 782208 (0.50x; must agree exactly): you count 2-byte parameters "
            "under bf16 mixed precision: the parameters stay float32, their own master copy"),
        "biases left out": (
            broken(layer, "layer = 2 * h + 3 * h * h // t + h * h // t + 2 * h + f * h // t + h * f // t"),
            "params_bytes on --dp 2, stage 0: your estimate 268544, measured 273152 (0.98x; must agree exactly): you "
            "leave out the biases"),
        "LayerNorms left out": (
            broken(layer, "layer = 3 * h * h // t + 3 * h // t + h * h // t + h + f * h // t + f // t "
                          "+ h * f // t + h"),
            "params_bytes on --dp 2, stage 0: your estimate 271104, measured 273152 (0.99x; must agree exactly): you "
            "leave out the LayerNorms' weights and biases"),
    }
    for name, (source, words) in cases.items():
        res = check_memory_estimator(source, measured=measured)
        assert not res["ok"] and words in res["message"] and "\n" not in res["message"], (name, res)
    assert "1F1B keeps the activations of min(p − stage, m)" in check_memory_estimator(
        cases["no pipeline stash"][0], measured=measured)["message"]
    assert "dropout masks included, over t too" in check_memory_estimator(
        cases["sequence parallelism ignored outside"][0], measured=measured)["message"]
