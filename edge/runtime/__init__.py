"""A stage's work: schedules as data, the data each step reads, and the stage runtime.

- :mod:`edge.runtime.schedules`: 1F1B and GPipe as per-stage action lists;
"""

__all__: list[str] = []
