"""Ctrl-C, SIGTERM and SIGHUP during training: finish the step, save, say how to resume, exit 130 / 143 / 129.

Cluster schedulers send SIGTERM before they kill a job; a person sends SIGINT; a dropped
ssh session sends SIGHUP (its terminal is gone then, so from that signal on a failed write
to stdout or stderr is dropped instead of ending the run). Each one only sets a flag: the
training loop finishes the step it is in (a step stopped half-way would leave the weights
and the counters disagreeing), saves a training
state when --save_state_every is on, and ends with the exact command that resumes.
A second Ctrl-C stops at once (KeyboardInterrupt; the last saved state is intact).
"""

import shlex
import signal
import sys
import threading


class _DeadTerminalStream:
    """A text stream whose writes never raise: after SIGHUP the terminal may be gone (EIO, EPIPE)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


class StopOnSignal:
    """Installs SIGINT/SIGTERM/SIGHUP handlers for the life of a `with` block (main thread only)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

    def __init__(self, say=print):
        self.received = None
        self.say = say
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == getattr(signal, "SIGHUP", None) and not isinstance(sys.stdout, _DeadTerminalStream):
            sys.stdout, sys.stderr = _DeadTerminalStream(sys.stdout), _DeadTerminalStream(sys.stderr)
        self.received = signum
        self.say(f"\n{signal.Signals(signum).name} received: finishing this step, then stopping (Ctrl-C again to stop at once)", flush=True)

    @property
    def exit_code(self) -> int:
        """The shell's code for the signal received (under torchrun another rank may have got it: SIGTERM's)."""
        return 128 + int(self.received or signal.SIGTERM)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal to another rank"


def resume_command(argv: list[str] | None, module: str = "alignment.train_rl") -> str:
    """The command line that continues this run: the same flags plus --resume."""
    flags = list(sys.argv[1:] if argv is None else argv)
    if "--resume" not in flags:
        flags.append("--resume")
    return shlex.join(["python", "-m", module, *flags])
