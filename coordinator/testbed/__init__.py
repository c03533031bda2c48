"""The emulation testbed: one machine made to behave like a fleet of catalogue devices.

:mod:`coordinator.testbed.sizing` maps devices onto this machine (CPU shares,
memory, links); the rest of the package enforces those limits (cgroups, network
namespaces, ``tc``, a delay proxy, or the software throttle), keeps the state
that ``testbed down`` needs, and writes docker-compose files:

- :mod:`~coordinator.testbed.testbed`: ``Testbed.up`` / ``status`` / ``down``, the API;
- :mod:`~coordinator.testbed.limits`: which method applies here; cgroups;
- :mod:`~coordinator.testbed.netns`: namespaces, veth pairs, ``tc tbf``;
- :mod:`~coordinator.testbed.proxy`: the delay proxy (its own process);
- :mod:`~coordinator.testbed.procs`: starting and awaiting the testbed's processes;
- :mod:`~coordinator.testbed.state`: the state directory and process identity;
- :mod:`~coordinator.testbed.teardown`: what works from the state alone (status, down);
- :mod:`~coordinator.testbed.actuator`: faults (kill, slow, join) done to its agents;
- :mod:`~coordinator.testbed.compose`: docker-compose files.

Submodules are imported by name; importing the package imports nothing heavy.
"""

__all__: list[str] = []
