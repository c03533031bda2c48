"""The dashboard: static HTML, CSS and JavaScript served by the coordinator at ``/``.

No build step and no CDN: ``static/index.html`` loads ``static/app.css`` and
``static/app.js``, which read the REST API under ``/api/v1`` and follow
``/api/v1/events`` (Server-Sent Events) for live updates. :data:`STATIC_DIR`
is where the files are, for :class:`fastapi.staticfiles.StaticFiles`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["INDEX_HTML", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
"""The directory of the dashboard's files."""

INDEX_HTML = STATIC_DIR / "index.html"
"""The page served at ``/``."""
