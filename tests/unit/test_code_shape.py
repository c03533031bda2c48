"""The shape rules of issue 32: no long parameter lists in the libraries, thin commands.

- No function under edge/ or coordinator/ takes more than :data:`MAX_PARAMETERS`
  parameters (``self``/``cls`` of a method not counted; ``*args`` and ``**kwargs`` one
  each): settings that travel together are one value (a frozen dataclass or a pydantic
  model), as :class:`coordinator.engine.options.RunOptions` is.
- No command function of edgetrain/cli/ is longer than :data:`MAX_COMMAND_LINES`
  lines, signature and docstring included: a command parses, calls the library and
  prints. Commands follow the ``*_command`` naming convention; every function
  registered with a typer ``command`` (decorated, or ``app.command(...)(f)``) is checked
  to be one of those measured, so none escapes the rule by its name. (A group's callback
  that runs as a command, ``edgetrain fleet``'s, follows the convention too; the root's
  ``--version`` callback is no command.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from support.paths import ROOT

MAX_PARAMETERS = 8
MAX_COMMAND_LINES = 100

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _trees(*packages: str) -> Iterator[tuple[Path, ast.Module]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _functions(tree: ast.Module) -> Iterator[tuple[Function, bool]]:
    """Every function of ``tree``, nested ones too, and whether it is a method (defined
    directly in a class body)."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_class = stack.pop()
        if isinstance(node, Function):
            yield node, in_class
        for child in ast.iter_child_nodes(node):
            stack.append((child, isinstance(node, ast.ClassDef)))


def parameter_count(fn: Function, method: bool) -> int:
    """How many parameters ``fn`` takes, as the rule counts them."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if method and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    starred = (args.vararg is not None) + (args.kwarg is not None)
    return len(positional) + len(args.kwonlyargs) + starred


def _long_parameter_lists() -> tuple[list[str], int]:
    offenders, seen = [], 0
    for path, tree in _trees("edge", "coordinator"):
        for fn, method in _functions(tree):
            seen += 1
            count = parameter_count(fn, method)
            if count > MAX_PARAMETERS:
                where = f"{path.relative_to(ROOT)}:{fn.lineno}"
                offenders.append(f"{where} {fn.name} takes {count} parameters")
    return sorted(offenders), seen


def test_no_library_function_takes_more_than_eight_parameters() -> None:
    offenders, seen = _long_parameter_lists()
    assert seen > 1000  # every function of both packages was read
    assert offenders == [], (
        f"more than {MAX_PARAMETERS} parameters: group those that travel together"
    )


def test_parameters_are_counted_as_the_rule_says() -> None:
    source = (
        "def f(a, /, b, *args, c, **kw): pass\n"
        "class K:\n"
        "    def m(self, a, b): pass\n"
        "    @classmethod\n"
        "    def c(cls, a): pass\n"
        "    @staticmethod\n"
        "    def s(a, b): pass\n"
    )
    counts = {fn.name: parameter_count(fn, method) for fn, method in _functions(ast.parse(source))}
    assert counts == {"f": 5, "m": 2, "c": 1, "s": 2}


def _registered(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """The functions ``tree`` registers as typer commands, with the line that does:
    ``@X.command(...)`` on a def, or ``X.command(...)(f)`` / ``X.command(...)(m.f)``."""
    for node in ast.walk(tree):
        if isinstance(node, Function):
            for deco in node.decorator_list:
                if _is_command_call(deco):
                    yield node.name, node.lineno
        elif isinstance(node, ast.Call) and _is_command_call(node.func) and node.args:
            target = node.args[0]
            if isinstance(target, ast.Name):
                yield target.id, node.lineno
            elif isinstance(target, ast.Attribute):
                yield target.attr, node.lineno


def _is_command_call(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "command"
    )


def _commands() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Every ``*_command`` function of edgetrain/cli/ (``file:line name``: its length in
    lines, from its ``def`` to its last line) and every registration (where, the
    function registered)."""
    lengths: dict[str, int] = {}
    registered: list[tuple[str, str]] = []
    for path, tree in _trees("edgetrain/cli"):
        rel = path.relative_to(ROOT)
        for fn, _ in _functions(tree):
            if fn.name.endswith("_command"):
                assert fn.end_lineno is not None
                lengths[f"{rel}:{fn.lineno} {fn.name}"] = fn.end_lineno - fn.lineno + 1
        registered += [(f"{rel}:{line}", name) for name, line in _registered(tree)]
    return lengths, registered


def test_every_registered_command_is_one_the_length_rule_measures() -> None:
    lengths, registered = _commands()
    assert len(registered) >= 20  # the root app's commands and every group's
    measured = {key.split()[-1] for key in lengths}
    strays = [f"{where} registers {name}" for where, name in registered if name not in measured]
    assert strays == [], "name a command function *_command, in edgetrain/cli/"


def test_no_command_is_longer_than_a_hundred_lines() -> None:
    lengths, _ = _commands()
    assert len(lengths) >= 20
    offenders = [f"{k} is {n} lines" for k, n in sorted(lengths.items()) if n > MAX_COMMAND_LINES]
    assert offenders == [], "a command parses, calls the library and prints"


def test_registrations_are_found_in_both_forms() -> None:
    source = (
        "@app.command('list')\n"
        "def list_command(): pass\n"
        "@app.callback()\n"
        "def _root(): pass\n"
        "app.command('demo')(demo_command)\n"
        "app.command('plan')(plan.plan_command)\n"
    )
    assert sorted(name for name, _ in _registered(ast.parse(source))) == [
        "demo_command",
        "list_command",
        "plan_command",
    ]
