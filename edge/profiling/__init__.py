"""What a device is: measured on the spot, or read from the catalogue.

- :mod:`edge.profiling.device`: self-profiling (compute, memory, CPU share, link);
- :mod:`edge.profiling.matmul`: sustained matmul rates of the CPU and GPUs;
- :mod:`edge.profiling.fixed_costs`: a device's fixed costs per microbatch, step and frame;
- :mod:`edge.profiling.catalog`: ``device_profiles/*.yaml`` and measured device files;
- :mod:`edge.profiling.announcement`: what an agent announces of its device (measured,
  emulated or given) and the link its frames are shaped to.
"""

__all__: list[str] = []
