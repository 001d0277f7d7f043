"""The r1_zero reward: a strict format check, then math equivalence of the final answer.

    from alignment.drgrpo_grader import r1_zero_reward_fn, grade_responses
    r1_zero_reward_fn(" 48/2 = 24 </think> <answer> 24 </answer>", "24")
    # {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
    grade_responses(responses, ground_truths)   # a list of such dicts, in order

The contract is the one of the Dr. GRPO (understand-r1-zero) grader:

- format: the response must contain the literal `</think> <answer>` (one space) and
  `</answer>`; otherwise all three rewards are 0.0;
- answer: the text after the last `<answer>`, with `</answer>` removed and stripped
  (text after `</answer>` stays part of it, so trailing rambling makes it wrong); if it
  holds `\\boxed{...}` the last box is graded, and a box that never closes is wrong;
- correct -> (1, 1, 1); formatted but wrong -> (1, 0, 0); a list of ground truths is
  correct when any one of them matches.

Equivalence is decided cheapest first:

1. normalised string match (whitespace, `$`, `\\dfrac`, `\\left`, `\\!` removed);
2. plain numbers (`1,080`, `$18`, `18.00`, `-5`, `18.`, `25\\%`): exact decimal comparison,
   decisive when both sides are plain numbers. Nearly every GSM8K answer ends here. A
   percent sign is the number's unit: `25\\%` = 25, and `1800\\%` is not 18 (math-verify
   would divide by 100; for a GSM8K "what percentage" problem that is a wrong answer);
3. math-verify, with each side parsed as ONE LaTeX expression (wrapped in `\\boxed{}`
   with no anchor search), so `The answer is 18.` is a sentence, not `18`. This covers
   `\\frac{1}{2}` = `0.5` = `1/2`, `\\sqrt{2}`, `x=3` = `3`, `30^\\circ`,
   `\\text{(A)}` = `A`, tuples, intervals, sets and `\\pi`. Decimals must match to
   10 places, so `1.414` and `1.414214` are not `\\sqrt{2}` and `0.333333` is not 1/3.

`fast=False` (evaluation only) adds a lenient pass: math-verify's anchored LaTeX
extraction on the answer (`the answer is $18$`), the last number in the answer
(`The answer is 18.`), and math-verify's default 6-decimal rounding.

Safety, because the grader reads untrusted model text:

- nothing raises: every failure is a wrong answer;
- no model text is evaluated as Python. We only use math-verify's LaTeX path (antlr
  grammar -> sympy objects). Its `ExprExtractionConfig` calls sympy's `parse_expr`,
  which is `eval`, so it is never used;
- bounded time, from any thread: symbolic work runs under a SIGALRM interval timer
  (0.4 s per call). That only works in a process's main thread while no other
  ITIMER_REAL is armed; there the work runs in-process, and the first symbolic call
  pays a one-off ~0.5 s warm-up outside the limit. Otherwise (a thread, or a caller's
  own timer armed, which we leave alone) it runs in a small persistent pool of spawn
  worker processes, each bounded by its own alarm, and the caller waits at most 0.7 s
  for the verdict: a later one, or a dead worker, counts as wrong. The first such call
  in a process starts the workers (spawn + importing sympy: several seconds, once);
  threads beyond the worker count wait their turn. The limit is wall-clock, so on a
  CPU starved by other work a slow but correct comparison can time out and count as
  wrong;
- an alarm only stops Python bytecode, not one huge C-level integer power, so answers
  that could build enormous numbers (`10^{10^{10}}`, `(10^{99})^{99}`, `100000!`,
  `\\sum`) are graded by string match only, as are answers longer than
  MAX_SYMBOLIC_CHARS.
"""

import atexit
import functools
import logging
import math
import multiprocessing
import numbers
import os
import re
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from decimal import Decimal, InvalidOperation

from math_verify import LatexExtractionConfig, parse, verify

logger = logging.getLogger(__name__)

FORMAT_MARKER = "</think> <answer>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

