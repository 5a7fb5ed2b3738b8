"""The session's hygiene check (tests/conftest.py) fails a session that leaves a
torchelastic_* folder or a /dev/shm entry behind, and passes a clean one."""
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

LEAKY = '''
import subprocess, sys, tempfile
from pathlib import Path

def test_leaks():
    Path(tempfile.gettempdir(), "torchelastic_x").mkdir()  # what an elastic agent that is not shut down leaves
    subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp(prefix='torchelastic_')"], check=True)
    Path("/dev/shm/{shm}").write_bytes(b"x")
'''
CLEAN = '''
def test_clean(tmp_path):
    (tmp_path / "f").write_text("kept in pytest's own folder")
'''


def _session(tmp_path: Path, name: str, body: str):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), d / "conftest.py")
    (d / "pytest.ini").write_text("[pytest]\n")
    (d / f"test_{name}.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(d)], cwd=d,
                          capture_output=True, text=True, timeout=120)


def test_a_leaky_session_fails_naming_what_it_left(tmp_path):
    shm = f"minitron_hygiene_{uuid.uuid4().hex[:8]}"
    try:
        p = _session(tmp_path, "leaky", LEAKY.format(shm=shm))
    finally:
        Path("/dev/shm", shm).unlink(missing_ok=True)
    assert p.returncode == 1, p.stdout[-2000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("the test session left behind")]
    assert len(line) == 1, p.stdout[-2000:]
    assert "1 passed" in p.stdout  # the test itself passed: the check failed the session
    assert line[0].count("torchelastic_") == 2 and f"/dev/shm/{shm}" in line[0]
    for path in line[0].split("left behind ")[1].split(": ")[0].split(", "):
        if "torchelastic_" in path:
            shutil.rmtree(Path(path).parent, ignore_errors=True)  # the leaky session's own folder


def test_a_clean_session_passes_and_removes_its_folder(tmp_path):
    here = Path(tempfile.gettempdir())  # the inner session makes its folder here (TMPDIR)
    before = set(here.glob("minitron_tests_*"))
    p = _session(tmp_path, "clean", CLEAN)
    assert p.returncode == 0, p.stdout[-2000:]
    assert "left behind" not in p.stdout
    assert set(here.glob("minitron_tests_*")) == before
