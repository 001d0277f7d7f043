"""One exception for mistakes a user can fix, and the CLI wrapper that prints it.

Every entry point (`python -m alignment.train_rl`, `train_sft`, `evaluate`, `data`,
`demo`) runs through `run_cli`, so bad flags, missing files and malformed rows end
as one line on stderr and exit code 2, never as a traceback from inside a library.
"""

import sys


class UserError(Exception):
    """A problem with the user's input (flag, file, row) that they can fix.

    The message is a whole sentence that names the flag, file or row and says what
    to do about it.
    """


def run_cli(main, argv=None) -> int:
    """Call `main(argv)`; turn a `UserError` into `error: ...` on stderr and exit 2."""
    try:
        main(argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    return 0
