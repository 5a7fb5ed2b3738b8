"""Every lesson ends the same way: **Check yourself** (every graded question of the lesson, and
nothing else graded earlier), **Try it** (the exercises) and **Solutions** (hidden cells), in that
order; and lesson 9's section 7 (sliding windows, rope scaling) shows what the engine computes.

Reads the notebooks and calls pure engine functions only (no kernel, no ranks): fast.
"""
import json
import re
from pathlib import Path

import pytest

from minitron.course import quiz

ROOT = Path(__file__).resolve().parent.parent
LESSONS = {p.name[:2]: p for p in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))}
ENDING = ("## Check yourself", "## Try it", "## Solutions")
# Lessons without the common ending, tolerated until they get it (none now); strict both ways (a
# lesson that gains it must be struck off).
WITHOUT_THE_ENDING: set = set()


def _cells(lesson: str) -> list[dict]:
    return json.loads(LESSONS[lesson].read_text())["cells"]


def ending_problems(cells: list[dict]) -> list[str]:
    """What keeps `cells` from the common ending: a heading missing or out of order, a graded
    question outside Check yourself, a Try it prompt outside its section."""
    at = {}
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown":
            for line in "".join(c["source"]).splitlines():
                if line.strip() in ENDING:
                    at.setdefault(line.strip(), i)
    missing = [h for h in ENDING if h not in at]
    if missing:
        return [f"no {h!r} section" for h in missing]
    order = [at[h] for h in ENDING]
    if order != sorted(order):
        return [f"the sections are out of order: {sorted(ENDING, key=at.get)}"]
    problems = []
    for i, c in enumerate(cells):
        src = "".join(c["source"])
        if c["cell_type"] == "code" and re.search(r'check\("', src) and not at[ENDING[0]] < i < at[ENDING[1]]:
            problems.append(f"cell {i} grades a question outside Check yourself: {src[:50]!r}")
        if c["cell_type"] == "markdown" and "**Try it" in src and not at[ENDING[1]] <= i < at[ENDING[2]]:
            problems.append(f"cell {i} prompts a Try it outside its section")
    return problems


@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_every_lesson_ends_with_check_yourself_try_it_and_solutions(lesson):
    problems = ending_problems(_cells(lesson))
    if lesson in WITHOUT_THE_ENDING:
        assert problems, f"lesson {lesson} has the common ending now: strike it off WITHOUT_THE_ENDING"
    else:
        assert not problems, f"lesson {lesson}: {problems}"


def test_a_question_left_in_a_section_is_caught():
    cells = _cells("09")
    assert not ending_problems(cells)
    (qi,) = [i for i, c in enumerate(cells) if 'check("09.chunks"' in "".join(c["source"])]
    planted = cells[:5] + [cells[qi]] + cells[5:qi] + cells[qi + 1:]  # the old place: section 2
    assert any("outside Check yourself" in p for p in ending_problems(planted))
    no_try_it = [c for c in cells if "## Try it" not in "".join(c["source"])]
    assert ending_problems(no_try_it) == ["no '## Try it' section"]
    prompt = {"cell_type": "markdown", "source": "**Try it.** a prompt in a section", "metadata": {}}
    assert any("Try it outside" in p for p in ending_problems(cells[:5] + [prompt] + cells[5:]))


def _outputs(lesson: str) -> str:
    return "\n".join("".join(o.get("text") or o.get("data", {}).get("text/plain") or "")
                     for c in _cells(lesson) for o in c.get("outputs", []))


