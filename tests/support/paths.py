"""Where the checkout is, for tests at any depth under tests/."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ROOT"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the folder holding pyproject.toml)."""
