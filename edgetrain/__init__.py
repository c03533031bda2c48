"""edgetrain: train one DNN across a fleet of devices too small to train it alone.

The distribution holds three import packages: :mod:`edge` (everything a device
runs), :mod:`coordinator` (the service and the planner) and this one, which only
carries the version and the ``edgetrain`` command that joins the two.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
