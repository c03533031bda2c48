"""Device-side subcommands of ``edgetrain``, one module per command group."""

__all__ = ["agent", "devices", "models", "profile"]
