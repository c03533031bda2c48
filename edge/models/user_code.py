"""User code: which ``package.module:function`` names a process may import, and importing them.

[Note: user code on devices]
A model or a dataset is a zoo name or a user's ``package.module:function``; the
latter is imported and called, which runs whatever its module runs. A device daemon
that imported what an assignment named would run anything that anyone able to
publish on its ``cmd`` topic sent it (``os:system`` with ``{"command": ...}``).
So every import of a user name (:func:`edge.models.zoo.get_model` for models,
:func:`edge.models.datasets.build_dataset` for datasets) goes through
:func:`import_reference`, which asks :func:`check_allowed` first and refuses,
before importing anything, a module outside the :class:`CodeAllowance` it is given.

An agent (:mod:`edge.agent`) imports only the zoo unless its owner allows module
prefixes (``edgetrain agent --allow-code PREFIX``); the processes that a user starts
for their own job (``edgetrain train`` in-process, the server tier's ranks, the
coordinator's planning) import the user's code with :data:`ANY_CODE`, the default.

A prefix matches a module path at dot boundaries: ``mypkg`` allows ``mypkg`` and
``mypkg.models``, not ``mypkgevil``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from edge.errors import UserError

__all__ = [
    "ANY_CODE",
    "USER_NAME",
    "ZOO_ONLY",
    "CodeAllowance",
    "CodeNotAllowed",
    "allow_prefixes",
    "check_allowed",
    "import_reference",
    "user_modules",
]

_MODULE = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
USER_NAME = re.compile(rf"({_MODULE}):([A-Za-z_]\w*)")
"""A user name: ``package.module:function`` (group 1 the module, group 2 the function)."""


class CodeNotAllowed(UserError):
    """A user name whose module this process is not allowed to import."""


@dataclass(frozen=True)
class CodeAllowance:
    """The user modules a process may import: any (``prefixes`` is ``None``) or only
    those under one of ``prefixes`` (none: zoo models and built-in datasets only)."""

    prefixes: tuple[str, ...] | None

    def allows(self, module: str) -> bool:
        """Whether ``module`` (a dotted path) is under an allowed prefix."""
        if self.prefixes is None:
            return True
        return any(module == p or module.startswith(p + ".") for p in self.prefixes)

    def describe(self) -> str:
        """One phrase for logs: what this allowance lets in."""
        if self.prefixes is None:
            return "any user code"
        if not self.prefixes:
            return "zoo models and built-in datasets only"
        return "the zoo and user code under " + ", ".join(self.prefixes)


ANY_CODE = CodeAllowance(None)
"""The user's own process: import what the job names."""
ZOO_ONLY = CodeAllowance(())
"""A device daemon whose owner allowed no user code."""


def allow_prefixes(prefixes: Iterable[str]) -> CodeAllowance:
    """The allowance of ``--allow-code`` prefixes; an empty, wildcard or malformed
    prefix is refused with a one-line :class:`UserError`."""
    kept: list[str] = []
    for raw in prefixes:
        prefix = raw.strip()
        if not re.fullmatch(_MODULE, prefix):
            why = "empty" if not prefix else "a wildcard" if "*" in prefix else "not a module path"
            raise UserError(
                f"--allow-code: {raw!r} is {why}; give a module prefix such as mypkg or "
                "mypkg.models (zoo models and built-in datasets need none)"
            )
        if prefix not in kept:
            kept.append(prefix)
    return CodeAllowance(tuple(kept))


def user_modules(*names: str | None) -> list[str]:
    """The modules of those ``names`` that are user names (zoo names and ``None`` skipped),
    in order and without repeats: what an agent must allow to run them."""
    out: list[str] = []
    for name in names:
        match = USER_NAME.fullmatch(name or "")
        if match and match.group(1) not in out:
            out.append(match.group(1))
    return out


def check_allowed(ref: str, what: str, allow: CodeAllowance) -> None:
    """Refuse the user name ``ref`` (a ``what``: model or dataset) unless ``allow`` lets
    its module in; raises :class:`CodeNotAllowed` naming it and how to allow it."""
    if not isinstance(allow, CodeAllowance):  # e.g. an option of that name from a job
        raise TypeError(f"allow_code must be a CodeAllowance, not {type(allow).__name__}")
    module = ref.partition(":")[0]
    if allow.allows(module):
        return
    raise CodeNotAllowed(
        f"{what} {ref!r}: module {module!r} is not allowed here (this agent runs "
        f"{allow.describe()}); its owner may allow it with --allow-code {module}"
    )


def import_reference(ref: str, what: str, allow: CodeAllowance = ANY_CODE) -> Any:
    """The attribute that ``ref`` (``package.module:attribute``, a ``what``) names, its
    module imported only if ``allow`` lets it in: see [Note: user code on devices].

    Raises a one-line :class:`UserError` for a malformed name, a refused module, a
    module that cannot be imported or that fails while importing, a missing attribute.
    """
    match = USER_NAME.fullmatch(ref)
    if match is None:
        raise UserError(f"{what} {ref!r}: expected the form 'package.module:function'")
    check_allowed(ref, what, allow)
    module_name, attr = match.groups()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{what} {ref!r}: cannot import module {module_name!r} ({exc})") from None
    except Exception as exc:
        one_line = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        raise UserError(f"{what} {ref!r}: importing {module_name!r}: {one_line}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(
            f"{what} {ref!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None
