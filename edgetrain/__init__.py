"""edgetrain: train one DNN across a fleet of devices too small to train it alone.

The distribution holds three import packages: :mod:`edge` (everything a device
runs), :mod:`coordinator` (the service and the planner) and this one, which only
carries the ``edgetrain`` command that joins the two, and the version (the
package metadata's, read once in :mod:`edge`).
"""

from edge import __version__

__all__ = ["__version__"]