MAX_SYMBOLIC_CHARS = 300  # longer answers (or truths) get string match only
SYMBOLIC_TIME_LIMIT_S = 0.4  # per call, all ground truths together; a timeout is a wrong answer
ALARM_REPEAT_S = 0.05  # after the time limit the alarm fires again this often until disarmed
MAX_NESTING_DEPTH = 20  # brackets deeper than this never occur in real answers, only in attacks
MAX_POWER_DIGITS = 20_000  # bound on digits an integer power in the answer may reach
STRICT_FLOAT_DECIMALS = 10  # verify(float_rounding=...) for fast=True
LENIENT_FLOAT_DECIMALS = 6  # math-verify's default, for fast=False
POOL_MIN_BATCH = 256  # smaller batches grade serially: a pool round trip costs more
MAX_SYMBOLIC_WORKERS = 4  # worker processes for symbolic work of callers that cannot use the alarm
WORKER_OVERHEAD_S = 0.3  # a worker's verdict may come this long after SYMBOLIC_TIME_LIMIT_S; later is wrong
WORKER_START_TIMEOUT_S = 120  # for spawning the workers and importing sympy; slower is wrong, retried next call

CORRECT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
# Reward stays 0 for a wrong answer even when formatted: no format reward, to avoid reward hacking.
FORMATTED_WRONG = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
UNFORMATTED = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}

# Whole-string parsing: the `\boxed{}` we wrap around the text is the only thing extracted.
_WHOLE_EXPRESSION = (LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=0),)
# Lenient extraction from a sentence: `$...$`, `\(...\)`, "final answer is ...".
_ANCHORED_LATEX = (LatexExtractionConfig(),)


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is off; ours replaces it, so the warning misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


# ---------------------------------------------------------------- time limit


class _GradingTimeout(BaseException):
    """Raised by our SIGALRM handler. A BaseException, so that the many `except Exception`
    blocks inside math-verify and sympy cannot swallow it and keep computing."""


def _can_use_alarm() -> bool:
    # Signal handlers can only be set from the main thread; and we do not clobber an
    # interval timer that someone else (e.g. a training loop watchdog) already armed.
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


def _call_with_time_limit(seconds: float, function, *args):
    """`function(*args)`, or `_GradingTimeout` once `seconds` have passed (main thread only).

    The alarm repeats every ALARM_REPEAT_S until disarmed: Python swallows an exception
    raised inside a gc callback or `__del__`, so a one-shot alarm landing there would be
    lost and the computation would run on unbounded.
    """
    if not _can_use_alarm():
        return function(*args)
    armed = True

    def on_alarm(signum, frame):
        if armed:
            raise _GradingTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
        return function(*args)
    finally:
        armed = False  # first: from here on a late alarm is a no-op, so clean-up cannot be cut short
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- text helpers


def _model_answer(response: str) -> str | None:
    """The graded answer: after the last `<answer>`, `</answer>` removed; None for an unclosed box."""
    answer = response.rpartition(ANSWER_OPEN)[2].replace(ANSWER_CLOSE, "").strip()
    if "\\boxed" in answer:
        return _last_boxed_content(answer)
    return answer


def _last_boxed_content(text: str) -> str | None:
    """`'so \\boxed{\\frac{1}{2}}.'` -> `'\\frac{1}{2}'`; None when the last box never closes.

    The last `\\boxed` is also the innermost one, so `\\boxed{\\boxed{5}}` gives `5`.
    Escaped braces `\\{ \\}` (sets) do not count towards the nesting.
    """
    index = text.rfind("\\boxed") + len("\\boxed")
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text) or text[index] != "{":
        return None
    depth = 0
    for position in range(index, len(text)):
        char = text[position]
        if char in "{}" and text[position - 1] == "\\":
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[index + 1 : position].strip()
    return None


