"""The job engine, with no FastAPI: plan -> assign -> run -> watch -> replicate -> recover/migrate.

- :mod:`coordinator.engine.engine`: :class:`JobEngine`, the one driver of jobs over agents;
- :mod:`coordinator.engine.spec`: a job's spec: what to train and how, and where its data lives;
- :mod:`coordinator.engine.assignments`: a spec and its plan made one stage assignment per device;
- :mod:`coordinator.engine.monitor`: a job's stages' events folded into its result, or its failure;
- :mod:`coordinator.engine.options`: what a run is told: run options, fault tolerance, hooks;
- :mod:`coordinator.engine.runners`: where stages run (agents, in-process threads);
- :mod:`coordinator.engine.resilient`: the attempts loop that survives deaths and migrates;
- :mod:`coordinator.engine.handover`: a group member dies: its survivors hand over a step's state;
- :mod:`coordinator.engine.replicas`: the coordinator's copy of every stage's state;
- :mod:`coordinator.engine.rebalance`: when measured times call for a new plan;
- :mod:`coordinator.engine.faults`: injected faults and the actuator that does them;
- :mod:`coordinator.engine.unit_profiles`: each device's own unit seconds, timed by its agent;
- :mod:`coordinator.engine.egress`: what leaves each device in a plan, and to whom;
- :mod:`coordinator.engine.watch`: the one subscription to devices' status and heartbeats.
"""

__all__: list[str] = []
