"""A stage's work: schedules as data, the data each step reads, and the stage runtime.

- :mod:`edge.runtime.stage`: one pipeline stage (segment, optimizer, schedule, replicas);
- :mod:`edge.runtime.keeper`: the stages one device runs or holds, restore, neighbour
  replicas, hold and hand-over (the agent's);
- :mod:`edge.runtime.group_sum`: a stage group's once-a-step sum of its gradients;
- :mod:`edge.runtime.outer_sync`: DiLoCo in a group (non-exact): its own steps, and a sum
  every few;
- :mod:`edge.runtime.schedules`: 1F1B, GPipe and ZB-H1 as per-stage action lists;
- :mod:`edge.runtime.split_backward`: a backward split into the input's gradient and the
  weights' (zero-bubble schedules);
- :mod:`edge.runtime.step_clock`: a step's waits and sends, in totals and as a timeline;
- :mod:`edge.runtime.links`: the frames a stage's plan lets it receive, and its rows;
- :mod:`edge.runtime.data`: the seeded, epoch-wise sampler stage 0 reads;
- :mod:`edge.runtime.checkpoint`: a stage's state as safetensors, and restoring it;
- :mod:`edge.runtime.unit_times`: per-unit seconds measured from a real training step;
- :mod:`edge.runtime.time_units`: a device's answer to a ``time-units`` request;
- :mod:`edge.runtime.allocator`: glibc's allocator tuned for training loops.
"""

__all__: list[str] = []