_STRING_REPLACEMENTS = (
    ("\\$", ""), ("$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""),
    ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("{,}", ","),
    ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("\u2212", "-"),
)


def _normalise_string(text: str) -> str:
    """Spelling-only normalisation, safe on any length: `'$1{,}080 '` -> `'1,080'`."""
    for old, new in _STRING_REPLACEMENTS:
        text = text.replace(old, new)
    return "".join(text.split())


# Thousands commas must be well placed: `1,080` is a number, `1,08` is not (a tuple?).
_PLAIN_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")


def _plain_number(text: str) -> Decimal | None:
    """`'$1,080.00'` -> Decimal('1080.00'); None for anything that is not a plain number.

    Takes the output of `_normalise_string` (no `$`, no spaces). A trailing period
    (`18.`) is punctuation on a bare number, as in the PRM800K normaliser Dr. GRPO uses.
    """
    if len(text) > MAX_SYMBOLIC_CHARS or not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


_INTEGER_LITERAL = re.compile(r"\d+")
_UNSAFE_COMMANDS = ("\\sum", "\\prod", "\\int", "\\lim", "\\binom", "\\dbinom", "\\tbinom", "\\choose", "**")


def _exponent_span(text: str, start: int) -> tuple[str, int] | None:
    """The exponent after a `^` at `start - 1` and the index after it; None if its brace never closes."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        return "", start
    if text[start] == "{":
        depth = 0
        for position in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                return text[start + 1 : position], position + 1
        return None
    command = re.match(r"\\[A-Za-z]+", text[start:])
    end = start + (command.end() if command else 1)
    return text[start:end], end


def _max_nesting(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth -= 1
    return deepest


def _is_safe_for_symbolic(text: str) -> bool:
    """Whether sympy may see `text` without risking one huge, uninterruptible computation.

    `10^{10^{10}}` makes sympy build a ten-billion-digit integer inside one C call that
    no alarm can stop. So: no power towers, no factorial beyond a 3-digit literal, no
    sums/products/integrals/binomials, bounded nesting, and integer powers whose
    digits (base digits x product of exponents) stay under MAX_POWER_DIGITS.
    Powers of a plain variable (`x^{10}`) never build big numbers and are not counted.
    """
    if len(text) > MAX_SYMBOLIC_CHARS or any(command in text for command in _UNSAFE_COMMANDS):
        return False
    if _max_nesting(text) > MAX_NESTING_DEPTH:
        return False
    literal_digits = max(1, sum(len(literal) for literal in _INTEGER_LITERAL.findall(text)))
    for match in re.finditer(r"(?<!\\)!", text):
        before = text[: match.start()].rstrip()
        literal = re.search(r"\d*$", before).group()
        if len(literal) > 3 or (not literal and not before[-1:].isalpha()):
            return False
        literal_digits += 3 * int(literal or 0)  # n! has fewer than 3n digits for n < 1000
    growth = 1
    for match in re.finditer(r"\^", text):
        span = _exponent_span(text, match.end())
        if span is None:
            return False
        exponent, end = span
        if "^" in exponent or "!" in exponent or text[end:].lstrip(" ").startswith("^"):
            return False  # a tower such as 9^{9^9} or 9^9^9
        base_word = re.search(r"\\?[A-Za-z]*$", text[: match.start()].rstrip(" ")).group()
        if not base_word.isalpha():  # `x^{10}` is a variable's power; `9^`, `)^`, `!^`, `\rfloor^` may be huge
            for literal in _INTEGER_LITERAL.findall(exponent):
                if len(literal) > 6:
                    return False
                growth *= max(1, int(literal))
            if growth * literal_digits > MAX_POWER_DIGITS:
                return False
    return True


# ---------------------------------------------------------------- symbolic comparison


@functools.lru_cache(maxsize=4096)
def _parse_whole(text: str) -> tuple:
    """math-verify's parse of `text` as one expression: (sympy object, normalised string) or ()."""
    for old, new in (("\\$", ""), ("$", ""), ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", "")):
        text = text.replace(old, new)  # math delimiters would start a second extraction
    return tuple(
        parse(
            "\\boxed{" + text + "}",
            extraction_config=_WHOLE_EXPRESSION,
            fallback_mode="first_match",
            extraction_mode="first_match",
            parsing_timeout=None,  # math-verify's own timeout is whole seconds and main-thread only
        )
    )


# One pair per comparison path of math-verify: numbers, simplify, relations, sets, intervals, symbols.
_WARM_UP_PAIRS = (
    ("0.5", "\\frac{1}{2}"), ("x^2+2x+1", "(x+1)^2"), ("3", "x=3"), ("0.5", "50\\%"), ("\\sqrt{2}", "1.414"),
    ("\\{1,2\\}", "\\{2,1\\}"), ("[1,2)", "(1,2)"), ("A", "\\text{(A)}"), ("\\pi", "3.14"), ("30", "30^\\circ"),
)


@functools.lru_cache(maxsize=1)
def _warm_up() -> None:
    """Compare a few answers once, outside any time limit. The first comparisons in a
    process build antlr, sympy and simplify caches (~0.5 s), which must neither be
    charged to one answer's time limit nor be cut half-way by it."""
    for truth, answer in _WARM_UP_PAIRS:
        _symbolically_equal(answer, truth, STRICT_FLOAT_DECIMALS)


def _symbolically_equal(answer: str, truth: str, float_decimals: int) -> bool:
    if not (_is_safe_for_symbolic(answer) and _is_safe_for_symbolic(truth)):
        return False
    gold, predicted = _parse_whole(truth), _parse_whole(answer)
    if not gold or not predicted:
        return False
    return verify(list(gold), list(predicted), float_rounding=float_decimals, timeout_seconds=None)


_LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!.*\d)", re.DOTALL)


def _leniently_equal(answer: str, truth: str) -> bool:
    """fast=False only: find the answer inside a sentence, and round floats to 6 places."""
    if not (_is_safe_for_symbolic(answer) and _is_safe_for_symbolic(truth)):
        return False
    gold = _parse_whole(truth)
    if not gold:
        return False
    candidates = list(_parse_whole(answer))
    candidates += parse(answer, extraction_config=_ANCHORED_LATEX, parsing_timeout=None)
    last_number = _LAST_NUMBER.search(answer)
    if last_number:
        number = last_number.group().replace(",", "")
        truth_number = _plain_number(_normalise_string(truth))
        if truth_number is not None and Decimal(number) == truth_number:
            return True
        candidates += list(_parse_whole(number))
    return verify(list(gold), candidates, float_rounding=LENIENT_FLOAT_DECIMALS, timeout_seconds=None)


# ---------------------------------------------------------------- grading


def _without_percent(text: str) -> str:
    """`'50\\%'` -> `'50'`: a percent sign after a number is its unit, not a division by 100.

    GSM8K's "what percentage ...?" problems have the bare number as ground truth, so
    `25\\%` must match 25; math-verify would also accept `1800\\%` for 18 (1800/100),
    which for a grade-school word problem is a wrong answer (the Dr. GRPO grader's
    verdict too). Decided here, with plain numbers, before math-verify sees it.
    """
    for sign in ("\\%", "%"):
        if text.endswith(sign):
            return text[: -len(sign)]
    return text


def _cheap_verdict(answer: str, truth: str) -> bool | None:
    """True/False when string or plain-number comparison decides, None when sympy must."""
    answer_text, truth_text = _normalise_string(answer), _normalise_string(truth)
    if not answer_text or not truth_text:
        return False
    if answer_text == truth_text:
        return True
    answer_number, truth_number = _plain_number(_without_percent(answer_text)), _plain_number(_without_percent(truth_text))
    if answer_number is not None and truth_number is not None:
        return answer_number == truth_number
    if len(answer) > MAX_SYMBOLIC_CHARS or len(truth) > MAX_SYMBOLIC_CHARS:
        return False
    return None


def _ground_truth_texts(ground_truth) -> list[str]:
    """A str, int, float or list of them -> list of answer strings; anything else is skipped."""
    items = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    texts = []
    for item in items:
        try:
            if isinstance(item, bool):  # True is an int, but never a math answer
                continue
            if isinstance(item, str):
                text = item
            elif isinstance(item, numbers.Integral):
                text = str(int(item))
            elif isinstance(item, numbers.Real):
                if not math.isfinite(item):
                    continue
                # repr, not str(Decimal(x)): 0.1 must read "0.1"; "f" avoids "1e+20".
                text = format(Decimal(repr(float(item))), "f")
            else:
                continue
        except (ValueError, ArithmeticError, OverflowError):  # e.g. an int of more than 4,300 digits
            continue
        if "\\boxed" in text:  # a full MATH solution as ground truth
            text = _last_boxed_content(text) or text
        texts.append(text.strip())
    return texts


def _symbolic_match(answer: str, truths: list[str], fast: bool) -> bool:
    for truth in truths:
        if _symbolically_equal(answer, truth, STRICT_FLOAT_DECIMALS):
            return True
    if not fast:
        for truth in truths:
            if _leniently_equal(answer, truth):
                return True
    return False


def _bounded_symbolic_match(answer: str, truths: list[str], fast: bool) -> bool:
    """`_symbolic_match` under the alarm, in the main thread of this process or of a worker."""
    _warm_up()
    try:
        return _call_with_time_limit(SYMBOLIC_TIME_LIMIT_S, _symbolic_match, answer, truths, fast)
    except _GradingTimeout:
        return False  # a timeout counts as wrong


def _is_correct(response: str, ground_truth, fast: bool) -> bool:
    answer = _model_answer(response)
    if answer is None:
        return False
    undecided = []
    for truth in _ground_truth_texts(ground_truth):
        verdict = _cheap_verdict(answer, truth)
        if verdict:
            return True
        if verdict is None:
            undecided.append(truth)
    if not undecided:
        return False
    if _can_use_alarm():
        return _bounded_symbolic_match(answer, undecided, fast)
    return _symbolic_match_in_worker(answer, undecided, fast)


def r1_zero_reward_fn(response: str, ground_truth, fast: bool = True) -> dict[str, float]:
    """Reward for one rollout: `{"format_reward", "answer_reward", "reward"}`, each 0.0 or 1.0.

    `ground_truth` is a str, int, float, or a list of them (correct if any matches).
    `fast=True` is what training uses; `fast=False` adds a lenient pass for evaluation.
    Never raises and returns within about SYMBOLIC_TIME_LIMIT_S, from any thread (see the
    module docstring). Off the main thread, or with another interval timer armed, the first
    call that needs sympy also waits once for the grading workers to start (seconds).
    """
    if not isinstance(response, str) or FORMAT_MARKER not in response or ANSWER_CLOSE not in response:
        return dict(UNFORMATTED)
    try:
        correct = _is_correct(response, ground_truth, fast)
    except (Exception, _GradingTimeout):  # a bug on odd input must cost one reward, not a training run
        logger.debug("grading failed; counted as wrong", exc_info=True)
        correct = False
    return dict(CORRECT if correct else FORMATTED_WRONG)


# ---------------------------------------------------------------- worker processes


def _init_worker(ready=None) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops the workers,
    # which would otherwise each die with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm_up()
    if ready is not None:
        ready.release()


_symbolic_pool = None  # multiprocessing.Pool for `_symbolic_match_in_worker`
_symbolic_slots = None  # one per worker, so that no task waits in the pool's queue while its deadline runs
_symbolic_pool_lock = threading.Lock()


def _forget_symbolic_pool() -> None:
    # A forked child gets the pool object but none of its threads, and maybe our lock held.
    global _symbolic_pool, _symbolic_slots, _symbolic_pool_lock
    _symbolic_pool, _symbolic_slots, _symbolic_pool_lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_symbolic_pool)