def test_section_7_prints_what_the_engine_computes():
    """The stored FLOPs table, the chunks' reach and the rope counts are the engine's; the traced
    windowed ring equals the analysis on both ranks and sends half the global ring's bytes, as
    the prose says."""
    import math

    import torch

    from minitron.config import preset
    from minitron.course import context_parallel as CCP
    from minitron.model_flops import attention_core_flops
    from minitron.parallel.context_parallel import ChunkMask
    from minitron.rope import default_inv_freq, rope_frequencies

    out = _outputs("09")
    mistral = CCP.MISTRAL_7B
    q = mistral.heads * mistral.head_dim
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+ MFLOP\s+[\d.]+ MFLOP\s+([\d.]+)\s", out, re.M)
    assert [int(s) for s, _ in rows] == [4096, 8192, 16384, 32768]
    for s, share in rows:
        m = mistral.replace(seq_len=int(s))
        assert float(share) == round(attention_core_flops(m, 0, q) / attention_core_flops(m.replace(window=0), 0, q), 3)
    hops = re.search(r"chunk hops around the ring (\d+) \(without the window (\d+)\)", out).groups()
    assert [int(h) for h in hops] == [sum(ChunkMask(2, 8, 8).reach.values()), sum(ChunkMask(2, 8).reach.values())]
    equal = re.findall(r"^  rank \d: traced .*, equal: (\w+)$", out, re.M)
    assert equal == ["True"] * 4 and out.count("loss equal to one device within 1e-9: True") == 2
    assert "the window sends 50% of the global ring's bytes" in out
    assert "half the bytes" in "".join("".join(c["source"]) for c in _cells("09") if c["cell_type"] == "markdown")
    llama = preset("llama3-8b")
    plain = default_inv_freq(llama.head_dim, llama.rope_base)
    for kind in ("llama3", "yarn"):
        theta, factor = rope_frequencies(llama.replace(rope_scaling=kind))
        kept, divided = int((theta == plain).sum()), int(torch.isclose(theta, plain / 8).sum())
        assert f"{kind:>6}: of 64 pairs {kept} kept, {divided} divided by 8, {64 - kept - divided} between; " \
               f"cos and sin times {factor:.4f}" in out
    assert math.isclose(rope_frequencies(llama.replace(rope_scaling="yarn"))[1], 0.1 * math.log(8) + 1)


def test_the_window_questions_agree_with_the_analysis():
    """The runtime's reach (ChunkMask) graded in 09.window_hops is the analysis' (window_chunk_reach);
    the global ring's count is refused."""
    from minitron.analysis.context_parallel import window_chunk_reach

    assert quiz.QUESTIONS["09.window_hops"].answer() == sum(window_chunk_reach(4, 4, 8).values())
    assert not quiz.grade("09.window_hops", sum(window_chunk_reach(4, 4, 2 * 4 * 4).values()))[0]


def test_section_8_prints_what_the_engine_computes():
    """USP's section: the grid's rows and columns are the engine's, both traced steps equal one
    device and every rank's bytes the analysis, the packed ring sends fewer bytes than the plain
    one on every rank (and not the same on all, as the prose says), and the stored cluster-model table is ``predict``'s (its best and largest U)."""
    from minitron.analysis.cluster import PlannedLayout, predict
    from minitron.config import preset
    from minitron.course import context_parallel as CCP
    from minitron.grid import ProcessGrid

    out = _outputs("09")
    grid = ProcessGrid(cp=8, cp_a2a=2)
    rows = re.findall(r"^\s+(\d)\s+(\[[\d, ]+\])\s+(\[[\d, ]+\])\s+\[", out, re.M)
    assert [(int(r), json.loads(a), json.loads(c)) for r, a, c in rows] == \
        [(r, grid.axis_ranks("cp_a2a", r), grid.axis_ranks("cp_ring", r)) for r in range(8)]
    assert out.count("the single device's loss within 1e-9: True") == 2
    assert re.findall(r"^  rank \d: traced .*, analysis equal: (\w+)$", out, re.M) == ["True"] * 8
    sends = [int(x) for x in re.findall(r"^  rank \d: traced .*'cp_ring': \{'send': (\d+)", out, re.M)]
    assert len(sends) == 8 and all(packed < plain for plain, packed in zip(sends[:4], sends[4:]))
    assert len(set(sends[:4])) == 1 < len(set(sends[4:]))  # packed, the documents make the ranks differ
    llama = preset("llama3-8b")
    table = re.findall(r"^\s*([\d,]+)\s+(\d)\s+([\d.]+) s \(\s*\d+\)\s+([\d.]+) s \(\s*\d+\)\s+([\d.]+) s \(\s*\d+\)"
                       r"\s+(\d+)\s+(\d+)$", out, re.M)
    assert len(table) == 8
    for s, t, *steps, best, largest in table:
        s, t = int(s.replace(",", "")), int(t)
        want = [predict(llama.replace(seq_len=s), PlannedLayout(tp=t, cp=16, dp=1, cp_mode="usp" if u > 1 else "ring",
                                                                cp_a2a=u), 16, "h100-dgx", software="minitron").iteration_s
                for u in (1, 2, 4)]
        assert [float(x) for x in steps] == [round(w, 2) for w in want]
        assert int(best) == (1, 2, 4)[want.index(min(want))] and int(largest) == CCP.largest_a2a(llama, t, 16, 8)
