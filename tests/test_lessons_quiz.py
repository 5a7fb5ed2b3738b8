"""The lessons' graded questions (`minitron.course.quiz`) and what every lesson must contain.

Each check is fed its right answer (computed by the quiz from the engine), a wrong one and
no answer; every lesson states objectives and a time estimate, grades at least three
questions that exist, and keeps its solutions hidden. Fast: no ranks are started.
"""
import json
import math
import re
from pathlib import Path

import pytest

from minitron.course import quiz

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))


def _wrong(right):
    if isinstance(right, tuple):
        return "certainly not this"
    if isinstance(right, (list, frozenset)):
        return [x + 1 for x in sorted(right)]
    return float(right) * 1.5 + 1


@pytest.mark.parametrize("qid", quiz.questions())
def test_each_check_grades_right_and_wrong(qid, capsys):
    right = quiz.QUESTIONS[qid].answer()
    given = right[0] if isinstance(right, tuple) else right
    quiz.check(qid, given)
    assert capsys.readouterr().out.strip() == "right"
    quiz.check(qid, _wrong(right))
    out = capsys.readouterr().out.strip()
    assert out.startswith("wrong — ") and len(out) > len("wrong — ") + 10, out
    quiz.check(qid, ...)
    assert "no answer yet" in capsys.readouterr().out
    assert quiz.grade(qid, given)[0] and not quiz.grade(qid, _wrong(right))[0]


def test_answers_are_forgiving_about_form():
    assert quiz.grade("04.f_backward", "Reduce_Scatter")[0]
    assert quiz.grade("00.dp_group", (1, 3, 5, 7))[0]
    assert quiz.grade("00.dp_group", [7, 3, 5, 1])[0]    # a group is a set: any order
    assert not quiz.grade("00.dp_group", [1, 3, 5, 7, 7])[0] and not quiz.grade("00.dp_group", "1357")[0]
    assert quiz.grade("09.chunks", [6, 1])[0] and not quiz.grade("09.chunks", [1, 5])[0]
    assert quiz.grade("02.bubble_1f1b", "0.4375")[0]
    assert not quiz.grade("02.bubble_1f1b", "three eighths")[0]
    assert not quiz.grade("12.colwise_dim", True)[0] and quiz.grade("12.colwise_dim", 1)[0]
    with pytest.raises(KeyError, match="no question"):
        quiz.grade("99.nothing", 1)


