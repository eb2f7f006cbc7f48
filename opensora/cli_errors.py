"""How every command-line entry point reports bad input: one line on stderr, exit code 2, no traceback.

Scripts run their ``main`` through ``run_cli(main, argv, prog)``. A ``UserInputError`` (or a missing file, a config
key typo, a ``SystemExit("message")``) becomes ``{prog}: error: {message}`` and exit code 2, the same code argparse
uses for a bad flag. Anything else is a bug and keeps its traceback. ``--debug`` anywhere on the command line is taken
out before ``main`` sees it and keeps the traceback of user errors too.

Library code raises ``UserInputError`` (a ``ValueError``, so callers that catch ``ValueError`` still work) when the
cause is something the user typed or pointed at, and says in the message what to do about it.
"""

import sys
from typing import Callable, Optional, Sequence, Tuple, Type

EXIT_USAGE = 2
DEBUG_FLAG = "--debug"


class UserInputError(ValueError):
    """Bad input from the user (a flag, a file, a dataset, a checkpoint); the message says what to do."""


# Errors whose message names the problem well enough on its own: the path the user gave does not fit.
_FILE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)


def check_range(name: str, value, low=None, high=None, *, allow_none: bool = False, integer: bool = False):
    """``value`` of flag ``name`` if it is a number in ``[low, high]`` (None allowed with ``allow_none``), else a
    ``UserInputError`` naming the flag, the value and the allowed range."""
    if value is None and allow_none:
        return None
    flag = "--" + name.replace("_", "-")
    bounds = (
        f"{'' if low is None else f'>= {low}'}{' and ' if low is not None and high is not None else ''}"
        f"{'' if high is None else f'<= {high}'}"
    )
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or value != value:  # value != value: NaN
        raise UserInputError(f"{flag} must be {kind}{' ' + bounds if bounds else ''}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise UserInputError(f"{flag} must be {bounds}, got {value!r}")
    return value


def _user_error_types(extra: Tuple[Type[BaseException], ...]) -> Tuple[Type[BaseException], ...]:
    types = (UserInputError,) + _FILE_ERRORS + tuple(extra)
    config = sys.modules.get("opensora.config")  # only when loaded: the converter never imports mmengine
    if config is not None:
        types += (config.ConfigKeyError, config.ConfigValueError)
    return types


def _message(error: BaseException) -> str:
    if isinstance(error, KeyError) and error.args:  # str(KeyError) would quote the message
        return str(error.args[0])
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.strerror}: {error.filename}"
    return str(error)


def report(prog: str, message: str) -> int:
    message = " ".join(str(message).split("\n")).strip()
    prefix = f"{prog}: error: "
    print(message if message.startswith(prefix) else prefix + message, file=sys.stderr)
    return EXIT_USAGE


def run_cli(
    main: Callable, argv: Optional[Sequence[str]], prog: str, also: Tuple[Type[BaseException], ...] = ()
) -> int:
    """Call ``main(argv)`` and turn user errors into one line + exit code 2 (returned; scripts ``sys.exit`` it).

    ``also``: more exception types this entry point treats as user errors (the converter's key-layout errors).
    Returns ``main``'s int result, or 0 when it returns anything else.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    try:
        result = main(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str) and not debug:  # SystemExit("message"): a refusal, not a crash
            return report(prog, stop.code)
        raise
    except _user_error_types(also) as error:
        if debug:
            raise
        return report(prog, _message(error))
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
