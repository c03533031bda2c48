"""The device-profile catalogue: one YAML file per real device, with a source for each figure.

Each ``<id>.yaml`` here describes one device that edgetrain can plan for (compute,
memory, link, power) and where every figure comes from. The files ship as
package data; :mod:`edge.profiling.catalog` owns their schema, validates them and resolves
names such as ``rpi4-4gb``. ``edgetrain devices list`` shows the catalogue.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CATALOGUE_DIR"]

CATALOGUE_DIR: Path = Path(__file__).resolve().parent
"""The folder holding the ``*.yaml`` profiles."""
