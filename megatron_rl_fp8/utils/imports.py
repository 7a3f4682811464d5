"""Optional packages, probed without importing them."""

from __future__ import annotations

import importlib.util


def module_exists(name: str) -> bool:
    """Whether ``name`` is importable here (found on the path; nothing is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
