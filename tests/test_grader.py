"""Tests for `alignment/drgrpo_grader.py`: the r1_zero reward contract.

Exact tables for format and equivalence, every GSM8K gold completion (and the same with
the answer off by one), random strings that must never raise, hostile input that must
return within a second (also from 8 threads at once), model text that must never run as
Python, and worker processes that never re-run the caller's script.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignment import drgrpo_grader
from alignment.data import SPLITS, Gsm8kDataset
from alignment.drgrpo_grader import CORRECT, FORMATTED_WRONG, UNFORMATTED, grade_responses, r1_zero_reward_fn
from conftest import REPO_ROOT

# the time-limit tests assert wall-clock bounds, and the rest share their worker pool
pytestmark = pytest.mark.timed

LEGAL_REWARDS = (CORRECT, FORMATTED_WRONG, UNFORMATTED)


def respond(answer: str) -> str:
    """A well-formatted rollout whose answer block holds `answer`."""
    return f" 2 + 2 makes 4. </think> <answer> {answer} </answer>"


# ---------------------------------------------------------------- format


FORMAT_CASES = [
    # (response, ground truth, expected)
    (" so 18 </think> <answer> 18 </answer>", "18", CORRECT),
    ("\n</think> <answer>\n18\n</answer>", "18", CORRECT),
    (" so 18 </think><answer> 18 </answer>", "18", UNFORMATTED),  # no space between the tags
    (" so 18 </think>  <answer> 18 </answer>", "18", UNFORMATTED),  # two spaces
    (" so 18 </think>\n<answer> 18 </answer>", "18", UNFORMATTED),  # newline, not a space
    (" so 18 </think> <answer> 18", "18", UNFORMATTED),  # missing </answer>
    ("<answer> 18 </answer>", "18", UNFORMATTED),  # no </think>
    ("18", "18", UNFORMATTED),
    ("", "18", UNFORMATTED),
    (" </think> <answer> 17 </answer> <answer> 18 </answer>", "18", CORRECT),  # last <answer> graded
    (" </think> <answer> 18 </answer> <answer> 17 </answer>", "18", FORMATTED_WRONG),
    (" </think> <answer> 18 </answer> I hope that helps", "18", FORMATTED_WRONG),  # trailing text is part of the answer
    (" </think> <answer> </answer>", "18", FORMATTED_WRONG),  # empty answer
    (" </think> <answer> 19 </answer>", "18", FORMATTED_WRONG),  # formatted but wrong: no reward for format alone
    (" </think> <answer> so \\boxed{18}. </answer>", "18", CORRECT),  # the box is graded
    (" </think> <answer> \\boxed{17} then \\boxed{18} </answer>", "18", CORRECT),  # the last box
    (" </think> <answer> \\boxed{\\boxed{18}} </answer>", "18", CORRECT),
    (" </think> <answer> \\boxed{18 </answer>", "18", FORMATTED_WRONG),  # unclosed box
    (" </think> <answer> \\boxed 18 </answer>", "18", FORMATTED_WRONG),  # box without braces
    (" </think> <answer> so \\boxed{18 </answer>", "18", FORMATTED_WRONG),  # unclosed box after text
    (" </think> <answer> \\boxed {18} </answer>", "18", CORRECT),  # a space before the brace
    # an escaped brace does not close the box: `\left\{ ... \right.` is one-sided
    (" </think> <answer> \\boxed{\\left\\{ 1, 2 \\right.} </answer>", "\\left\\{ 1, 2 \\right.", CORRECT),
]


@pytest.mark.parametrize("response, truth, expected", FORMAT_CASES)
def test_format_rules(response, truth, expected):
    assert r1_zero_reward_fn(response, truth) == expected


@pytest.mark.parametrize("response", [None, b" </think> <answer> 18 </answer>", 18, ["</think> <answer> 18 </answer>"]])
def test_non_string_response_is_unformatted(response):
    assert r1_zero_reward_fn(response, "18") == UNFORMATTED


def test_rewards_are_fresh_dicts_of_floats():
    reward = r1_zero_reward_fn(respond("18"), "18")
    reward["reward"] = -1.0  # a caller mutating its copy must not change the next result
    again = r1_zero_reward_fn(respond("18"), "18")
    assert again == CORRECT and all(type(value) is float for value in again.values())


# ---------------------------------------------------------------- equivalence


EQUIVALENT = [
    # (model answer, ground truth)
    ("1,080", "1080"),
    ("1080", "1,080"),
    ("1{,}080", "1080"),
    ("$18", "18"),
    ("\\$18", "18"),
    ("$18.00", "18"),
    ("18.00", "18"),
    ("18.", "18"),
    ("-5", "-5"),
    ("\u22125", "-5"),  # unicode minus
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\frac12", "0.5"),
    ("\\sqrt{2}", "\\sqrt2"),
    ("2^{1/2}", "\\sqrt{2}"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
    ("x=3", "3"),
    ("3", "x = 3"),
    ("50\\%", "50"),
    ("50", "50\\%"),
    ("25%", "25"),  # GSM8K "what percentage" answers: the sign is the unit
    ("12.5\\%", "12.5"),
    ("30^\\circ", "30"),
    ("30", "30^{\\circ}"),
    ("\\text{(A)}", "A"),
    ("(A)", "A"),
    ("(1, 2)", "(1,2)"),
    ("\\left( 3, -4 \\right)", "(3,-4)"),
    ("[1,2)", "[1, 2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\{2,1\\}", "\\{1,2\\}"),
    ("\\pi", "\\pi"),
    ("2 \\pi", "2\\pi"),
    ("\\frac{\\pi}{2}", "\\frac12\\pi"),
    ("(x+1)^2", "x^2+2x+1"),
    ("10^{3}", "1000"),
    ("1.8e1", "18"),  # scientific notation is a plain number (it went to sympy, which read `e` as Euler's number)
    ("1e3", "1000"),
    ("2E2", "200"),
    ("1.0e+3", "1000"),
    ("25e-1", "2.5"),
    # each below was graded otherwise by a plausible bug that no test caught (a planted-bug round)
    ("-25\\%", "-25"),  # a signed percent is still a plain number with its unit, not -0.25
    ("1,200\\%", "1200"),  # thousands commas and a percent unit together
    ("1,000,000\\%", "1000000"),
    (".5\\%", "0.5"),  # no leading zero
    ("1\\,080\\%", "1080"),  # a LaTeX thin space as thousands separator
    ("1 080", "1080"),
    ("\\dfrac{1}{\\binom{4}{2}}", "\\frac{1}{\\binom{4}{2}}"),  # \binom: string match only, so normalising must do it
    ("\\left(\\binom{4}{2}\\right)", "(\\binom{4}{2})"),
    ("\\binom{4}{2} + 1", "\\binom{4}{2}+1"),
    ("\\binom{4}{2}\\!+1", "\\binom{4}{2}+1"),
    ("\\[x = \\frac{1}{2}\\]", "0.5"),  # math delimiters around a symbolic answer
    ("\\frac{100!}{98!}", "9900"),  # factorials of 3-digit literals still go to sympy
    ("(1,2)", "1<x<2"),  # math-verify is asymmetric: the gold goes first
]

NOT_EQUIVALENT = [
    ("19", "18"),
    ("1.8e1", "1.8"),
    ("-5", "5"),
    ("18.01", "18"),
    ("1.414", "\\sqrt{2}"),  # as strict as Dr. GRPO: a rounded decimal is not the surd
    ("1.414214", "\\sqrt{2}"),
    ("0.333333", "\\frac{1}{3}"),
    ("3.14", "\\pi"),
    ("The answer is 18.", "18"),  # a sentence is not a number
    ("18 or 19", "18"),
    ("18 dollars", "18"),
    ("(2,1)", "(1,2)"),  # order matters in a tuple
    ("[1,2]", "[1,2)"),  # closed is not half-open
    ("B", "A"),
    ("\\frac{1}{3}", "0.5"),
    ("x=4", "3"),
    ("2x+1", "(x+1)^2"),
    ("9**9**9**9", "18"),
    ("1800\\%", "18"),  # a percent sign is a unit, not / 100 (math-verify alone says equal)
    ("0.25", "25\\%"),
    ("18\\%", "0.18"),
    ("1,08", "108"),  # a misplaced comma is not a thousands separator
    ("-1800\\%", "-18"),
    ("+1800\\%", "18"),
    ("1800%", "18"),  # the plain percent sign is a unit too
    ("18,000\\%", "180"),
    ("so \\boxed{1800\\%}", "18"),  # a box after text is extracted first, then its percent is a unit
    ("10000000000000000001", "10000000000000000000"),  # exact decimals, not floats
]


@pytest.mark.parametrize("answer, truth", EQUIVALENT)
def test_equivalent_answers_score_one(answer, truth):
    assert r1_zero_reward_fn(respond(answer), truth) == CORRECT


@pytest.mark.parametrize("answer, truth", NOT_EQUIVALENT)
def test_different_answers_score_format_only(answer, truth):
    assert r1_zero_reward_fn(respond(answer), truth) == FORMATTED_WRONG


def test_percent_is_a_unit_in_evaluation_too():
    """The lenient evaluation pass must not bring math-verify's / 100 back."""
    assert r1_zero_reward_fn(respond("1800\\%"), "18", fast=False) == FORMATTED_WRONG
    assert r1_zero_reward_fn(respond("25\\%"), "25", fast=False) == CORRECT


