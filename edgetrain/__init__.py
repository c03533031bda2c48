"""edgetrain: train one DNN across a fleet of devices too small to train it alone.

The distribution holds three import packages: :mod:`edge` (everything a device
runs), :mod:`coordinator` (the planner, the job engine and the service) and
this one, which only carries every command (:mod:`edgetrain.cli`), the one
place that joins the two, and the version (the package metadata's, read once
in :mod:`edge`).
"""

from edge import __version__

__all__ = ["__version__"]
