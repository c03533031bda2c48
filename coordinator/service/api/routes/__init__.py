"""One module of routes per resource."""

__all__ = ["devices", "jobs", "plans", "system"]
