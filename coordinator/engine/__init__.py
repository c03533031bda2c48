"""The job engine, with no FastAPI: plan -> assign -> run -> watch -> replicate -> recover/migrate.

- :mod:`coordinator.engine.spec`: a job's spec, its stage assignments and results;
- :mod:`coordinator.engine.runners`: where stages run (agents, in-process, ranks);
- :mod:`coordinator.engine.resilient`: the loop that survives deaths and migrates;
- :mod:`coordinator.engine.replicas`: the coordinator's copy of every stage's state;
- :mod:`coordinator.engine.rebalance`: when measured times call for a new plan;
- :mod:`coordinator.engine.faults`: injected faults and the actuator protocol.
"""

__all__: list[str] = []