# For every question, answers a learner would plausibly give that are wrong, with the mistake:
# each must be refused (the right answers in other forms are accepted below).
PLAUSIBLY_WRONG = {
    "00.all_reduce": [(8, "the number of ranks"), (28, "1 + ... + 7"), (37, "off by one")],
    "00.dp_group": [((4, 5), "the tensor group"), ((4, 5, 6, 7), "contiguous ranks"), ((1, 3), "dp = 2's group")],
    "00.latency_bound": [("beta", "the bandwidth term"), ("bandwidth", "the bandwidth term")],
    "00.ring_bytes": [(16e6, "2N, no (p - 1)/p"), (6e6, "one phase"), ("12 MiB", "MiB for MB")],
    "00.ring_steps": [(7, "one phase"), (16, "2p"), (15, "off by one")],
    "01.bytes_per_param": [(90, "Adam's state only"), (135, "fp32 gradients"), (16, "bytes per parameter, not in all")],
    "01.full_recompute": [(128, "4 bytes per value"), (32, "1 byte per value"), (48, "GPT-3's layer")],
    "01.gpus_175b": [(39, "rounded down"), (41, "off by one")],
    "01.zero3_d128": [(16, "nothing sharded"), (2 + 14 / 128, "stage 2")],
    "02.bubble_1f1b": [(7 / 23, "share of the total time"), (0.5, "p/m")],
    "02.bubble_interleaved": [(0.4375, "no division by v"), (7 / 39, "share of the total time")],
    "02.stash_gpipe": [(8, "1F1B's stash, p"), (15, "off by one")],
    "02.warmup": [(22, "the warm-up alone"), (24, "off by one")],
    "02.zbv_idle": [(14, "2(p - 1)"), (8, "off by one")],
    "03.ring_wire": [(8, "2N"), (3.5, "one phase")],
    "03.zero1_bytes": [(16, "nothing sharded"), (2.75, "gradients forgotten"), (5.5, "d = 8's")],
    "03.zero1_over_allreduce": [(0.5, "one collective"), (1.5, "three halves")],
    "04.f_backward": [("all-reduce", "f's without sequence parallelism"), ("all-gather", "the entry's forward"),
                      ("identity", "g's backward")],
    "04.allreduces_per_layer": [(4, "no replay"), (8, "the backward's f's replayed too"), (5, "off by one")],
    "04.ce_allreduces": [(2, "the target forgotten"), (1, "one collective")],
    "04.max_t": [(8, "a DGX A100's eight"), (32, "two servers"), (2, "pairs of NVLink-bridged GPUs")],
    "04.overlap_sends": [(8, "t, not t - 1"), (1, "one call, as the all-gather")],
    "04.overlap_bytes_ratio": [(3, "t - 1 messages"), (0.75, "(t - 1)/t")],
    "04.ring_shard": [(7, "(r + k) mod t, the other direction"), (5, "its own shard")],
    "05.devices": [(16, "q squared"), (12, "3q")],
    "05.vector_copies": [(4, "q"), (64, "q cubed")],
    "05.min_batch": [(3, "q"), (27, "q cubed")],
    "05.linear_collectives": [(3, "forward only"), (5, "off by one")],
    "05.naive_output_ranks": [(8, "every rank"), (2, "q")],
    "05.fewest_bytes_64": [("2d", "SUMMA"), ("1d", "Megatron's")],
    "05.overlap_bound": [(0.947, "the communication share"), (0.036, "the 3-D layer's"), ("53%", "a factor 10")],
    "06.rank_of": [(12, "off by one"), (14, "1-based"), (7, "t = 2's")],
    "06.gpus_1t": [(512, "t · p"), (3072, "the paper's d = 6"), (6143, "off by one")],
    "06.bubble_dp": [(63 / 1024, "p = n"), (3 / 67, "share of the total time"), (7 / 64, "b' = 512 at d = 8")],
    "06.checkpoints": [(18, "c* rounded down"), (20, "off by one"), (27, "96 layers'")],
    "06.zero3_state_gb": [(12 * 175e9 / 1536 / 1e9, "Adam's state only"), (2 * 175e9 / 1536 / 1e9, "weights only")],
    "06.microbatch_b2048": [(1, "the smallest"), (2, "B = 512's"), (8, "the largest")],
    "07.hfu_over_mfu": [(96 / 72, "full recomputation"), (75.43 / 72, "the printed s = h"), (1.0, "no replay"),
                        (0.88, "inverted")],
    "07.mfu": [(153 / 312, "the HFU"), ("49%", "the HFU"), (0.392, "the 1T run's")],
    "07.flops_per_token": [(7.9, "6N without attention"), (9.08, "the preset's s = 2048"), (4.2, "forward only")],
    "07.fusion_passes": [(2, "the two-kernel case"), (6, "the eager passes"), (1, "one pass")],
    "07.fp8_tp_scale": [(896, "the shard's own amax"), (28672, "E5M2's max"), (1 / 224, "inverted")],
    "07.mx_scales": [(4096, "one per row"), (128, "one row's blocks"), (1, "one per tensor")],
    "07.fp8_amdahl": [(2, "the GEMMs' speed-up"), (0.8, "the step's time, not its speed-up"), (1.2, "1 + f/k")],
    "07.fp8_gather_bytes": [(3_145_728, "one gather: the backward gathers again"), (25_165_824, "float32's 4 bytes"),
                            (12_582_912, "bf16's 2 bytes, or the whole weight")],
    "08.weak_efficiency": [(1.25, "inverted"), (0.2, "the loss")],
    "08.strong_efficiency": [(2.5, "no factor n"), (1.6, "inverted")],
    "08.oversubscription": [(2, "the cores"), (0.25, "inverted")],
    "08.bubble_pp2": [(1 / 3, "share of the total time"), (1, "p/m")],
    "08.compute_ms": [(14.16, "no oversubscription"), (113.2, "the whole step on one rank"), (7.08, "batch 8, one rank's")],
    "08.ft_mtbf_h": [(3.09 / 4, "the rate scaled the wrong way"), (3.09, "the run's own MTBF"),
                     (54 * 24 / 466 * 4, "every interruption, planned ones included")],
    "08.young_daly_min": [(math.sqrt(30 * 7200) / 60, "no factor 2"), (math.sqrt(2 * 30 * 120) / 60, "M in minutes"),
                          (math.sqrt(2 * 30 * 7200), "seconds, not minutes"), (math.sqrt(2 * 30 * 7200) / 60 - 0.5, "Daly's")],
    "08.quorum_rows": [(64, "the whole global batch"), (16, "one replica's rows"), (3, "the replicas")],
    "09.chunks": [((2, 3), "the contiguous layout"), ((1, 5), "2N - 2 - r")],
    "09.lse": [(2, "the max"), (4, "the sum of logs")],
    "09.message_mib": [(16, "K only"), (256, "the whole sequence")],
    "09.ring_messages": [(6, "the gradients' ring forgotten"), (12, "N per pass")],
    "09.separator_document": [("next", "the separator starts the next document"), ("the next one", "the same, in words")],
    "09.packed_positions": [([0, 1, 0, 1, 0, 0, 1, 2], "the separator starts the next document"),
                            ([0, 1, 2, 3, 4, 5, 6, 7], "positions not restarted"), ([0, 1, 2, 0, 1, 0, 1, 2], "the lone separator skipped")],
    "09.skipped_pairs": [(0, "the causal pairs only"), (6, "the future pairs too"), (4, "off by one")],
    "09.window_core_share": [(4096 / 65536, "W keys per query, not the blocks"), (0.234, "section 7's s = 32,768"),
                             (2 * 4096 / 65536, "2W keys, the whole block before included twice")],
    "09.window_hops": [(21, "no window: the causal ring"), (13, "section 6's documents"), (8, "one hop per chunk")],
    "09.rope_kept": [(29, "Llama 3 8B's head, section 7"), (18, "the pairs divided by the factor"), (64, "every pair")],
    "09.usp_message_mib": [(4, "the one kv head, not copied to both ranks of the row"),
                           (32, "every kv head, not one tensor rank's"), (16, "s/R tokens on all max(kv_t, U) heads")],
    "09.usp_largest_u": [(7, "7 splits the queries, not the 4 kv heads"), (8, "the node's 8 GPUs"), (1, "the plain ring")],
    "09.usp_ring_sends": [(21, "3(N − 1): a ring over all 8"), (3, "R − 1: the forward only"),
                          (6, "2(R − 1): no accumulators")],
    "10.kv_rows": [(256, "k only, or one head"), (1024, "every kv head"), (128, "one head's k")],
    "10.kv_copies": [(8, "the kv heads"), (1, "no replication"), (32, "every tensor rank")],
    "10.swiglu_params": [(2 * 8192 * 28672, "GPT's two matrices"), (3 * 8192 * 28672 + 2 * 28672 + 8192, "biases included"),
                         (3 * 4096 * 14336, "Llama 3 8B's, the lesson's printed layer")],
    "10.cp_position": [(48, "the contiguous layout (chunks 2r, 2r + 1), or s = 64's answer"), (112, "chunk 2N - r")],
    "10.kv_saved_per_element": [(2, "k and v only"), (4, "k, v and their projection")],
    "11.mixtral_active": [(46.7, "the total"), (12.9, "top-2, the published figure"), ("7.24M", "millions")],
    "11.capacity": [(1024, "no capacity factor"), (640, "k = 1"), (1281, "off by one")],
    "11.collapsed_aux": [(1, "alpha"), (64 ** 2, "E squared"), (8, "section 2's E = 8")],
    "11.a2a_mib": [(128, "forward only"), (64, "one pass")],
    "11.host_wait_pct": [(0.394, "a fraction where per cent is asked"), (13.8, "section 7's ep 16 run"),
                         (60.6, "the GPU's busy share")],
    "11.mla_cache_kib": [(270, "every head's keys and values cached"), (1.125, "one layer"), (68.6, "DeepSeek-V3's"),
                         (15.2, "one byte per element")],
    "11.mtp_flops_pct": [(3.8, "DeepSeek-V3's, section 8"), (0.106, "a fraction where per cent is asked"),
                         (21.2, "two depths")],
    "11.ib_bytes_max": [(43008, "M - 1 nodes: the token's own node counted"), (114688, "one copy per expert, k = 8"),
                        (14336, "one node"), (28672, "four bytes per value, one node")],
    "11.ep_overlap_calls": [(30, "no overlap: 5 per block"), (27, "one microbatch"), (55, "the gradient norm counted"),
                            (60, "the counts split too")],
    "11.ep_overlap_bytes": [(354240, "bytes scaled with the calls, 9/5"), (196992, "the counts sent twice"),
                            (98400, "forward only"), (393600, "float64")],
    "12.fsdp2_gathers": [(384, "the root forgotten"), (385, "minitron's count"), (200, "one gather per block")],
    "12.zero3_gathers": [(392, "FSDP2's count"), (384, "the root forgotten")],
    "12.tp_all_reduces": [(48, "forward only"), (192, "twice per linear")],
    "12.colwise_dim": [(0, "an nn.Linear's"), (True, "a boolean")],
}

