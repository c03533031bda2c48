"""The coordinator: plans jobs over a fleet, drives them, and serves it all over HTTP.

- :mod:`coordinator.planner`: which devices run which units (the planning spec);
- :mod:`coordinator.engine`: the one job engine (no FastAPI);
- :mod:`coordinator.service`: the FastAPI service, its store and dashboard;
- :mod:`coordinator.local`: a broker and a fleet of agents on this machine;
- :mod:`coordinator.testbed`: emulated fleets (cgroups, namespaces, compose files).

It imports :mod:`edge` (the wire contract, models, the planning-problem types),
never :mod:`edgetrain`; :mod:`edge` never imports it. Importing this package
imports nothing heavy, so command registration stays cheap on an agent-only
install.
"""

__all__: list[str] = []
