"""A grading worker process for `alignment/drgrpo_grader.py`: `python -m alignment.grader_worker`.

The grader starts these itself; never run one by hand. They replace multiprocessing's spawn
workers, which re-run the caller's main script in every worker: a script without a
`__name__` guard printed its result once per worker, and code fed on stdin
(`python - <<EOF`) made the workers fail and respawn without end. This module is the whole
program of a worker, so no caller's code is ever imported here.

A worker does only the symbolic part of grading (the string and number checks stay in the
caller). Protocol, one JSON value per line (`json.dumps` escapes newlines inside strings):

- the worker writes `"ready"` once sympy is imported and warmed up;
- the grader sends `["match", [[answer, truths, fast], ...], seconds]`; the worker replies
  `[true/false, ...]`, each `_bounded_symbolic_match` under an alarm of `seconds` in this
  process's main thread (a timeout or an error is `false`).

JSON, not pickle: what a worker sends back can only be plain values. A worker exits when
its stdin closes (the grader stopped it, or the grader's process ended).
"""

import signal

# First, before the slow imports: Ctrl-C reaches the whole process group, and the grader's
# process decides what happens; a worker would only print a KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from alignment import drgrpo_grader, resume_collector  # noqa: E402


def verdict(answer: str, truths: list[str], fast: bool, seconds: float) -> bool:
    try:
        return drgrpo_grader._bounded_symbolic_match(answer, truths, fast, seconds) is True
    except (Exception, drgrpo_grader._GradingTimeout):  # counted as wrong, as in the grader itself
        return False


def reply(stream, value) -> None:
    stream.write(json.dumps(value).encode("ascii") + b"\n")
    stream.flush()


def main() -> None:
    resume_collector()  # grading sympy expressions makes reference cycles; sympy's own objects stay frozen
    # Replies go to a private copy of stdout; fd 1 itself now points at stderr, so a stray
    # print() in a library lands in the log instead of corrupting a reply.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    drgrpo_grader._warm_up()
    try:
        reply(replies, "ready")
        for line in sys.stdin.buffer:
            try:
                kind, questions, seconds = json.loads(line)
                answer = [verdict(*question, seconds) for question in questions] if kind == "match" else None
            except (ValueError, TypeError):  # not our protocol; the grader counts a None reply as all wrong
                answer = None
            reply(replies, answer)
    except OSError:  # the grader is gone
        return


if __name__ == "__main__":
    main()
