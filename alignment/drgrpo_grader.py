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
2. plain numbers (`1,080`, `$18`, `18.00`, `-5`, `18.`, `25\\%`, `1.8e1`): exact decimal comparison,
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
  own timer armed, which we leave alone) it goes to a small pool of worker processes,
  each bounded by its own alarm, and the caller waits at most 0.7 s
  (SYMBOLIC_TIME_LIMIT_S + WORKER_OVERHEAD_S) counted from the start of its call,
  queueing for a free worker included, however many threads call at once: a worker is
  given only the time its caller has left, a task whose caller has stopped waiting is
  skipped, and a verdict not back in time, or a dead worker, counts as wrong. So when
  many threads send slow answers at once, an answer queued behind them can count as
  wrong too. The first such call in a process starts the workers (importing sympy: a
  second or more, once; that call's 0.7 s count from when they are ready). The limit is
  wall-clock, so on a CPU starved by other work a slow but correct comparison can time
  out and count as wrong;
- workers never run the caller's code. They are plain subprocesses running our own
  module (`python -m alignment.grader_worker`, JSON lines over pipes), not
  multiprocessing's spawn, which re-runs the caller's `__main__` script in each worker
  (an unguarded script printed its output once per worker; code fed on stdin made
  workers fail and respawn forever). They ignore SIGINT (Ctrl-C is the caller's to
  handle); one that dies or hangs is replaced in the background, its answer counted as
  wrong; a forked child starts its own; all are stopped at exit;
- an alarm only stops Python bytecode, not one huge C-level integer power, so answers
  that could build enormous numbers (`10^{10^{10}}`, `(10^{99})^{99}`, `100000!`,
  `\\sum`) are graded by string match only, as are factorials and Gamma functions of
  anything but a literal up to 999 or a letter (`\\Gamma(10^{6})`, `(10^6)!`,
  `\\lfloor 1000000\\rfloor!` would each burn the whole time limit), and answers
  longer than MAX_SYMBOLIC_CHARS.
"""

import atexit
import functools
import json
import logging
import math
import numbers
import os
import queue
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
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
WORKER_OVERHEAD_S = 0.3  # such a caller waits at most SYMBOLIC_TIME_LIMIT_S + this from its call's start, queueing included
WORKER_REPLY_MARGIN_S = 0.1  # a worker gets the caller's time left minus this, so that its verdict arrives in time
WORKER_HANG_S = 5.0  # a worker silent this long after its time limit is stuck (a C call the alarm cannot stop): replaced
WORKER_START_TIMEOUT_S = 120  # for starting the workers and importing sympy; slower is wrong, retried next call
MAX_FACTORIAL_DIGITS = 3  # `n!` and `\Gamma(n)` only for literals up to 999: \Gamma(10^{6}) has 5.5 million digits

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
    lost and the computation would run on unbounded. Python hands such a swallowed
    exception to `sys.unraisablehook`: ours is dropped there (the next alarm stops the
    work), and while the hook reports anyone else's the alarm holds off, so that it
    never cuts the hook short (pytest's failed a test when an alarm landed in it).
    """
    if not _can_use_alarm():
        return function(*args)
    armed = True

    def on_alarm(signum, frame):
        if armed:
            raise _GradingTimeout()

    previous_hook = sys.unraisablehook

    def on_unraisable(unraisable):
        nonlocal armed
        if isinstance(unraisable.exc_value, _GradingTimeout):
            return
        was_armed, armed = armed, False
        try:
            previous_hook(unraisable)
        finally:
            armed = was_armed

    previous = signal.signal(signal.SIGALRM, on_alarm)
    sys.unraisablehook = on_unraisable
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
        return function(*args)
    finally:
        armed = False  # first: from here on a late alarm is a no-op, so clean-up cannot be cut short
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook


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
# Scientific notation (`1.8e1`, `1e3`) is a plain number too: its exponent is bounded, and Decimal compares it exactly.
_PLAIN_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?")


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
# latex2sympy turns `\Gamma(x)` and `\gamma(x)` into sympy.gamma(x), which evaluates (x-1)! at once.
# Any spelling of gamma or factorial (`\operatorname{gamma}`, `\mathrm{Gamma}`, `Γ`) is held to the same rule.
_GAMMA_NAME = re.compile(r"gamma|factorial|[Γγ]", re.IGNORECASE)
# What may follow such a name: `(5)`, `{n}`, `(\frac{1}{2})`, `(-1/2)`, `(2.5)`; digit counts are checked after.
_SMALL_GAMMA_CALL = re.compile(r"\}?[({\[]-?(?:\d+(?:\.\d+)?(?:/\d+)?|[A-Za-z]|\\frac\{\d+\}\{\d+\})[)}\]]")
_SPACING = re.compile(r"\\left|\\right|\\[,;:! ]|\s+")


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


def _factorial_arguments(text: str) -> list[int] | None:
    """A bound on the argument of each factorial and Gamma in `text` (0 for a variable); None when one may be huge.

    `5!`, `n!`, `\\Gamma(5)`, `\\Gamma(\\frac{1}{2})` are fine. Refused: a literal of more than
    MAX_FACTORIAL_DIGITS digits (`1000!`, `\\Gamma(1000000)`), and any argument that is not a
    literal or a letter (`(10^6)!`, `\\lfloor 1000000\\rfloor!`, `\\pi!`, `9^9!`, `\\Gamma(10^{6})`),
    since only sympy would know how big it is.
    """
    arguments = []
    for match in re.finditer(r"(?<!\\)!", text):
        before = text[: match.start()].rstrip()
        literal = re.search(r"\d*$", before).group()
        word = re.search(r"\\?[A-Za-z]*$", before).group()  # `n` is a variable; `\rfloor` or `\pi` is not
        if len(literal) > MAX_FACTORIAL_DIGITS or not (literal or word[:1].isalpha()):
            return None
        arguments.append(int(literal or 0))
    compact = _SPACING.sub("", text)  # `\Gamma \left( 5 \right)` -> `\Gamma(5)`
    for match in _GAMMA_NAME.finditer(compact):
        call = _SMALL_GAMMA_CALL.match(compact, match.end())
        literals = _INTEGER_LITERAL.findall(call.group()) if call else []
        if call is None or any(len(literal) > MAX_FACTORIAL_DIGITS for literal in literals):
            return None  # also a bare `\gamma` or `\Gamma^{2}(x)`: rare in answers, so refused rather than parsed
        arguments.append(max(map(int, literals), default=0))
    return arguments


def _is_safe_for_symbolic(text: str) -> bool:
    """Whether sympy may see `text` without risking one huge, uninterruptible computation.

    `10^{10^{10}}` makes sympy build a ten-billion-digit integer inside one C call that
    no alarm can stop, and `\\Gamma(10^{6})` a 5.5-million-digit factorial that costs the
    whole time limit. So: no power towers, no factorial or Gamma beyond a 3-digit literal
    (`_factorial_arguments`), no sums/products/integrals/binomials, bounded nesting, and
    integer powers whose digits (base digits x product of exponents) stay under
    MAX_POWER_DIGITS. Powers of a plain variable (`x^{10}`) never build big numbers and are
    not counted.
    """
    if len(text) > MAX_SYMBOLIC_CHARS or any(command in text for command in _UNSAFE_COMMANDS):
        return False
    if _max_nesting(text) > MAX_NESTING_DEPTH:
        return False
    factorial_arguments = _factorial_arguments(text)
    if factorial_arguments is None:
        return False
    literal_digits = max(1, sum(len(literal) for literal in _INTEGER_LITERAL.findall(text)))
    literal_digits += sum(3 * argument for argument in factorial_arguments)  # n! has fewer than 3n digits for n < 1000
    growth = 1
    for match in re.finditer(r"\^", text):
        span = _exponent_span(text, match.end())
        if span is None:
            return False
        exponent, end = span
        tower = "^" in exponent or "!" in exponent or _GAMMA_NAME.search(exponent)
        if tower or text[end:].lstrip(" ").startswith(("^", "!")):
            return False  # a tower such as 9^{9^9}, 9^9^9, 9^9! (= 9^{9!}) or 2^{\Gamma(99)}
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
    last_number = _LAST_NUMBER.search(answer)
    number = last_number.group().replace(",", "") if last_number else None
    truth_number = _plain_number(_normalise_string(truth))
    if number is not None and truth_number is not None and Decimal(number) == truth_number:
        return True  # plain numbers need no sympy: decided before the safety check, so `**18**` or `\sum` in the text do not hide it
    if not (_is_safe_for_symbolic(answer) and _is_safe_for_symbolic(truth)):
        return False
    gold = _parse_whole(truth)
    if not gold:
        return False
    candidates = list(_parse_whole(answer))
    candidates += parse(answer, extraction_config=_ANCHORED_LATEX, parsing_timeout=None)
    if number is not None:
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


def _bounded_symbolic_match(answer: str, truths: list[str], fast: bool, seconds: float = SYMBOLIC_TIME_LIMIT_S) -> bool:
    """`_symbolic_match` under the alarm, in the main thread of this process or of a worker."""
    _warm_up()
    try:
        return _call_with_time_limit(seconds, _symbolic_match, answer, truths, fast)
    except _GradingTimeout:
        return False  # a timeout counts as wrong


def _verdict_without_sympy(response: str, ground_truth) -> bool | tuple[str, list[str]]:
    """True/False when string or plain-number comparison decides; else (answer, the truths sympy must compare)."""
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
    return (answer, undecided) if undecided else False


def _is_correct(response: str, ground_truth, fast: bool, started: float) -> bool:
    verdict = _verdict_without_sympy(response, ground_truth)
    if isinstance(verdict, bool):
        return verdict
    answer, truths = verdict
    if _can_use_alarm():
        return _bounded_symbolic_match(answer, truths, fast)
    return _symbolic_match_in_worker(answer, truths, fast, started)


def _is_formatted(response) -> bool:
    return isinstance(response, str) and FORMAT_MARKER in response and ANSWER_CLOSE in response


def r1_zero_reward_fn(response: str, ground_truth, fast: bool = True) -> dict[str, float]:
    """Reward for one rollout: `{"format_reward", "answer_reward", "reward"}`, each 0.0 or 1.0.

    `ground_truth` is a str, int, float, or a list of them (correct if any matches).
    `fast=True` is what training uses; `fast=False` adds a lenient pass for evaluation.
    Never raises and returns within about SYMBOLIC_TIME_LIMIT_S (at most that + WORKER_OVERHEAD_S
    off the main thread, however many threads call at once; see the module docstring). Off the
    main thread, or with another interval timer armed, the first call that needs sympy also
    waits once for the grading workers to start (seconds).
    """
    started = time.monotonic()
    if not _is_formatted(response):
        return dict(UNFORMATTED)
    try:
        correct = _is_correct(response, ground_truth, fast, started)
    except (Exception, _GradingTimeout):  # a bug on odd input must cost one reward, not a training run
        logger.debug("grading failed; counted as wrong", exc_info=True)
        correct = False
    return dict(CORRECT if correct else FORMATTED_WRONG)


# ---------------------------------------------------------------- worker processes

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NO_REPLY = object()


class _Worker:
    """One `python -m alignment.grader_worker` process, spoken to in JSON lines over its stdin and stdout.

    A plain subprocess, not multiprocessing: spawn re-runs the caller's `__main__` script in
    every worker (a script without a `__main__` guard printed its output once per worker;
    code fed on stdin made workers fail and respawn forever). This runs our module only.
    Its cwd is the repo root, so `-m` finds this package before anything in the caller's folder.
    """

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "alignment.grader_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=_PACKAGE_ROOT,
        )
        self.replies = self.process.stdout.fileno()  # read with os.read only, so no bytes hide in a buffer
        self._unread = b""

    def send(self, request) -> None:
        self.process.stdin.write(json.dumps(request).encode("ascii") + b"\n")
        self.process.stdin.flush()

    def read_available(self) -> None:
        """Read what the worker has written (call when its stdout is readable); EOFError if it died."""
        chunk = os.read(self.replies, 1 << 16)
        if not chunk:
            raise EOFError("grading worker exited")
        self._unread += chunk

    def next_reply(self):
        """The oldest complete reply read so far, or _NO_REPLY."""
        if b"\n" not in self._unread:
            return _NO_REPLY
        line, _, self._unread = self._unread.partition(b"\n")
        return json.loads(line)

    def receive(self, timeout: float):
        """The next reply; TimeoutError if none comes within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.replies, selectors.EVENT_READ)
            while (reply := self.next_reply()) is _NO_REPLY:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    raise TimeoutError("grading worker did not answer in time")
                self.read_available()
        return reply

    def stop(self) -> None:
        self.process.kill()  # it holds no state worth a graceful exit
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


_WORKER_ERRORS = (OSError, EOFError, TimeoutError, ValueError)  # failed to start, died, stuck, or garbled


def _start_workers(count: int) -> list[_Worker]:
    """`count` workers, started at once; returns when each has imported sympy and warmed up (seconds)."""
    workers = []
    try:
        for _ in range(count):
            workers.append(_Worker())
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for worker in workers:
            if worker.receive(max(0.0, deadline - time.monotonic())) != "ready":
                raise ValueError("grading worker did not say it was ready")
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


class _SymbolicTask:
    def __init__(self, answer: str, truths: list[str], fast: bool, deadline: float) -> None:
        self.answer, self.truths, self.fast, self.deadline = answer, truths, fast, deadline
        self.verdict = False
        self.done = threading.Event()


class _SymbolicPool:
    """Workers for the symbolic checks of callers that cannot use the alarm.

    Callers put tasks on one queue, each with the moment its caller stops waiting. One
    feeder thread per worker takes the oldest task, gives the worker only the time left
    (at most SYMBOLIC_TIME_LIMIT_S, less WORKER_REPLY_MARGIN_S for the way back), skips a
    task whose caller has gone, and replaces a worker that dies or stays silent
    WORKER_HANG_S past its limit (in the feeder's thread, so no caller waits for the restart).
    """

    def __init__(self, size: int) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.workers = _start_workers(size)
        self.ready_at = time.monotonic()
        for index in range(size):
            threading.Thread(target=self._feed, args=(index,), name=f"grader-feeder-{index}", daemon=True).start()

    def match(self, answer: str, truths: list[str], fast: bool, deadline: float) -> bool:
        task = _SymbolicTask(answer, truths, fast, deadline)
        self.tasks.put(task)
        return task.done.wait(max(0.0, deadline - time.monotonic())) and task.verdict

    def _feed(self, index: int) -> None:
        while not self.closed:
            task = self.tasks.get()
            if task is None:
                return
            seconds = min(SYMBOLIC_TIME_LIMIT_S, task.deadline - time.monotonic() - WORKER_REPLY_MARGIN_S)
            if seconds <= 0:
                continue  # its caller has stopped waiting, or will before a verdict could arrive
            worker = self.workers[index]
            try:
                worker.send(["match", [[task.answer, task.truths, task.fast]], seconds])
                task.verdict = worker.receive(seconds + WORKER_HANG_S) == [True]
                healthy = True
            except Exception:  # _WORKER_ERRORS, or anything unforeseen: a feeder must not die with its worker
                healthy = False
            task.done.set()  # before a restart, which takes seconds
            if not healthy and not self.closed:
                logger.warning("a grading worker died or hung; its answer counted as wrong; starting another")
                self._replace(index)

    def _replace(self, index: int) -> None:
        self.workers[index].stop()
        delay = 1.0
        while not self.closed:
            try:
                self.workers[index] = _start_workers(1)[0]
            except _WORKER_ERRORS as error:
                logger.warning("could not start a grading worker (%s); retrying in %.0f s", error, delay)
                time.sleep(delay)
                delay = min(2 * delay, 60.0)
                continue
            if self.closed:  # shut down while it started
                self.workers[index].stop()
            return

    def close(self) -> None:
        self.closed = True
        for worker in self.workers:
            self.tasks.put(None)
            worker.stop()


class _BatchPool:
    """Workers for `grade_responses`; one batch at a time, chunks handed to whichever worker is free."""

    def __init__(self, size: int) -> None:
        self.workers = _start_workers(size)
        self.lock = threading.Lock()
        self.closed = False

    def match(self, chunks: list[list], results: list, deadline: float) -> None:
        """`results[i]` = the verdicts on `chunks[i]`, lists of [answer, truths, fast]; raises (leaving
        None) if a worker dies, hangs or garbles a reply, or the deadline passes."""
        with self.lock, selectors.DefaultSelector() as selector:
            try:
                self._match(selector, chunks, results, deadline)
            except BaseException:  # also Ctrl-C: a worker may still owe a reply, which the next batch would misread
                self.close()
                raise

    def _match(self, selector, chunks: list[list], results: list, deadline: float) -> None:
        for worker in self.workers:
            selector.register(worker.replies, selectors.EVENT_READ, worker)
        waiting, idle, busy = list(range(len(chunks)))[::-1], list(self.workers), {}
        while waiting or busy:
            while idle and waiting:
                worker, index = idle.pop(), waiting.pop()
                worker.send(["match", chunks[index], SYMBOLIC_TIME_LIMIT_S])
                busy[worker] = index
            remaining = deadline - time.monotonic()
            events = selector.select(remaining) if remaining > 0 else []
            if not events:
                raise TimeoutError("grading workers took too long")
            for key, _ in events:
                worker = key.data
                worker.read_available()
                while (reply := worker.next_reply()) is not _NO_REPLY:
                    index = busy.pop(worker)  # KeyError for a reply nobody asked for
                    if not (isinstance(reply, list) and len(reply) == len(chunks[index])):
                        raise ValueError("a grading worker sent a malformed reply")
                    results[index] = [verdict is True for verdict in reply]
                    idle.append(worker)

    def close(self) -> None:
        self.closed = True
        for worker in self.workers:
            worker.stop()


_symbolic_pool: _SymbolicPool | None = None
_batch_pool: _BatchPool | None = None
_symbolic_pool_lock = threading.Lock()  # two locks: a batch pool starting (seconds) must not hold up threads' calls
_batch_pool_lock = threading.Lock()
_left_by_the_parent = []  # in a forked child: the parent's pools, kept so that garbage collection never touches them


def _forget_pools_after_fork() -> None:
    # A forked child gets the pool objects but none of their threads, maybe our lock held,
    # and pipes to workers that are its parent's: it makes its own pools when it needs them.
    global _symbolic_pool, _batch_pool, _symbolic_pool_lock, _batch_pool_lock
    _left_by_the_parent.extend(pool for pool in (_symbolic_pool, _batch_pool) if pool is not None)
    _symbolic_pool, _batch_pool = None, None
    _symbolic_pool_lock, _batch_pool_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


_exiting = False  # set at exit: a daemon thread still grading then gets no new workers (its answers count as wrong)


def _close_pools() -> None:
    global _symbolic_pool, _batch_pool, _exiting
    _exiting = True
    for pool in (_symbolic_pool, _batch_pool):
        if pool is not None:
            pool.close()
    _symbolic_pool = _batch_pool = None


atexit.register(_close_pools)


def _get_symbolic_pool() -> _SymbolicPool:
    """Started on first use; returns once every worker has imported sympy and warmed up."""
    global _symbolic_pool
    if _symbolic_pool is not None:  # the common case, without the lock
        return _symbolic_pool
    with _symbolic_pool_lock:
        if _exiting:
            raise RuntimeError("the grading workers were stopped at exit")
        if _symbolic_pool is None:
            _symbolic_pool = _SymbolicPool(min(_available_cpus(), MAX_SYMBOLIC_WORKERS))
        return _symbolic_pool


def _symbolic_match_in_worker(answer: str, truths: list[str], fast: bool, started: float) -> bool:
    """`_bounded_symbolic_match` in a worker's main thread, where the alarm works; for callers where it does not.

    The caller waits at most SYMBOLIC_TIME_LIMIT_S + WORKER_OVERHEAD_S from `started` (its
    call's start), queueing for a free worker included; a later verdict counts as wrong. Only
    a call that had to wait for the workers to start counts from the moment they were ready.
    """
    pool = _get_symbolic_pool()
    deadline = max(started, pool.ready_at) + SYMBOLIC_TIME_LIMIT_S + WORKER_OVERHEAD_S
    return pool.match(answer, truths, fast, deadline)


# ---------------------------------------------------------------- batches


def _get_batch_pool(num_workers: int) -> _BatchPool:
    """One pool kept for the life of the process: starting workers (importing sympy) takes seconds."""
    global _batch_pool
    with _batch_pool_lock:
        if _exiting:
            raise RuntimeError("the grading workers were stopped at exit")
        if _batch_pool is None or _batch_pool.closed or len(_batch_pool.workers) != num_workers:
            _stop_batch_pool_locked()
            _batch_pool = _BatchPool(num_workers)
        return _batch_pool


def _stop_batch_pool_locked() -> None:
    global _batch_pool
    if _batch_pool is not None:
        _batch_pool.close()
    _batch_pool = None


def _stop_batch_pool() -> None:
    with _batch_pool_lock:
        _stop_batch_pool_locked()


def _grade_chunk(chunk: list[tuple]) -> list[dict[str, float]]:
    return [r1_zero_reward_fn(response, truth, fast) for response, truth, fast in chunk]


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def grade_responses(responses, ground_truths, fast: bool = True, num_workers: int | None = None) -> list[dict[str, float]]:
    """`r1_zero_reward_fn` over a batch, in order; worker processes for big batches.

    In batches of at least POOL_MIN_BATCH on a machine with more than one CPU, the string
    and number checks run here (nearly every GSM8K answer ends there, in microseconds) and
    the answers that need sympy go to a persistent pool of worker processes (default: one
    per available CPU, at most 8), started by the first batch that has such an answer.
    Smaller batches are graded serially. A broken or stuck pool falls back to serial
    grading of what is left. Never raises; if `ground_truths` is shorter than `responses`
    the missing truths grade as wrong (and a warning is logged).
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

    # String and number checks here (nearly every GSM8K answer ends there); only sympy's work goes to workers.
    rewards: list[dict | None] = [None] * len(items)
    questions = []  # (index, [answer, truths, fast])
    for index, (response, truth, fast) in enumerate(items):
        if not _is_formatted(response):
            rewards[index] = dict(UNFORMATTED)
            continue
        try:
            verdict = _verdict_without_sympy(response, truth)
            if not isinstance(verdict, bool):
                questions.append((index, [*verdict, bool(fast)]))
                continue
        except Exception:  # as in r1_zero_reward_fn: a bug on odd input costs one reward
            verdict = False
        rewards[index] = dict(CORRECT if verdict else FORMATTED_WRONG)
    if not questions:
        return rewards

    chunk_size = max(1, -(-len(questions) // (num_workers * 4)))
    chunks = [questions[start : start + chunk_size] for start in range(0, len(questions), chunk_size)]
    results: list[list[bool] | None] = [None] * len(chunks)
    try:
        pool = _get_batch_pool(num_workers)
        # Generous: every question at its full time limit spread over the workers, and a minute more.
        deadline = time.monotonic() + 60 + len(questions) * SYMBOLIC_TIME_LIMIT_S * 2 / num_workers
        pool.match([[question for _, question in chunk] for chunk in chunks], results, deadline)
    except Exception as error:  # a worker died or hung, a malformed reply, workers that would not start
        logger.warning("grading pool failed (%s); grading the rest serially", type(error).__name__)
        _stop_batch_pool()
    for chunk, verdicts in zip(chunks, results):
        for position, (index, _) in enumerate(chunk):
            if verdicts is None:
                rewards[index] = r1_zero_reward_fn(*items[index])
            else:
                rewards[index] = dict(CORRECT if verdicts[position] else FORMATTED_WRONG)
    return rewards
