"""Persistence in one SQLite file.

- :mod:`coordinator.service.store.schema`: tables, the job state machine, records;
- :mod:`coordinator.service.store.sqlite`: the :class:`Store` that reads and writes them.
"""

__all__: list[str] = []
