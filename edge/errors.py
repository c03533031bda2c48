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
:class:`UserError` naming the install that has it instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import ValidationError

__all__ = ["INSTALL_HINT", "UserError", "describe_validation_error", "needs_coordinator_extras"]

INSTALL_HINT = "pip install 'edgetrain[coordinator]'"


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


@contextmanager
def needs_coordinator_extras(what: str) -> Iterator[None]:
    """Imports in this block that fail for a missing module end as one line about ``what``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = exc.name or str(exc)
        raise UserError(
            f"{what} needs the coordinator extras (no module {missing!r} here): {INSTALL_HINT}"
        ) from None