def _get_symbolic_pool():
    """(pool, slots), started on first use; returns once every worker has imported sympy and warmed up.

    A multiprocessing.Pool, not a ProcessPoolExecutor: it starts all workers at once (so
    none starts later while a caller's short deadline runs) and replaces a worker that dies.
    """
    global _symbolic_pool, _symbolic_slots
    with _symbolic_pool_lock:
        if _symbolic_pool is None:
            workers = min(_available_cpus(), MAX_SYMBOLIC_WORKERS)
            context = multiprocessing.get_context("spawn")  # not fork: see _get_pool
            ready = context.Semaphore(0)
            pool = context.Pool(workers, initializer=_init_worker, initargs=(ready,))
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            if not all(ready.acquire(timeout=max(0.0, deadline - time.monotonic())) for _ in range(workers)):
                pool.terminate()
                raise TimeoutError("grading workers did not start")
            _symbolic_pool, _symbolic_slots = pool, threading.BoundedSemaphore(workers)
        return _symbolic_pool, _symbolic_slots


def _symbolic_match_in_worker(answer: str, truths: list[str], fast: bool) -> bool:
    """`_bounded_symbolic_match` in a worker's main thread, where the alarm works; for callers where it does not.

    A verdict later than SYMBOLIC_TIME_LIMIT_S + WORKER_OVERHEAD_S counts as wrong. The
    worker is not killed: its own alarm frees it, and killing it would cost a restart.
    """
    pool, slots = _get_symbolic_pool()
    with slots:
        pending = pool.apply_async(_bounded_symbolic_match, (answer, truths, fast))
        try:
            return pending.get(timeout=SYMBOLIC_TIME_LIMIT_S + WORKER_OVERHEAD_S)
        except multiprocessing.TimeoutError:  # also what a worker that died mid-task looks like
            return False


