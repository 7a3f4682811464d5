"""Optional packages, probed without importing them; objects a config names by their import
path (``package.module:attr``), imported with one-line errors."""

from __future__ import annotations

import importlib
import importlib.util
import re


def module_exists(name: str) -> bool:
    """Whether ``name`` is importable here (found on the path; nothing is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


OBJECT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""``package.module:attr`` (the attribute may be dotted: ``module:Class.method``)."""


def import_object(value: str, setting: str, *, what: str = "object") -> object:
    """The object ``value`` names as ``package.module:attr``, for the config setting ``setting``
    (``reward.function``, ``rollout.engine``). Every failure is one ``ValueError`` line that
    starts ``<setting>=<value!r>``, says what went wrong and how to fix it."""

    def fail(problem: str, fix: str) -> ValueError:
        return ValueError(f"{setting}={value!r} {problem}; {fix}".replace("\n", " "))

    if not isinstance(value, str) or not OBJECT_PATH.fullmatch(value):
        raise fail(
            f"is not of the form 'package.module:{what}'",
            f"write the module path, a colon, then the {what}'s name",
        )
    module_name, attr_path = value.split(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise fail(
            f"cannot be loaded: importing {module_name!r} failed ({type(e).__name__}: {e})",
            "install the package or put its folder on PYTHONPATH, and check the module path",
        ) from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise fail(
                f"cannot be loaded: {getattr(obj, '__name__', module_name)!r} has no attribute "
                f"{part!r}",
                f"check the {what}'s name after the colon",
            )
        obj = getattr(obj, part)
    return obj
