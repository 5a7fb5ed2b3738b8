"""Checkpoints in torch.distributed.checkpoint's format (``--ckpt-format dcp``).

One 4-rank run (dp2 x tp2, float64) saves in DCP; a 2-rank pipeline (pp2) resumes from its
step-10 save: the next losses and the final parameters equal the uninterrupted run's to
1e-9. A plain single-device ``nn.Module`` loads the 4-rank save with ``dcp.load`` alone.
``check-ckpt`` passes the sound save and names each planted damage (a changed byte, a lost
file, chunks that overlap or leave a gap)."""
import hashlib
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from minitron import checkpoint as ckpt
from minitron.config import preset
from minitron.model import GPT
from minitron.tools.testing import run_cli

TRAIN = ["train", "--model", "tiny", "--global-batch", "4", "--no-progress", "--sample", "0", "--eval-every", "0",
         "--dtype", "float64", "--no-report"]


def _losses(metrics):
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """dp2 x tp2 for 12 steps in DCP, checkpoints at steps 10 and 12."""
    root = tmp_path_factory.mktemp("dcp")
    a = root / "a"
    code, out, err = run_cli(TRAIN + ["--nproc", "4", "--dp", "2", "--tp", "2", "--steps", "12", "--ckpt-every", "10",
                                      "--ckpt-format", "dcp", "--ckpt-dir", str(a), "--metrics", str(root / "a.jsonl")])
    assert code == 0, err
    return root


@pytest.mark.multirank
def test_dcp_resume_into_another_layout(saved):
    a, b = saved / "a", saved / "b"
    assert sorted(p.name for p in (a / "step_0000012").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                        "__2_0.distcp", "__3_0.distcp", "meta.json"]
    shutil.copytree(a, b)
    shutil.rmtree(b / "step_0000012")
    (b / "latest").write_text("step_0000010")
    code, out, err = run_cli(TRAIN + ["--nproc", "2", "--pp", "2", "--microbatches", "2", "--steps", "12",
                                      "--ckpt-dir", str(b), "--resume", "--metrics", str(saved / "b.jsonl")])
    assert code == 0, err
    la, lb = _losses(saved / "a.jsonl"), _losses(saved / "b.jsonl")
    for step in (11, 12):
        assert abs(la[step] - lb[step]) <= 1e-9 * abs(la[step]), (step, la[step], lb[step])
    fa, fb = ckpt.load_full(a / "step_0000012"), ckpt.load_full(b / "step_0000012")  # DCP vs minitron's format
    assert fa.keys() == fb.keys()
    for name in fa:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert _rel(fb[name][k], fa[name][k]) <= 1e-9, (name, k)


@pytest.mark.multirank
def test_plain_module_loads_with_dcp_alone(saved):
    step = saved / "a" / "step_0000012"
    model = GPT(preset("tiny")).double()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    model.load_state_dict(state)
    full, names = ckpt.load_full(step), json.loads((step / "meta.json").read_text())["dcp_keys"]
    assert set(state) == set(names)
    for fqn, t in model.state_dict().items():
        assert torch.equal(t, full[names[fqn]]["param"]), fqn


@pytest.mark.multirank
def test_check_ckpt_names_damage_to_dcp_files(saved, tmp_path):
    code, out, err = run_cli(["check-ckpt", str(saved / "a")])
    assert code == 0 and "2 of 2 checkpoint(s) sound" in out, (out, err)
    cases = {"byte": "does not match its checksum", "lost": "does not hold the DCP files",
             "overlap": "overlap", "gap": "missing chunks"}
    for case, words in cases.items():
        step = tmp_path / case / "step_0000012"
        shutil.copytree(saved / "a" / "step_0000012", step)
        _damage(step, case)
        code, out, err = run_cli(["check-ckpt", str(step)])
        assert code == 1 and words in out, (case, out, err)


def _damage(step, case):
    if case == "byte":
        f = step / "__1_0.distcp"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    elif case == "lost":
        (step / "__3_0.distcp").unlink()
    else:  # rewrite DCP's metadata (and its checksum, as a careful forger would)
        md = dcp.FileSystemReader(str(step)).read_metadata()
        key = next(k for k, m in md.state_dict_metadata.items() if len(getattr(m, "chunks", [])) == 2)
        chunks = md.state_dict_metadata[key].chunks
        if case == "overlap":
            chunks[1] = chunks[0]
        else:
            del chunks[1]
        import pickle
        (step / ".metadata").write_bytes(pickle.dumps(md))
        meta = json.loads((step / "meta.json").read_text())
        meta["files"][".metadata"] = {"sha256": hashlib.sha256((step / ".metadata").read_bytes()).hexdigest(),
                                      "bytes": (step / ".metadata").stat().st_size}
        (step / "meta.json").write_text(json.dumps(meta))
