"""A learner's first day: what `make run` says and leaves behind, the loss as it is printed and
drawn, and a command line that answers `--help` without importing torch.

How long `--help` takes is measured by benchmarks/bench_help.py (results in
benchmarks/RESULTS.md), never asserted here; what makes it fast is: no torch in the process.
"""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minitron.data import ByteCorpus
from minitron.tools.cli import build_parser
from minitron.tools.report import _core_cap
from minitron.viz.loss import NANOGPT_CPU_RECIPE, loss_figure, loss_reference, loss_unit

ROOT = Path(__file__).resolve().parents[1]


def subcommands() -> list[str]:
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_help_of_every_command_imports_no_torch():
    code = ("import sys\nfrom minitron.tools.cli import main\n"
            f"for argv in [[]] + [[c] for c in {subcommands()!r}]:\n"
            "    try:\n        main(argv + ['--help'])\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy')))\n"
            "assert not bad, bad[:5]\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_package_still_gives_its_names():
    import minitron

    assert minitron.ParallelConfig().world == 1 and callable(minitron.Trainer)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        minitron.Nope  # noqa: B018


def test_readme_command_table_lists_every_command():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## The command line"):readme.index("Layout flags:")]
    listed = set(re.findall(r"^\| `minitron ([a-z-]+)", table, re.M))
    assert listed == set(subcommands())


def test_make_run_says_what_it_installs_and_saves_a_checkpoint_it_names():
    make = (ROOT / "Makefile").read_text()
    install = make[make.index("$(STAMP): pyproject.toml"):make.index("touch $@")]
    assert install.index("@echo \"make: installing") < install.index("pip install")
    assert "minutes" in install.split("pip install")[0]
    run = make[make.index("\nrun:"):make.index("\nrun-single:")]
    assert "--ckpt-dir $(CKPT) --overwrite" in run
    assert "minitron sample --ckpt-dir $(CKPT)" in run.split("--ckpt-dir $(CKPT) --overwrite")[1]


def test_loss_line_names_its_unit_and_reference_points(tmp_path):
    byte_line = loss_reference(ByteCorpus(b"abc"), builtin=True)
    assert "nats per byte" in byte_line and f"ln 256 = {math.log(256):.2f}" in byte_line
    assert f"{NANOGPT_CPU_RECIPE:.2f}" in byte_line and "benchmarks/RESULTS.md" in byte_line
    tokens = type("Tokens", (), {"unit": "token", "vocab": 4096})()
    token_line = loss_reference(tokens, builtin=False)
    assert "nats per token" in token_line and "ln 4,096 = 8.32" in token_line and "nanoGPT" not in token_line


def test_nanogpt_figure_is_the_one_measured_in_results():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    row = next(ln for ln in results.splitlines() if ln.startswith("| plain PyTorch, nanoGPT's model"))
    assert float(re.search(r"\*\*([\d.]+)\*\*", row).group(1)) == NANOGPT_CPU_RECIPE


def test_mfu_line_says_when_ranks_outnumber_cores():
    assert "8 ranks share 2 cores" in _core_cap(8, 2) and "2/8 = 0.25" in _core_cap(8, 2)
    assert _core_cap(2, 2) == ""


@pytest.mark.parametrize("corpus, unit", [(ByteCorpus(b"x"), "nats per byte"),
                                          (type("T", (), {"unit": "token"})(), "nats per token")])
def test_loss_figure_draws_only_measured_points_in_the_corpus_unit(corpus, unit):
    pytest.importorskip("matplotlib")
    fig = loss_figure([5.6, 4.0, 3.0, 2.6], {0: 5.55, 4: 2.7}, first_step=1, unit=loss_unit(corpus))
    ax = fig.axes[0]
    train, val = ax.get_lines()
    assert list(train.get_xdata()) == [1, 2, 3, 4]
    assert list(val.get_xdata()) == [0, 4] and val.get_linestyle() == "None"  # no line between evaluations
    assert ax.get_ylabel() == f"loss ({unit})"
