"""Coordinator-side subcommands of ``edgetrain``; importing them never imports FastAPI."""

__all__ = ["coordinator", "plan", "train"]
