"""One exception for mistakes a user can fix, one for a run stopped on request, and the CLI wrapper.

Every entry point (`python -m alignment.train_rl`, `train_sft`, `evaluate`, `data`,
`demo`) runs through `run_cli`, so bad flags, missing files and malformed rows end
as one line on stderr and exit code 2, never as a traceback from inside a library;
a run stopped by SIGINT, SIGTERM or SIGHUP ends with the line that says how to resume it and
the shell's exit code for that signal (130, 143, 129).
"""

import gc
import sys

from alignment import resume_collector


class UserError(Exception):
    """A problem with the user's input (flag, file, row) that they can fix.

    The message is a whole sentence that names the flag, file or row and says what
    to do about it.
    """


class RunStopped(Exception):
    """A run that stopped cleanly on a signal: `message` says what was saved and how to go on."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def run_cli(main, argv=None) -> int:
    """Call `main(argv)`; turn a `UserError` into `error: ...` on stderr and exit 2."""
    froze = resume_collector()  # `python -m alignment.<tool>`: the tool's imports are done
    try:
        main(argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except RunStopped as stopped:
        print(stopped, file=sys.stderr)
        sys.exit(stopped.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a training loop
        print("interrupted (Ctrl-C); the last saved checkpoint or training state is intact", file=sys.stderr)
        sys.exit(130)
    finally:
        if froze:
            gc.unfreeze()
    return 0
