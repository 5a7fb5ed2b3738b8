"""Lab 07a's checker (``minitron.labs.fp8_scaling``): the reference passes inside a real
tensorwise FP8 run on two layouts, each planted mistake gets its own named line.

A syntax error, the stub and the engine's own quantization are refused before any rank
starts; everything else runs on 4 gloo ranks, all the sources in one launch
(``check_fp8_scaling_all``).
"""
import pytest

from minitron.labs.fp8_scaling import check_fp8_scaling, check_fp8_scaling_all
from planted import assert_each_named, broken_in

REFERENCE = '''
def amax(x, comm, axes):
    a = x.detach().abs().amax()
    for axis in axes:
        comm.all_reduce(a, axis, op="max")
    return a


def quantize(x, amax, fmt):
    top = torch.finfo(fmt).max
    scale = (top / amax.double().clamp_min(1e-12)).float()
    return (x * scale.to(x.dtype)).clamp(-top, top).to(fmt), scale


def fp8_format(role):
    return torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn
'''
REDUCE = '''    for axis in axes:
        comm.all_reduce(a, axis, op="max")'''


broken = broken_in(REFERENCE)


def test_stub_syntax_error_and_engine_copy_need_no_ranks():
    stub = broken('    top = torch.finfo(fmt).max\n    scale = (top / amax.double().clamp_min(1e-12)).float()\n'
                  '    return (x * scale.to(x.dtype)).clamp(-top, top).to(fmt), scale\n',
                  "    raise NotImplementedError  # your code here\n")
    assert check_fp8_scaling(stub)["message"].startswith("quantize is not written yet")
    assert check_fp8_scaling(broken("def fp8_format(role):", "def fp8_format(role)"))["message"].startswith(
        "your code does not compile: expected ':'")
    engine = "from minitron.parallel.fp8 import global_amax as amax\n" + REFERENCE.split("def quantize")[0] \
        .replace("def amax", "def unused") + "def quantize" + REFERENCE.split("def quantize")[1]
    assert check_fp8_scaling(engine)["message"].startswith(
        "your code uses the engine's own minitron.parallel.fp8 (line 1)")


@pytest.mark.multirank
def test_reference_passes_and_each_mistake_is_named():
    engine_route = ("import importlib\nF = importlib.import_module('minitron.parallel' + '.fp8')\n"
                    + broken("    return (x * scale.to(x.dtype)).clamp(-top, top).to(fmt), scale",
                             "    return F.to_fp8(x, scale, fmt), scale"))
    cases = {
        "reference": REFERENCE,
        "no amax reduction": broken(REDUCE, "    pass"),
        "scale inverted": broken("scale = (top / amax.double().clamp_min(1e-12)).float()\n"
                                 "    return (x * scale.to(x.dtype))",
                                 "scale = (amax.double().clamp_min(1e-12) / top).float()\n"
                                 "    return (x / scale.to(x.dtype))"),
        "E4M3 for gradients": broken('torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn',
                                     "torch.float8_e4m3fn"),
        "saturation not handled": broken(".clamp(-top, top).to(fmt)", ".to(fmt)"),
        "whole world": broken(REDUCE, '    comm.all_reduce(a, "world", op="max")'),
        "tp always": broken(REDUCE, '    comm.all_reduce(a, "tp", op="max")'),
        # right on --tp 2 --dp 2 (where the engine asks for 'tp' only): found on --tp 2 --cp 2
        "cp ignored": broken("    for axis in axes:\n", '    for axis in [a for a in axes if a == "tp"]:\n'),
        "summed": broken('comm.all_reduce(a, axis, op="max")', "comm.all_reduce(a, axis)"),
        "float64 scale": broken("scale = (top / amax.double().clamp_min(1e-12)).float()",
                                "scale = top / amax.double().clamp_min(1e-12)"),
        "no floor": broken("amax.double().clamp_min(1e-12)", "amax.double()"),
        "engine by importlib": engine_route,
    }
    res = dict(zip(cases, check_fp8_scaling_all(list(cases.values()), timeout=40)))
    ok = res.pop("reference")
    assert ok["ok"], ok
    assert ok["message"] == ("your tensorwise scaling trains exactly like the single-device FP8 model "
                             "(--tp 2 --dp 2 --sp and --tp 2 --cp 2)")
    assert ok["max_loss_abs_diff"] <= 1e-9 and ok["max_param_rel_diff"] <= 1e-9
    assert_each_named(res, {
        "no amax reduction": "no amax reduction: your amax for a shard of shape",
        "scale inverted": "scale inverted: your scale for an E4M3 tensor",
        "E4M3 for gradients": "E4M3 for gradients: your fp8_format('grad') is E4M3",
        "saturation not handled": "saturation not handled: your quantize gives",
        "whole world": "amax reduced over the whole world",
        "tp always": "amax reduced over the wrong axes: your amax for a tensor of shape",
        "cp ignored": "--tp 2 --cp 2: no amax reduction: your amax for a shard of shape",
        "summed": "is the sum of the ranks' maxima: all-reduce with op='max'",
        "float64 scale": "keep it in float32",
        "no floor": "floor the amax at 1e-12",
        "engine by importlib": "your code runs the engine's own minitron.parallel.fp8.to_fp8",
    })
