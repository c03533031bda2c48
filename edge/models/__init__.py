"""The model zoo as ordered units, the offline datasets, and unit-cost profiling.

- :mod:`edge.models.zoo`: model specs whose segments build only their own units;
- :mod:`edge.models.units`: the building blocks (one tensor in, one out);
- :mod:`edge.models.flatten`: user models, imported and flattened with torch.fx;
- :mod:`edge.models.datasets`: datasets that exist offline;
- :mod:`edge.models.user_code`: which user ``module:function`` names may be imported;
- :mod:`edge.models.unit_costs`: per-unit FLOPs, bytes and times for the planner.
"""

from edge.models.zoo import ModelSpec, Segment, get_model, list_models

__all__ = ["ModelSpec", "Segment", "get_model", "list_models"]
