"""Everything a worker runs, on an edge box or a GPU server.

The device side: the model zoo and layer-cost profiling (:mod:`edge.models`),
device self-profiling (:mod:`edge.profiler`), the device-profile catalogue
loader (:mod:`edge.catalog`), the planning-problem types shared with the
coordinator (:mod:`edge.problem`), and the command-line commands a device needs
(:mod:`edge.commands`). Nothing here imports :mod:`coordinator`.
"""

__all__: list[str] = []