# ---------------------------------------------------------------- batches


_pool: ProcessPoolExecutor | None = None
_pool_key = None  # (worker count, pid that made the pool)


def _shutdown_pool() -> None:
    global _pool, _pool_key
    if _pool is not None and _pool_key[1] == os.getpid():
        _pool.shutdown(wait=False, cancel_futures=True)
    _pool, _pool_key = None, None


atexit.register(_shutdown_pool)


def _get_pool(num_workers: int) -> ProcessPoolExecutor:
    """One pool kept for the life of the process: starting workers (importing sympy) takes seconds."""
    global _pool, _pool_key
    # A forked child inherits the parent's pool object, whose manager thread it lacks: make its own.
    if _pool is None or _pool_key != (num_workers, os.getpid()):
        _shutdown_pool()
        # spawn, not fork: forking a process that holds torch/CUDA threads can deadlock.
        _pool = ProcessPoolExecutor(
            max_workers=num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
        )
        _pool_key = (num_workers, os.getpid())
    return _pool


def _grade_chunk(chunk: list[tuple]) -> list[dict[str, float]]:
    return [r1_zero_reward_fn(response, truth, fast) for response, truth, fast in chunk]


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def grade_responses(responses, ground_truths, fast: bool = True, num_workers: int | None = None) -> list[dict[str, float]]:
    """`r1_zero_reward_fn` over a batch, in order; worker processes for big batches.

    Batches of at least POOL_MIN_BATCH on a machine with more than one CPU go to a
    persistent spawn pool (default: one worker per available CPU, at most 8); smaller
    ones are graded serially. A broken or stuck pool falls back to serial grading of
    what is left. Never raises; if `ground_truths` is shorter than `responses` the
    missing truths grade as wrong (and a warning is logged).
    """
    try:
        responses, ground_truths = list(responses), list(ground_truths)
    except Exception:
        logger.warning("grade_responses: responses and ground_truths must be iterables; graded nothing")
        return []
    if len(ground_truths) != len(responses):
        logger.warning("grade_responses: %d responses but %d ground truths", len(responses), len(ground_truths))
        ground_truths = (ground_truths + [None] * len(responses))[: len(responses)]
    items = [(response, truth, fast) for response, truth in zip(responses, ground_truths)]
    try:
        num_workers = min(_available_cpus(), 8) if num_workers is None else int(num_workers)
    except (TypeError, ValueError):
        num_workers = 1
    if len(items) < POOL_MIN_BATCH or num_workers <= 1:
        return _grade_chunk(items)

    chunk_size = max(1, -(-len(items) // (num_workers * 4)))
    chunks = [items[start : start + chunk_size] for start in range(0, len(items), chunk_size)]
    results: list[list[dict] | None] = [None] * len(chunks)
    try:
        pool = _get_pool(num_workers)
        futures = [pool.submit(_grade_chunk, chunk) for chunk in chunks]
        # Generous: pool start-up, then every item at its full time limit spread over the workers.
        deadline = time.monotonic() + 60 + len(items) * SYMBOLIC_TIME_LIMIT_S * 2 / num_workers
        for index, future in enumerate(futures):
            results[index] = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except Exception as error:  # BrokenProcessPool (a worker died), TimeoutError, pickling errors
        logger.warning("grading pool failed (%s); grading the rest serially", type(error).__name__)
        _shutdown_pool()
    return [
        reward
        for chunk, result in zip(chunks, results)
        for reward in (result if result is not None else _grade_chunk(chunk))
    ]
