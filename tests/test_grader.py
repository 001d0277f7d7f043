"""Tests for `alignment/drgrpo_grader.py`: the r1_zero reward contract.

Exact tables for format and equivalence, every GSM8K gold completion (and the same with
the answer off by one), random strings that must never raise, hostile input that must
return within a second, and model text that must never run as Python.
"""

import os
import signal
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignment import drgrpo_grader
from alignment.data import SPLITS, Gsm8kDataset
from alignment.drgrpo_grader import CORRECT, FORMATTED_WRONG, UNFORMATTED, grade_responses, r1_zero_reward_fn

# A time-limit alarm that lands in hypothesis's gc callback is swallowed there (pytest
# reports it as "unraisable"); the repeating alarm then stops the work. By design.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO_ROOT = Path(__file__).resolve().parents[1]
LEGAL_REWARDS = (CORRECT, FORMATTED_WRONG, UNFORMATTED)


def respond(answer: str) -> str:
    """A well-formatted rollout whose answer block holds `answer`."""
    return f" 2 + 2 makes 4. </think> <answer> {answer} </answer>"


def find_gsm8k_dir() -> Path:
    """`$GSM8K_DIR`, else `data/gsm8k` under the repo, else the shared copy; skip when none has both splits."""
    candidates = [os.environ.get("GSM8K_DIR"), REPO_ROOT / "data" / "gsm8k", "/work/shared/data/gsm8k"]
    for candidate in candidates:
        if candidate and all((Path(candidate) / f"{split}.jsonl").is_file() for split in SPLITS):
            return Path(candidate)
    pytest.skip("GSM8K jsonl files not found: set GSM8K_DIR or run `python -m alignment.data download`")


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
]

NOT_EQUIVALENT = [
    ("19", "18"),
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


GROUND_TRUTH_TYPES = [
    # (model answer, ground truth, expected)
    ("18", 18, CORRECT),
    ("19", 18, FORMATTED_WRONG),
    ("-3", -3, CORRECT),
    ("0.5", 0.5, CORRECT),
    ("\\frac{5}{2}", 2.5, CORRECT),
    ("100000000000000000000", 1e20, CORRECT),  # not "1e+20"
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
def gsm8k_gold():
    """(sft completion, ground truth) for every train and test row, built as the dataset builds them."""
    data_dir = find_gsm8k_dir()
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
    cases = [(respond(answer), truth) for answer, truth in EQUIVALENT + NOT_EQUIVALENT]
    cases = (cases * (300 // len(cases) + 1))[:300]  # above POOL_MIN_BATCH, so workers are used
    responses, truths = zip(*cases)
    expected = [r1_zero_reward_fn(response, truth) for response, truth in cases]
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


# ---------------------------------------------------------------- off the main thread

# Passes the size guard, so only the time limit stops it: minutes of sympy without one.
SLOW_SYMBOLIC = respond("\\Gamma(10^{9})")


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
        (SLOW_SYMBOLIC, "\\Gamma(10^{9})", CORRECT),  # decided by string match, no worker
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
