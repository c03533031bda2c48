"""The REST API under ``/api/v1``: routes per resource, dependencies in :mod:`.deps`."""

__all__: list[str] = []
