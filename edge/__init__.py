"""Everything a worker runs, on an edge box or a GPU server.

The device side: every setting a job trains with, validated once
(:mod:`edge.config`), the model zoo and layer-cost profiling (:mod:`edge.models`),
device self-profiling (:mod:`edge.profiling.device`), the device-profile catalogue
loader (:mod:`edge.profiling.catalog`), the planning-problem types shared with the
coordinator (:mod:`edge.problem`), and the command-line commands a device needs
(:mod:`edgetrain.cli`). Nothing here imports :mod:`coordinator` or :mod:`edgetrain`;
``__version__`` is the installed distribution's, read from its package metadata.
"""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("edgetrain")
except PackageNotFoundError:  # sources on the path that were never installed
    __version__ = "0+unknown"