# right answers written as a learner writes them
RIGHT_IN_OTHER_FORMS = [
    ("11.capacity", "1,280"), ("10.swiglu_params", "704,643,072"), ("02.bubble_1f1b", "43.75%"),
    ("02.bubble_1f1b", 0.44), ("00.ring_bytes", "12 MB"), ("00.ring_bytes", "12,000,000 bytes"),
    ("11.mixtral_active", "7.24B"), ("11.mixtral_active", "7.24 billion"), ("11.host_wait_pct", "39.4 %"),
    ("11.a2a_mib", "0.25 GiB"), ("11.ib_bytes_max", "56 KiB"), ("11.mla_cache_kib", "31,104 bytes"), ("07.flops_per_token", "12.7 GFLOP"), ("07.mfu", "37 %"), ("06.gpus_1t", "6,144"),
    ("02.stash_gpipe", 16.0), ("02.stash_gpipe", "16"), ("08.weak_efficiency", "80%"), ("08.young_daly_min", "657 s"),
    ("08.ft_mtbf_h", "12.37 h"),
]


def test_every_question_has_plausible_wrong_answers():
    assert set(PLAUSIBLY_WRONG) == set(quiz.questions())


@pytest.mark.parametrize("qid", quiz.questions())
def test_plausible_wrong_answers_are_refused(qid):
    for wrong, mistake in PLAUSIBLY_WRONG[qid]:
        ok, msg = quiz.grade(qid, wrong)
        assert not ok and msg.startswith("wrong — "), f"{qid}: {wrong!r} ({mistake}) was graded right"


