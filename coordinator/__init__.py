"""The coordinator: the planner now, the FastAPI service and job orchestration later.

It may import :mod:`edge` (the wire contract, models, the planning-problem
types); :mod:`edge` never imports it. Importing this package must not import
FastAPI, so that command registration stays cheap on an agent-only install.
"""

__all__: list[str] = []
