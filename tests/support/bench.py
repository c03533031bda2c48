"""The benchmark scripts of ``bench/`` as modules, for tests of their pure parts."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from support.paths import ROOT

__all__ = ["load_bench"]


def load_bench(name: str) -> ModuleType:
    """``bench/{name}.py`` imported once as the module ``bench_{name}``."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
