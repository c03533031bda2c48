"""The coordinator's optional dependencies: what a device install lacks, said in one line.

A device installs ``edgetrain`` without extras (no FastAPI, SQLAlchemy, uvicorn,
httpx, pydantic-settings, amqtt or ONNX: ``[project.optional-dependencies]
coordinator`` in pyproject.toml). Every command must still start there, so the
modules that need those packages are imported inside the commands that use them,
under :func:`needs_coordinator_extras`, which turns the missing module into a
:class:`~edge.errors.UserError` naming the install that has it instead of a
traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from edge.errors import UserError

__all__ = ["INSTALL_HINT", "needs_coordinator_extras"]

INSTALL_HINT = "pip install 'edgetrain[coordinator]'"


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
