"""Every mutant in ``tests/mutants.py`` still applies to the tree it is meant for.

A refactoring that reformats or moves the code a mutant edits would otherwise
only show up in ``make mutants``; this keeps it inside ``make test``.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from support.paths import ROOT


def _mutants_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "edgetrain_mutants", ROOT / "tests" / "mutants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


MUTANTS = _mutants_module().MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_replaces_text_that_occurs_exactly_once(mutant) -> None:
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.path}: {mutant.old!r}"
    assert mutant.new != mutant.old


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_names_test_files_that_exist(mutant) -> None:
    for node in mutant.tests:
        file, _, name = node.partition("::")
        source = (ROOT / file).read_text()
        if name:
            assert f"def {name.split('[')[0]}(" in source, node