def test_slow_path_rounds_floats_to_six_places_not_fewer():
    assert r1_zero_reward_fn(respond("0.333333"), "\\frac{1}{3}", fast=False) == CORRECT
    assert r1_zero_reward_fn(respond("0.33333"), "\\frac{1}{3}", fast=False) == FORMATTED_WRONG


def test_reward_values_are_the_r1_zero_contract():
    """The constants the other tests compare with, pinned: a planted change to one of them passed every other test."""
    assert r1_zero_reward_fn(respond("18"), "18") == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
    assert r1_zero_reward_fn(respond("19"), "18") == {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
    assert r1_zero_reward_fn(" so 18 </think><answer> 18 </answer>", "18") == {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def test_whitespace_around_an_answer_or_truth_does_not_count_towards_the_size_limit():
    # 300 spaces would push either side past MAX_SYMBOLIC_CHARS (string match only) if it were not stripped first
    assert r1_zero_reward_fn(respond(" " * 300 + "\\frac{1}{2}"), "0.5") == CORRECT
    assert r1_zero_reward_fn(respond("0.5"), " " * 300 + "\\frac{1}{2}") == CORRECT


GROUND_TRUTH_TYPES = [
    # (model answer, ground truth, expected)
    ("18", 18, CORRECT),
    ("19", 18, FORMATTED_WRONG),
    ("-3", -3, CORRECT),
    ("0.5", 0.5, CORRECT),
    ("\\frac{5}{2}", 2.5, CORRECT),
    ("100000000000000000000", 1e20, CORRECT),  # not "1e+20"
    ("10^{20}", 1e20, CORRECT),  # "1e+20" would reach sympy as 1*e + 20, e being Euler's number
    ("0.1", 0.1, CORRECT),  # repr, so not 0.1000000000000000055...
    ("\\frac12", ["1/3", "0.5"], CORRECT),  # any of a list
    ("3", ["1", "2"], FORMATTED_WRONG),
    ("18", ("17", 18), CORRECT),
    ("18", [], FORMATTED_WRONG),
    ("18", None, FORMATTED_WRONG),
    ("1", True, FORMATTED_WRONG),  # a bool is not an answer
    ("nan", float("nan"), FORMATTED_WRONG),
    ("18", {"answer": "18"}, FORMATTED_WRONG),
    ("0.5", "so the answer is \\boxed{\\frac{1}{2}}.", CORRECT),  # a MATH solution as ground truth
]


@pytest.mark.parametrize("answer, truth, expected", GROUND_TRUTH_TYPES)
def test_ground_truth_types(answer, truth, expected):
    assert r1_zero_reward_fn(respond(answer), truth) == expected


LENIENT_ONLY = [
    # correct with fast=False (evaluation), wrong with fast=True (training)
    ("The answer is 18.", "18"),
    ("18 dollars", "18"),
    ("so it is $\\frac{1}{2}$", "0.5"),
    ("0.333333", "\\frac{1}{3}"),  # 6-decimal rounding
    ("1.414214", "\\sqrt{2}"),
    ("Each costs 3 dollars,\nso the total is 18", "18"),  # the last number across lines
    ("The total is 1,080.", "1080"),  # thousands commas in the last number
    ("The answer is **18**.", "18"),  # markdown bold: `**` keeps sympy out, not the plain last number
    ("**18**", "18"),
    ("By $\\sum$ of the parts, 18", "18"),
]


@pytest.mark.parametrize("answer, truth", LENIENT_ONLY)
def test_slow_path_is_more_lenient(answer, truth):
    assert r1_zero_reward_fn(respond(answer), truth, fast=True) == FORMATTED_WRONG
    assert r1_zero_reward_fn(respond(answer), truth, fast=False) == CORRECT


CLEAR_CASES = EQUIVALENT + [case for case in NOT_EQUIVALENT if case not in LENIENT_ONLY]


@pytest.mark.parametrize("answer, truth", CLEAR_CASES)
def test_slow_path_agrees_on_clear_cases(answer, truth):
    assert r1_zero_reward_fn(respond(answer), truth, fast=False) == r1_zero_reward_fn(respond(answer), truth)


# ---------------------------------------------------------------- GSM8K gold


@pytest.fixture(scope="module")
def gsm8k_gold(gsm8k_dir):
    """(sft completion, ground truth) for every train and test row, built as the dataset builds them."""
    data_dir = gsm8k_dir
    pairs = []
    for split in SPLITS:
        dataset = Gsm8kDataset(split, data_dir)
        pairs += zip(dataset.completions, dataset.ground_truths)
    return pairs


def test_every_gsm8k_gold_completion_scores_one(gsm8k_gold):
    completions, truths = zip(*gsm8k_gold)
    rewards = grade_responses(completions, truths)
    failures = [(completion[-80:], truth) for completion, truth, reward in zip(completions, truths, rewards) if reward != CORRECT]
    assert len(rewards) == len(gsm8k_gold)
    assert failures == []


def test_gsm8k_gold_off_by_one_scores_format_only(gsm8k_gold):
    completions, truths = zip(*gsm8k_gold)
    off_by_one = [
        completion.rpartition("<answer>")[0] + f"<answer> {Decimal(truth) + 1} </answer>"
        for completion, truth in gsm8k_gold
    ]
    rewards = grade_responses(off_by_one, truths)
    assert len(rewards) == len(gsm8k_gold)
    assert [reward for reward in rewards if reward != FORMATTED_WRONG] == []


# ---------------------------------------------------------------- batches


def test_batch_helper_matches_serial_calls_in_order(caplog):
    # the format cases too: the batch path checks the format itself before any answer is compared, and an
    # unformatted response whose answer is right (a missing </answer>, a bare "18") must stay unrewarded there
    cases = [(respond(answer), truth) for answer, truth in EQUIVALENT + NOT_EQUIVALENT] + [(response, truth) for response, truth, _ in FORMAT_CASES]
    cases = (cases * (300 // len(cases) + 1))[:300]  # above POOL_MIN_BATCH, so workers are used
    responses, truths = zip(*cases)
    expected = [r1_zero_reward_fn(response, truth) for response, truth in cases]
    assert expected.count(UNFORMATTED) >= 7 * (300 // len(cases))
    assert grade_responses(responses, truths, num_workers=2) == expected
    assert "grading pool failed" not in caplog.text  # the workers did the grading, not the serial fallback
    assert grade_responses(responses, truths, num_workers=1) == expected


def test_batch_helper_never_raises_on_bad_arguments():
    assert grade_responses(None, None) == []
    assert grade_responses([], []) == []
    # a missing ground truth grades as wrong; the format still counts
    assert grade_responses([respond("18"), respond("18")], ["18"]) == [CORRECT, FORMATTED_WRONG]
    assert grade_responses([respond("18")], ["18", "19"]) == [CORRECT]
    assert grade_responses([respond("18")] * 300, ["18"] * 300, num_workers="many") == [CORRECT] * 300


def test_batch_helper_passes_fast_on_to_serial_and_worker_grading():
    """fast=False (evaluation) must reach a small batch's serial grading and a big batch's workers alike."""
    cases = [(respond(answer), truth) for answer, truth in LENIENT_ONLY]
    for size in (len(cases), 300):
        responses, truths = zip(*(cases * (size // len(cases) + 1))[:size])
        assert grade_responses(responses, truths, fast=False, num_workers=2) == [CORRECT] * size
        assert grade_responses(responses, truths, num_workers=2) == [FORMATTED_WRONG] * size


@pytest.mark.parametrize("needing_sympy", [1, 8, 9])
def test_batch_helper_grades_every_answer_when_few_need_sympy(needing_sympy):
    # 9 answers for 2 workers make chunks of 2 and a last chunk of one, the one most easily lost
    cases = [(respond("\\frac{1}{2}"), "0.5", CORRECT)] * needing_sympy + [(respond("19"), "18", FORMATTED_WRONG)] * (300 - needing_sympy)
    responses, truths, expected = zip(*cases)
    assert grade_responses(responses, truths, num_workers=2) == list(expected)


def test_batch_helper_grades_serially_when_the_workers_cannot_start(monkeypatch, caplog):
    def cannot_start(count):
        raise OSError("no processes left")

    monkeypatch.setattr(drgrpo_grader, "_start_workers", cannot_start)
    cases = [(respond(answer), truth) for answer, truth in EQUIVALENT + NOT_EQUIVALENT]
    responses, truths = zip(*(cases * (300 // len(cases) + 1))[:300])
    expected = [r1_zero_reward_fn(response, truth) for response, truth in zip(responses, truths)]
    assert grade_responses(responses, truths, num_workers=3) == expected
    assert "grading pool failed (OSError)" in caplog.text


# ---------------------------------------------------------------- never raises


TAG_VOCABULARY = [
    "<think>", "</think>", "<answer>", "</answer>", "</think> <answer>", " ", "\n", "\\boxed{", "{", "}",
    "\\frac", "\\dfrac", "^", "_", "$", "\\$", "\\sqrt", "(", ")", "[", "]", "\\{", "\\}", "\\left(", "\\right)",
    "1", "0.5", "18", ",", "1,080", "x", "=", "\\%", "%", "!", "\\!", "\\text{", "-", "+", "/", "\\pi", "\\infty",
    "\\circ", "\\cdot", "\\", "\\\\", "\x00", "9", "**", "e", "i", "\\sum", "\\int", "&", "\\begin{pmatrix}",
]
fragments = st.lists(st.sampled_from(TAG_VOCABULARY), max_size=30).map("".join)
formatted = st.builds(lambda inner: f" ok </think> <answer> {inner} </answer>", st.one_of(fragments, st.text(max_size=40)))
truths = st.one_of(
    st.text(max_size=20), fragments, st.integers(), st.floats(), st.none(),
    st.lists(st.one_of(st.text(max_size=10), fragments, st.integers()), max_size=3),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=st.one_of(st.text(max_size=200), fragments, formatted), truth=truths, fast=st.booleans())
def test_random_input_never_raises(response, truth, fast):
    assert r1_zero_reward_fn(response, truth, fast) in LEGAL_REWARDS


# ---------------------------------------------------------------- hostile input


HOSTILE = {
    "power-tower": "10^{10^{10^{10}}}",
    "nine-tower": "9^{9^{9^9}}",
    "flat-tower": "9^9^9^9",
    "python-power": "9**9**9**9",
    "bracketed-power": "(10^{99})^{99}",
    "huge-exponent": "10^{10000000}",
    "product-exponent": "2^{999\\cdot 999}",
    "factorial": "100000!",
    "factorial-of-power": "(10^{10})!",
    "sum": "\\sum_{i=1}^{10^{10}} i!",
    "binomial": "\\binom{1000000}{500000}",
    "deep-parens": "(" * 5000 + "1" + ")" * 5000,
    "deep-frac": "\\frac{" * 2000 + "1",
    "open-braces": "{" * 100_000,
    "many-boxes": "\\boxed{" * 5000,
    "megabyte-text": "x" * 1_000_000,
    "megabyte-digits": "1" * 1_000_000,
    "megabyte-tags": "<answer>" * 100_000,
    "nul-bytes": "1\x008\x00",
    "division-by-zero": "\\frac{1}{0}",
    "nested-sqrt": "\\sqrt{" * 200 + "2" + "}" * 200,
    "long-polynomial": "+".join(f"x^{{{k}}}" for k in range(60)),
    "dollars": "$" * 10_000 + "17",
    "matrix": "\\begin{pmatrix}" + "&".join(["1"] * 100) + "\\end{pmatrix}",
    "factorial-power": "(748!+i)^{717+e}",
    "slow-expand": "\\frac{(x+i)^{152\\cdot 3}}{7!}",  # passes the size guard; only the time limit stops it
}


@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_answer_returns_within_a_second(answer):
    for response, truth in [(respond(answer), "18"), (respond("18"), answer), (answer, "18"), (respond(answer), ["18", answer])]:
        for fast in (True, False):
            start = time.perf_counter()
            reward = r1_zero_reward_fn(response, truth, fast)
            elapsed = time.perf_counter() - start
            assert reward in LEGAL_REWARDS
            assert elapsed < 1.0, f"{elapsed:.2f} s"


class _SlowFinalizer:
    """An object whose `__del__` runs long enough for the time limit's first alarm to land in it."""

    def __init__(self, on_delete=None):
        self.on_delete = on_delete

    def __del__(self):
        time.sleep(0.3)
        if self.on_delete:
            self.on_delete()


def _spin_after_finalizer(on_delete=None):
    _SlowFinalizer(on_delete)  # finalised at once; Python swallows what its __del__ raises
    while True:
        pass


def test_an_alarm_swallowed_in_a_finalizer_stays_quiet_and_the_next_one_stops_the_work(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    started = time.perf_counter()
    with pytest.raises(drgrpo_grader._GradingTimeout):
        drgrpo_grader._call_with_time_limit(0.1, _spin_after_finalizer)
    assert time.perf_counter() - started < 1.0
    assert reported == []  # our own alarm, swallowed in __del__, is nobody's business
    assert sys.unraisablehook == reported.append  # the caller's hook is back


def test_the_alarm_never_cuts_short_the_hook_that_reports_someone_elses_swallowed_error(monkeypatch):
    # pytest's hook, slow on a loaded CI machine, was cut short by a repeating alarm and failed the test
    reported = []

    def slow_hook(unraisable):
        time.sleep(0.3)  # several ALARM_REPEAT_S long: a live alarm would raise in here
        reported.append(type(unraisable.exc_value).__name__)

    def raise_in_del():
        raise ValueError("a finaliser's own error")

    monkeypatch.setattr(sys, "unraisablehook", slow_hook)
    with pytest.raises(drgrpo_grader._GradingTimeout):
        drgrpo_grader._call_with_time_limit(0.5, _spin_after_finalizer, raise_in_del)
    assert reported == ["ValueError"]


# Most of these passed the old size guard and made sympy compute a factorial of millions
# (or 9^{362880}) for the whole time limit: all are refused before sympy now (string match only).
HUGE_FACTORIALS = [
    "\\Gamma(10^{6})", "\\Gamma(1000000)", "\\Gamma \\left( 1000000 \\right)", "\\gamma(10^{6})", "\\Gamma^{2}(10^{6})",
    "\\Gamma(9^{9})", "\\operatorname{gamma}(1000000)", "\\mathrm{Gamma}(10^{6})", "\\lfloor 1000000\\rfloor!",
    "\\lceil 10^6 \\rceil!", "\\lfloor\\frac{1000000}{1}\\rfloor!", "(10^6)!", "1000!", "9^9!", "2^{\\Gamma(999)}",
    "\\Gamma(999)^{999}",
]
SMALL_FACTORIALS = [
    # (answer, truth, expected): still compared by sympy
    ("5!", "120", CORRECT),
    ("3!", "6", CORRECT),
    ("3!", "7", FORMATTED_WRONG),
    ("\\Gamma(5)", "24", CORRECT),
    ("\\Gamma(5)", "4!", CORRECT),
    ("\\Gamma(5)", "25", FORMATTED_WRONG),
    ("\\Gamma(\\frac{1}{2})", "\\sqrt{\\pi}", CORRECT),
    ("\\frac{6!}{4!}", "30", CORRECT),
]


def test_huge_factorial_and_gamma_arguments_are_refused_before_sympy():
    r1_zero_reward_fn(respond("\\Gamma(5)"), "24")  # warm-up outside the timing
    for answer in HUGE_FACTORIALS:
        assert not drgrpo_grader._is_safe_for_symbolic(answer), answer
        start = time.perf_counter()
        assert r1_zero_reward_fn(respond(answer), "18") == FORMATTED_WRONG
        assert r1_zero_reward_fn(respond("18"), answer) == FORMATTED_WRONG
        elapsed = time.perf_counter() - start
        assert elapsed < 0.2, f"{answer}: {elapsed:.2f} s for two calls (the time limit is 0.4 s each)"
        assert r1_zero_reward_fn(respond(answer), answer) == CORRECT  # string match still works
    for answer, truth, expected in SMALL_FACTORIALS:
        assert drgrpo_grader._is_safe_for_symbolic(answer), answer
        assert r1_zero_reward_fn(respond(answer), truth) == expected, (answer, truth)


def test_time_limit_stops_slow_symbolic_work_and_restores_the_alarm_handler(monkeypatch):
    def spin_forever(*args):
        while True:
            pass

    monkeypatch.setattr(drgrpo_grader, "_symbolic_match", spin_forever)
    handler_before = signal.getsignal(signal.SIGALRM)
    start = time.perf_counter()
    assert r1_zero_reward_fn(respond("\\frac{1}{2}"), "0.5") == FORMATTED_WRONG  # a timeout counts as wrong
    assert time.perf_counter() - start < 1.0
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_time_limit_survives_a_swallowed_alarm(monkeypatch):
    def swallow_first_alarm_then_spin(*args):
        try:
            while True:
                pass
        except BaseException:  # like a gc callback or a bare `except:` deep in a library
            pass
        while True:
            pass

    monkeypatch.setattr(drgrpo_grader, "_symbolic_match", swallow_first_alarm_then_spin)
    start = time.perf_counter()
    assert r1_zero_reward_fn(respond("\\frac{1}{2}"), "0.5") == FORMATTED_WRONG
    assert time.perf_counter() - start < 1.0


def test_outside_the_main_thread_grading_still_works():
    cases = [(respond(answer), truth) for answer, truth in EQUIVALENT[:10] + NOT_EQUIVALENT[:10]]
    cases += [(respond(answer), "18") for answer in HOSTILE.values()]
    results = []
    worker = threading.Thread(target=lambda: results.extend(r1_zero_reward_fn(r, t) for r, t in cases))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert results == [r1_zero_reward_fn(response, truth) for response, truth in cases]


def test_hostile_batch_in_worker_processes_returns_promptly():
    answers = list(HOSTILE.values())
    responses = [respond(answers[index % len(answers)]) for index in range(256)]
    start = time.perf_counter()
    rewards = grade_responses(responses, ["18"] * 256, num_workers=2)
    assert time.perf_counter() - start < 30.0  # includes starting the pool if no earlier test did
    assert rewards == [FORMATTED_WRONG] * 256


def test_python_code_in_answers_is_never_executed(tmp_path):
    target = tmp_path / "created_by_model_text"
    payloads = [
        f"__import__('os').system('touch {target}')",
        f"open('{target}', 'w').write('x')",
        f"1 + __import__('os').system('touch {target}')",
        f"\\boxed{{__import__('os').system('touch {target}')}}",
        f"lambda: __import__('pathlib').Path('{target}').touch()",
    ]
    for payload in payloads:
        assert r1_zero_reward_fn(respond(payload), "0") == FORMATTED_WRONG
        assert r1_zero_reward_fn(respond("0"), payload) == FORMATTED_WRONG
        # fast=False takes the last number of a sentence, which may come from the path: only legal
        assert r1_zero_reward_fn(respond(payload), "0", fast=False) in LEGAL_REWARDS
        assert r1_zero_reward_fn(respond("0"), payload, fast=False) in LEGAL_REWARDS
    assert not target.exists()


# 2,500 hypothesis cases of LaTeX fragments, 2,000-deep parentheses, power towers and 2,000-digit
# numbers, and 1 MB inputs: every call within a second
LATEX_PIECES = ["\\frac{", "\\sqrt{", "\\boxed{", "}", "{", "^", "^{", "9", "10", "(", ")", "[", "]", "\\pi", "x", "=", ",", ".",
                "\\left(", "\\right)", "\\text{", "%", "\\%", "-", "+", "*", "**", "!", "\\infty", "\\cdot", "e", "\x00", " ", "\\\\"]
adversarial_answer = st.one_of(
    st.lists(st.sampled_from(LATEX_PIECES), max_size=80).map("".join),
    st.integers(min_value=1, max_value=40).map(lambda depth: "(" * depth * 50 + "1" + ")" * depth * 50),
    st.integers(min_value=2, max_value=9).map(lambda n: "^".join(["9"] * n)),
    st.integers(min_value=2, max_value=6).map(lambda n: "10^{" * n + "10" + "}" * n),
    st.text(max_size=300),
    st.integers(min_value=1, max_value=2000).map(lambda n: "9" * n),
)


@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
@given(answer=adversarial_answer, truth=st.one_of(st.sampled_from(["18", "\\frac{1}{2}", "\\sqrt{2}", "-5", "(1,2)"]), adversarial_answer))
def test_grader_fuzz_thousands_of_adversarial_answers(answer, truth):
    started = time.perf_counter()
    result = r1_zero_reward_fn(f"<think> x </think> <answer> {answer} </answer>", truth)
    assert time.perf_counter() - started < 1.0
    assert result in LEGAL_REWARDS


def test_grader_on_huge_inputs_is_bounded():
    for response in ("</think> <answer> " + "1+" * 500_000 + "1 </answer>", "\x00" * 1_000_000, "{" * 100_000 + "</think> <answer> }</answer>"):
        started = time.perf_counter()
        assert r1_zero_reward_fn(response, "2") in LEGAL_REWARDS
        assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------- off the main thread

# Passes the size guard, so only the time limit stops it: more than 20 s of sympy without one.
SLOW_ANSWER = "(x+y+i)^{200}"
SLOW_SYMBOLIC = respond(SLOW_ANSWER)


def grade_in_thread(response: str, truth) -> tuple[dict | None, float]:
    """(reward, seconds) for one call made from a fresh thread; reward None if it took over 30 s."""
    result = []
    worker = threading.Thread(target=lambda: result.append(r1_zero_reward_fn(response, truth)), daemon=True)
    start = time.perf_counter()
    worker.start()
    worker.join(timeout=30)  # the first call starts the workers: seconds
    return (result[0] if result else None), time.perf_counter() - start


def test_time_limit_holds_in_a_thread():
    assert grade_in_thread(respond("\\frac{1}{2}"), "0.5")[0] == CORRECT  # also starts the workers (seconds)
    reward, elapsed = grade_in_thread(SLOW_SYMBOLIC, "18")
    assert reward == FORMATTED_WRONG and elapsed < 1.0, f"{reward} after {elapsed:.2f} s"
    assert grade_in_thread(respond("\\frac{1}{3}"), "0.5")[0] == FORMATTED_WRONG


def test_time_limit_holds_under_another_interval_timer():
    alarms = []

    def user_handler(signum, frame):
        alarms.append(signum)

    previous = signal.signal(signal.SIGALRM, user_handler)
    signal.setitimer(signal.ITIMER_REAL, 100)  # e.g. a training-loop watchdog
    try:
        assert r1_zero_reward_fn(respond("\\frac{1}{2}"), "0.5") == CORRECT  # also starts the workers
        start = time.perf_counter()
        assert r1_zero_reward_fn(SLOW_SYMBOLIC, "18") == FORMATTED_WRONG
        assert time.perf_counter() - start < 1.0
        remaining, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 50 < remaining < 100 and interval == 0.0  # still counting down, as the user set it
        assert signal.getsignal(signal.SIGALRM) is user_handler and alarms == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_concurrent_threads_each_get_their_own_result():
    cases = [
        (respond("\\frac{1}{2}"), "0.5", CORRECT),
        (respond("\\frac{1}{3}"), "0.5", FORMATTED_WRONG),
        (respond("(x+1)^2"), "x^2+2x+1", CORRECT),
        (respond("2x+1"), "(x+1)^2", FORMATTED_WRONG),
        (respond("\\sqrt{2}"), "2^{1/2}", CORRECT),
        (respond("(2,1)"), "(1,2)", FORMATTED_WRONG),
        (SLOW_SYMBOLIC, "18", FORMATTED_WRONG),  # holds a worker for the full limit meanwhile
        (SLOW_SYMBOLIC, SLOW_ANSWER, CORRECT),  # decided by string match, no worker
    ]
    start_together = threading.Barrier(len(cases))
    results = [None] * len(cases)

    def grade(index, response, truth):
        start_together.wait()
        results[index] = r1_zero_reward_fn(response, truth)

    threads = [threading.Thread(target=grade, args=(i, r, t), daemon=True) for i, (r, t, _) in enumerate(cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [expected for _, _, expected in cases]


# ---------------------------------------------------------------- many threads, and a caller's unguarded script

BENIGN = [
    # (response, truth, expected): each needs sympy, so from a thread each goes to a worker
    (respond("\\frac{1}{2}"), "0.5", CORRECT),
    (respond("(x+1)^2"), "x^2+2x+1", CORRECT),
    (respond("\\sqrt{2}"), "2^{1/2}", CORRECT),
    (respond("\\frac{1}{3}"), "0.5", FORMATTED_WRONG),
    (respond("\\Gamma(5)"), "24", CORRECT),
    (respond("(2,1)"), "(1,2)", FORMATTED_WRONG),
]
MAX_THREAD_WAIT_S = 1.5  # the bound is SYMBOLIC_TIME_LIMIT_S + WORKER_OVERHEAD_S = 0.7 s; slack for a slow CI machine


def grade_from_threads(cases_per_thread: list[list[tuple]]) -> list[list[tuple[dict, float]]]:
    """Each thread grades its own (response, truth, ...) list, all starting together: (reward, seconds) per call."""
    start_together = threading.Barrier(len(cases_per_thread))
    results = [[] for _ in cases_per_thread]

    def grade(index):
        start_together.wait()
        for response, truth, *_ in cases_per_thread[index]:
            start = time.perf_counter()
            reward = r1_zero_reward_fn(response, truth)
            results[index].append((reward, time.perf_counter() - start))

    threads = [threading.Thread(target=grade, args=(index,), daemon=True) for index in range(len(cases_per_thread))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_eight_threads_of_hostile_answers_each_wait_within_the_bound():
    """The attack: 8 threads x the hostile set. Before, huge Gamma and factorial answers held the
    workers for the whole limit, and callers queued for a free worker before their deadline
    started: the longest call waited 14.5 s on 2 CPUs. Benign answers mixed in must still be right."""
    assert grade_in_thread(*BENIGN[0][:2])[0] == CORRECT  # starts the workers (seconds) if no earlier test did
    hostile = [(respond(answer), "18", FORMATTED_WRONG) for name, answer in HOSTILE.items() if name != "slow-expand"]
    hostile += [(respond(answer), "18", FORMATTED_WRONG) for answer in HUGE_FACTORIALS]
    mixed = []
    for index, case in enumerate(hostile):
        if index % 4 == 0:  # a benign answer before every fourth hostile one
            mixed.append(BENIGN[index // 4 % len(BENIGN)])
        mixed.append(case)
    cases_per_thread = [mixed[index * 5 :] + mixed[: index * 5] for index in range(8)]  # each thread starts elsewhere
    results = grade_from_threads(cases_per_thread)
    longest = max(seconds for per_thread in results for _, seconds in per_thread)
    print(f"8 threads x {len(mixed)} answers ({len(hostile)} hostile): longest wait {longest:.2f} s")
    for cases, per_thread in zip(cases_per_thread, results):
        assert [reward for reward, _ in per_thread] == [expected for _, _, expected in cases]
    assert longest <= MAX_THREAD_WAIT_S


def test_a_flood_of_slow_answers_cannot_make_a_thread_wait_longer():
    """8 threads x 3 answers that each hold a worker for the whole time limit: more work than the
    workers can do in time, so most count as wrong, but no caller waits for the others' turns,
    and the abandoned work does not clog the workers for the calls that come next."""
    assert grade_in_thread(*BENIGN[0][:2])[0] == CORRECT  # starts the workers (seconds) if no earlier test did
    results = grade_from_threads([[(SLOW_SYMBOLIC, "18")] * 3] * 8)
    longest = max(seconds for per_thread in results for _, seconds in per_thread)
    print(f"8 threads x 3 slow answers: longest wait {longest:.2f} s")
    assert [reward for per_thread in results for reward, _ in per_thread] == [FORMATTED_WRONG] * 24
    assert longest <= MAX_THREAD_WAIT_S
    after = grade_from_threads([[case] for case in BENIGN])
    assert [per_thread[0][0] for per_thread in after] == [expected for _, _, expected in BENIGN]


# The report's script, and a second call that needs sympy (the first is now refused before any worker).
UNGUARDED_SCRIPT = r"""import threading; from alignment.drgrpo_grader import r1_zero_reward_fn
grade = lambda answer, truth: print(r1_zero_reward_fn(f"</think> <answer> {answer} </answer>", truth))
t = threading.Thread(target=lambda: grade("\\Gamma(10^{9})", "18")); t.start(); t.join()
t = threading.Thread(target=lambda: grade("\\frac{1}{2}", "0.5")); t.start(); t.join()
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_callers_unguarded_script_runs_once(tmp_path, how):
    """Workers must not re-run the caller's `__main__` (spawn did: as a file the script printed each
    result once more per worker; fed on stdin, its workers failed and respawned without end)."""
    script = tmp_path / "grade.py"
    script.write_text(UNGUARDED_SCRIPT)
    command = [sys.executable, str(script)] if how == "file" else [sys.executable, "-"]
    done = subprocess.run(
        command, input=UNGUARDED_SCRIPT if how == "stdin" else "", capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the second verdict needed sympy from a thread, so a worker gave it
    assert done.stdout.splitlines() == [str(FORMATTED_WRONG), str(CORRECT)], done.stderr[-3000:]


def test_a_worker_that_dies_is_replaced_and_ctrl_c_does_not_reach_it(caplog):
    assert grade_in_thread(*BENIGN[0][:2])[0] == CORRECT  # starts the workers (seconds) if no earlier test did
    pool = drgrpo_grader._symbolic_pool
    first = pool.workers[0].process
    first.send_signal(signal.SIGINT)  # Ctrl-C goes to the whole process group: the caller's to handle
    time.sleep(0.3)
    assert first.poll() is None
    first.kill()
    first.wait()
    # Calls go on meanwhile: the one that meets the dead worker counts as wrong, none waits longer than the bound.
    deadline = time.monotonic() + 60
    while pool.workers[0].process is first and time.monotonic() < deadline:
        results = grade_from_threads([[case] for case in BENIGN])  # busy enough that every worker gets a task
        for (reward, seconds), (_, _, expected) in zip((per_thread[0] for per_thread in results), BENIGN):
            assert reward in (expected, FORMATTED_WRONG) and seconds <= MAX_THREAD_WAIT_S
    # replaced once the new worker had started (importing sympy, in the feeder's thread), and it serves as before
    assert pool.workers[0].process is not first and pool.workers[0].process.poll() is None
    assert "a grading worker died or hung" in caplog.text
    results = grade_from_threads([[case] * 2 for case in BENIGN])
    assert [[reward for reward, _ in per_thread] for per_thread in results] == [[expect] * 2 for _, _, expect in BENIGN]


FORK_AND_EXIT_SCRIPT = r"""import os, threading
from alignment import drgrpo_grader

def reward_in_thread(answer, truth):
    response, result = f"</think> <answer> {answer} </answer>", []
    thread = threading.Thread(target=lambda: result.append(drgrpo_grader.r1_zero_reward_fn(response, truth)))
    thread.start(); thread.join()
    return result[0]["reward"]

assert reward_in_thread("\\frac{1}{2}", "0.5") == 1.0
workers = [worker.process.pid for worker in drgrpo_grader._symbolic_pool.workers]
child = os.fork()
if child == 0:  # the parent's workers are not the child's: it starts its own
    own = drgrpo_grader._symbolic_pool is None  # forgotten at the fork
    ok = own and reward_in_thread("\\sqrt{2}", "2^{1/2}") == 1.0
    ok = ok and not {worker.process.pid for worker in drgrpo_grader._symbolic_pool.workers} & set(workers)
    os._exit(0 if ok else 1)
assert os.waitpid(child, 0)[1] == 0
assert reward_in_thread("\\frac{1}{3}", "0.5") == 0.0 and reward_in_thread("(x+1)^2", "x^2+2x+1") == 1.0
print(*workers)
"""


def test_a_forked_child_starts_its_own_workers_and_all_stop_at_exit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", FORK_AND_EXIT_SCRIPT], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    workers = [int(pid) for pid in done.stdout.split()]
    assert len(workers) == min(drgrpo_grader._available_cpus(), drgrpo_grader.MAX_SYMBOLIC_WORKERS)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(is_running(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(is_running(pid) for pid in workers)  # stopped at exit (a pid is not reused this soon)


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def talk_to_a_worker(requests: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    """Run `python -m alignment.grader_worker`'s main (after `prelude`, which may patch the grader), send it these request
    lines, close its stdin (the worker then exits) and return what it wrote."""
    return subprocess.run(
        [sys.executable, "-c", f"{prelude}\nfrom alignment import grader_worker\ngrader_worker.main()"], input="".join(line + "\n" for line in requests),
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def test_a_grading_worker_answers_null_to_a_request_outside_its_protocol_and_serves_on():
    """Replies are one JSON value a line: a verdict list per "match" request, null (all wrong, for the grader) for anything
    else, whether it fails to parse, has another kind or malformed questions; the worker must not die of one."""
    match = '["match", [["\\\\frac{1}{2}", ["0.5"], true], ["3", ["4"], true]], 5]'
    done = talk_to_a_worker([match, '["match", 5, 1]', '["grade", [["1", ["1"], true]], 1]', "not json", '["match", [["1", ["1"], true]]]', match])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line) for line in done.stdout.splitlines()] == ["ready", [True, False], None, None, None, None, [True, False]]


def test_a_grading_workers_replies_stay_clean_when_a_library_prints():
    """A stray print() inside the symbolic check goes to stderr; on the reply stream it would garble the next reply."""
    prelude = ("from alignment import drgrpo_grader\nmatch = drgrpo_grader._symbolic_match\n"
               "def noisy(*args):\n    print('a library talking', flush=True)\n    return match(*args)\ndrgrpo_grader._symbolic_match = noisy")
    done = talk_to_a_worker(['["match", [["\\\\frac{1}{2}", ["0.5"], true]], 5]'] * 2, prelude)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ['"ready"', "[true]", "[true]"]
    assert done.stderr.count("a library talking") == 2


def test_a_grading_worker_bounds_each_match_by_the_seconds_it_was_sent():
    """The grader sends each worker the time its caller has left: a check that needs 1 s is a verdict under 10 s and a
    timeout (false) under 0.2 s, whatever the worker's own default limit."""
    prelude = ("import time\nfrom alignment import drgrpo_grader\n"
               "def slow(*args):\n    time.sleep(1.0)\n    return True\ndrgrpo_grader._symbolic_match = slow")
    done = talk_to_a_worker(['["match", [["x", ["y"], true]], 10]', '["match", [["x", ["y"], true]], 0.2]'], prelude)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ['"ready"', "[true]", "[false]"]


def test_an_answer_sent_to_a_dead_worker_counts_as_wrong(monkeypatch):
    """A worker found dead when its task arrives gives no verdict: wrong, never the task's default."""
    monkeypatch.setattr(drgrpo_grader, "_symbolic_pool", None)  # a pool of its own, to break; the shared one comes back after
    assert grade_in_thread(respond("\\frac{1}{2}"), "0.5")[0] == CORRECT  # starts the workers (seconds)
    pool = drgrpo_grader._symbolic_pool
    try:
        for worker in pool.workers:
            worker.process.kill()
            worker.process.wait()
        assert grade_in_thread(respond("\\frac{1}{3}"), "0.5")[0] == FORMATTED_WRONG
    finally:
        pool.close()
