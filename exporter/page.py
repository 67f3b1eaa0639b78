"""The built-in status page at `/` (filled in by the status-page work)."""

from __future__ import annotations

from typing import Any


def install_page(app: Any, store: Any, settings: Any) -> None:
    """Register the page's routes on the app."""
