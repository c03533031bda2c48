"""The bench scripts load each other by file: ``bench/`` is a folder of scripts, not a
package. :func:`sibling` imports ``bench/{name}.py`` once, as the module ``bench_{name}``,
the name the bench tests load it by (tests/support/bench.py), so a script and its tests
share one module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["sibling"]


def sibling(name: str) -> ModuleType:
    """``bench/{name}.py`` as the module ``bench_{name}`` (imported on the first call)."""
    module_name = f"bench_{name}"
    if module_name not in sys.modules:
        path = Path(__file__).resolve().parent / f"{name}.py"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[module_name]
