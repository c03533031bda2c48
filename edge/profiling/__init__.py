"""What a device is: measured on the spot, or read from the catalogue.

- :mod:`edge.profiling.device`: self-profiling (compute, memory, CPU share, link);
- :mod:`edge.profiling.matmul`: sustained matmul rates of the CPU and GPUs;
- :mod:`edge.profiling.catalog`: ``device_profiles/*.yaml`` and measured device files.
"""

__all__: list[str] = []