@pytest.mark.parametrize("qid, answer", RIGHT_IN_OTHER_FORMS)
def test_right_answers_in_other_forms_are_accepted(qid, answer):
    assert quiz.grade(qid, answer)[0], f"{qid}: {answer!r}"


@pytest.mark.parametrize("qid", quiz.questions())
def test_grading_follows_the_kind_of_answer(qid):
    q, right = quiz.QUESTIONS[qid], quiz.QUESTIONS[qid].answer()
    if isinstance(right, bool) or not isinstance(right, (int, float)):
        return
    if isinstance(right, int):  # a count: exact, off by one is wrong
        assert q.rel_tol == 0 and not quiz.grade(qid, right + 1)[0] and not quiz.grade(qid, right - 1)[0]
    else:  # a figure: its question states a tolerance, and an answer past it is wrong
        assert q.rel_tol > 0, f"{qid}: a non-integer answer needs a stated rel_tol"
        assert not quiz.grade(qid, right * (1 + 2 * q.rel_tol))[0]
    assert not quiz.grade(qid, True)[0] and not quiz.grade(qid, False)[0]  # booleans are not numbers


def test_numbers_in_other_units_of_another_kind_are_refused():
    assert quiz.parse_number("12 ms", "B") is None and quiz.parse_number("12%", "GB") is None
    assert quiz.parse_number("1,5") is None  # a decimal comma is ambiguous: not read as 15 or 1.5
    assert quiz.parse_number("2 GiB", "MiB") == 2048 and quiz.parse_number("1.5e3") == 1500


