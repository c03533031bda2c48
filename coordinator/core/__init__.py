"""The coordinator service's core: its settings, read once from the environment.

:class:`~coordinator.core.config.Settings` is the one place a coordinator
option is defined; the command line and the API read it, nothing else reads
``EDGETRAIN_*`` variables. Importing this package imports neither FastAPI nor
the database.
"""

from coordinator.core.config import Environment, Settings, get_settings

__all__ = ["Environment", "Settings", "get_settings"]
