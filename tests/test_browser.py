"""The schedule explorer in a real JupyterLab, driven through headless Chromium.

A JupyterLab server (this environment's `jupyter lab`, kernel = this Python) serves a
temporary folder holding a one-cell notebook that calls `schedule_explorer()`. Playwright
drives Debian's Chromium (/usr/bin/chromium, through `executable_path`: Playwright
downloads no browser of its own): it opens the notebook, runs the cell with Shift+Enter,
waits for the widget and its timeline image, then changes the schedule in the dropdown
and the microbatches with the slider's keyboard handle, and checks that the text line
follows what the engine computes (an invalid shape shows the engine's error, and the
image goes) and that a new image is drawn.

Chromium comes from `scripts/install_browser.sh`, which `make test` runs (CI is root on a
fresh machine). When the browser is missing and we are root, this module runs the same
script; it skips only when the browser is missing and cannot be installed (not root, or
no apt-get). Every wait has a timeout, and the server and its kernel are always stopped.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
KERNEL = "minitron-test"          # a kernelspec written below: this interpreter, nothing else

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

pytest.importorskip("jupyterlab", reason="the course extras are not installed: pip install -e .[course]")
pytest.importorskip("ipywidgets", reason="the course extras are not installed: pip install -e .[course]")
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed: pip install -e .[test]")

from minitron.analysis.bubble import bubble_fraction  # noqa: E402
from minitron.analysis.pipeline_sim import simulate  # noqa: E402
from minitron.parallel.schedule_actions import default_costs  # noqa: E402
from minitron.parallel.schedules import make_schedule  # noqa: E402


def expected_line(kind: str, p: int, m: int, v: int = 1) -> str:
    """The explorer's text line for a shape, computed here from the engine; for a shape
    the engine refuses, its one-line error."""
    try:
        sim = simulate(make_schedule(kind, p, v, m))
    except ValueError as e:
        return f"⚠ {e}"
    c = default_costs(kind)
    closed = bubble_fraction(kind, p, m, v, t_f=c["F"], t_b=c["B"], t_w=c["W"])
    return (f"bubble fraction {sim.bubble_fraction:.3f} (closed form {closed:.3f})"
            f" · peak stash {max(sim.peak_stashed)}")


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium, installed by scripts/install_browser.sh when we may."""
    if not os.access(CHROMIUM, os.X_OK):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip(f"no {CHROMIUM} and it cannot be installed here (needs root and apt-get): "
                        "run `sudo scripts/install_browser.sh` (CI installs it through `make test`)")
        r = subprocess.run(["bash", str(ROOT / "scripts" / "install_browser.sh")],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"install_browser.sh failed:\n{r.stdout}\n{r.stderr}"
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Processes started by `pid`, at any depth (the kernel runs in a session of its own,
    so stopping the server's process group would miss it)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _write_lab_folder(tmp: Path) -> dict:
    """The notebook, a kernelspec for this interpreter, and private Jupyter folders (no
    user settings, workspaces or kernels leak in). Returns the server's environment."""
    nb = {"nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": KERNEL, "display_name": "minitron test",
                                      "language": "python"}},
          "cells": [{"cell_type": "code", "id": "explorer", "metadata": {}, "outputs": [],
                     "execution_count": None,
                     "source": "from minitron.viz.widgets import schedule_explorer\n"
                               "schedule_explorer('1f1b', p=4, m=8, v=2)"}]}
    (tmp / "work").mkdir()
    (tmp / "work" / "explorer.ipynb").write_text(json.dumps(nb))
    spec = tmp / "data" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "minitron test", "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "IPYTHON"))}
    env.update(JUPYTER_PATH=str(tmp / "data"), JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    # No "fetch Jupyter news?" question popping over the notebook.
    note = tmp / "settings" / "@jupyterlab" / "apputils-extension"
    note.mkdir(parents=True)
    (note / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    return env


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free localhost port with a random token; stopped (with its
    kernel) however the test ends."""
    tmp = tmp_path_factory.mktemp("lab")
    env = _write_lab_folder(tmp)
    port, token = _free_port(), secrets.token_hex(16)
    log = open(tmp / "server.log", "w")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
           "--ip=127.0.0.1", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={tmp / 'work'}",
           # nothing reaches out to the internet: no news, update checks or PyPI queries
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    cmd += ["--allow-root"] if os.geteuid() == 0 else []
    proc = subprocess.Popen(cmd, cwd=tmp / "work", env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def server_log() -> str:
        log.flush()
        return (tmp / "server.log").read_text()[-4000:]

    def stop():
        started = _descendants(proc.pid)          # the kernel (and anything it started)
        if proc.poll() is None:
            try:                                   # the polite way: shuts the kernel down too
                req = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                             headers={"Authorization": f"token {token}"})
                urllib.request.urlopen(req, timeout=10).close()
                proc.wait(timeout=20)
            except Exception:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)    # the group we started (start_new_session)
            proc.wait(timeout=10)
        for pid in started + _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()

    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"jupyter lab exited:\n{server_log()}"
            assert time.monotonic() < deadline, f"jupyter lab did not answer in 90 s:\n{server_log()}"
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield {"base": base, "token": token, "log": server_log}
    finally:
        stop()


@pytest.fixture(scope="module")
def page(chromium, lab):
    """A headless Chromium page (Debian's browser, driven by Playwright)."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium, headless=True, timeout=60_000,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.set_default_timeout(30_000)
            yield context.new_page()
        finally:
            browser.close()


# ------------------------------------------------------------------------------ the test

# The timeline image once the browser has decoded it (and it differs from `previous`).
NEW_IMAGE = """previous => {
    const img = document.querySelector('.minitron-plot img');
    return img && img.complete && img.naturalWidth > 0 && img.src !== previous ? img.src : null;
}"""


def new_image(page, previous=None) -> str:
    return page.wait_for_function(NEW_IMAGE, arg=previous).json_value()


def test_schedule_explorer_in_jupyterlab(page, lab, tmp_path):
    expect = sync_api.expect
    try:
        page.goto(f"{lab['base']}/lab/tree/explorer.ipynb?token={lab['token']}",
                  wait_until="domcontentloaded", timeout=60_000)
        # The notebook is open and its kernel is up (the status bar names it, Idle).
        editor = page.locator(".jp-Notebook .jp-Cell .cm-content").first
        editor.wait_for(state="visible", timeout=60_000)
        expect(page.locator(".jp-StatusBar-Widget", has_text="minitron test | Idle")
               ).to_have_count(1, timeout=90_000)

        # Run the cell as a learner would (Ctrl+Enter: run it and stay on it).
        editor.click()
        page.keyboard.press("Control+Enter")

        summary = page.locator(".minitron-summary")
        expect(summary).to_have_text(expected_line("1f1b", 4, 8), timeout=90_000)
        first = new_image(page)
        v_readout = page.locator(".minitron-v .widget-readout")
        expect(v_readout).to_have_attribute("contenteditable", "false")   # v off for 1f1b

        # The schedule, through the <select>.
        page.locator(".minitron-kind select").select_option("interleaved")
        expect(summary).to_have_text(expected_line("interleaved", 4, 8, 2))
        second = new_image(page, first)
        expect(v_readout).to_have_attribute("contenteditable", "true")    # v on for interleaved

        # The microbatches, through the slider's handle and the keyboard: m = 3 is
        # fewer than p = 4, so the engine's error shows and the timeline goes.
        handle = page.locator(".minitron-m .noUi-handle")
        handle.focus()
        for _ in range(5):
            page.keyboard.press("ArrowLeft")
        assert expected_line("interleaved", 4, 3, 2).startswith("⚠ interleaved needs")
        expect(summary).to_have_text(expected_line("interleaved", 4, 3, 2))
        expect(page.locator(".minitron-plot img")).to_have_count(0)

        for _ in range(6):                          # m = 9: valid again, though no multiple of p
            page.keyboard.press("ArrowRight")
        expect(summary).to_have_text(expected_line("interleaved", 4, 9, 2))
        expect(page.locator(".minitron-m .widget-readout")).to_have_text("9")
        assert new_image(page) not in (first, second)
    except Exception:
        print(f"screenshot: {tmp_path / 'jupyterlab.png'}\nserver log:\n{lab['log']()}")
        raise
    finally:                                        # what the browser showed, kept by pytest
        try:
            page.screenshot(path=str(tmp_path / "jupyterlab.png"), timeout=10_000)
        except Exception:
            pass