def _cells(nb):
    return json.loads(nb.read_text())["cells"]


@pytest.mark.parametrize("nb", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_has_objectives_questions_and_hidden_solutions(nb):
    cells = _cells(nb)
    head = "".join(cells[0]["source"])
    assert "objectives" in head.lower() and re.search(r"\d+\s*min", head), \
        f"{nb.name}: the first cell states objectives and a time estimate"
    lesson = nb.name[:2]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    asked = [q for src in code for q in re.findall(r'check\("([0-9]{2}\.[a-z0-9_]+)"', src)]
    assert len(set(asked)) >= 3, f"{nb.name}: at least three graded questions"
    assert set(asked) <= set(quiz.questions(lesson)), f"{nb.name}: unknown question ids"
    for c in cells:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and re.search(r'check\("', src):
            assert re.search(r'check\("[^"]+",\s*\.\.\.\)', src), \
                f"{nb.name}: a check cell is stored unanswered ({src!r})"
    solutions = [c for c in cells if c["cell_type"] == "code"
                 and c["metadata"].get("jupyter", {}).get("source_hidden")]
    assert solutions, f"{nb.name}: the solutions of its 'Try it' prompts are hidden cells"
    for c in solutions:  # a collapsed cell whose output shows is no hidden solution
        assert c["metadata"]["jupyter"].get("outputs_hidden"), \
            f"{nb.name}: a solution cell's output is in view: {''.join(c['source'])[:60]!r}"
    for c in cells:
        for o in c.get("outputs", []):
            assert o["output_type"] != "error" and o.get("name") != "stderr", \
                f"{nb.name}: tool noise or an error stored in an output: {''.join(o.get('text', ''))[:80]!r}"
    text = "".join("".join(c["source"]) for c in cells)
    assert not re.search(r"\b[Ii]ssue\s*#?\d", text), f"{nb.name}: no issue numbers"
    for src in code:
        assert not re.search(r"(?<![\w.])(?:[A-Za-z]\w*\.)+_[a-z]\w*", src), \
            f"{nb.name}: a code cell uses a private engine name: {src[:80]!r}"


def test_lesson_12_runs_the_native_calls_it_teaches_in_its_own_cells():
    (nb,) = [p for p in LESSONS if p.name.startswith("12_")]
    for call in ("fully_shard(", "parallelize_module(", "Schedule1F1B("):
        cells = [c for c in _cells(nb) if c["cell_type"] == "code" and call in "".join(c["source"])]
        assert cells and all(c["outputs"] for c in cells), f"lesson 12: no cell runs {call}...) and stores its output"


@pytest.mark.parametrize("lesson", ["10", "11", "12"])
def test_newer_lessons_draw_at_least_two_figures(lesson):
    (nb,) = [p for p in LESSONS if p.name.startswith(f"{lesson}_")]
    figures = [o for c in _cells(nb) for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) >= 2, f"lesson {lesson}: {len(figures)} figures stored"
