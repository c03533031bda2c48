"""User-facing errors: one clear line that names what is wrong.

Every command-line entry point catches :class:`UserError` and prints its message
on one line to standard error with the exit status it carries (2 for bad input,
by the convention of ``shared/spec/planning.md``). Validation errors from
pydantic are folded into that one line by :func:`describe_validation_error`.

A device installs ``edgetrain`` without extras (no FastAPI, SQLAlchemy, uvicorn,
httpx, pydantic-settings or amqtt: ``[project.optional-dependencies]
coordinator`` in pyproject.toml). Every command must still start there, so the
modules that need those packages are imported inside the commands that use them,
under :func:`needs_coordinator_extras`, which turns the missing module into a
:class:`MissingExtraError` naming the install that has it instead of a traceback.
ONNX export has its own extra (``export``: onnx and onnxruntime), imported the
same way under :func:`needs_extra`.

Tested in tests/integration/test_devices_cli.py (a pydantic error as one line naming the
field) and tests/integration/test_command_imports.py (a missing extra names its
install).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from pydantic import ValidationError

__all__ = [
    "MissingExtraError",
    "UserError",
    "describe_validation_error",
    "needs_coordinator_extras",
    "needs_extra",
]


class UserError(Exception):
    """Bad input from the user: a file, a flag or a name that cannot be used."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """Fold a pydantic error into one line: ``source: field.path: what is wrong``.

    Only the first error is named; a user fixes one field at a time and the
    message stays a single line. The count of further errors is appended.
    """
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = _location(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not first.get("loc"):
        # A cross-field check names its own field at the start of its message.
        return f"{source}: {msg}".replace("\n", " ")
    got = first.get("input")
    shown = ""
    if first.get("type") not in ("missing",) and not isinstance(got, dict | list):
        shown = f" (got {got!r})"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {loc}: {msg}{shown}{more}".replace("\n", " ")


class MissingExtraError(UserError):
    """A feature whose packages come with an extra that is not installed here."""


@contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Imports in this block that fail for a missing module end as one line about ``what``:
    ``{what} needs the {extra} extras (no module 'x' here): pip install 'edgetrain[{extra}]'``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = exc.name or str(exc)
        raise MissingExtraError(
            f"{what} needs the {extra} extras (no module {missing!r} here): "
            f"pip install 'edgetrain[{extra}]'"
        ) from None


def needs_coordinator_extras(what: str) -> AbstractContextManager[None]:
    """:func:`needs_extra` for the ``coordinator`` extra."""
    return needs_extra("coordinator", what)
