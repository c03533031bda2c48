"""The coordinator service: FastAPI over the engine, with a store and a live fleet view.

- :mod:`coordinator.service.settings`: every coordinator option, from the environment;
- :mod:`coordinator.service.app`: the FastAPI application and its lifespan;
- :mod:`coordinator.service.api`: routes (devices, plans, jobs, system) and dependencies;
- :mod:`coordinator.service.manager`: accepts jobs and drives them through the engine;
- :mod:`coordinator.service.registry`: the fleet as seen from the broker;
- :mod:`coordinator.service.store`: SQLite persistence (schema and queries);
- :mod:`coordinator.service.events`: the in-process publish/subscribe bus;
- :mod:`coordinator.service.export`: ONNX export of trained weights (the ``export`` extra);
- :mod:`coordinator.service.serve`: uvicorn, in the foreground or a background thread;
- :mod:`coordinator.service.dashboard`: the static dashboard.

Importing this package imports neither FastAPI nor the database.
"""

__all__: list[str] = []
