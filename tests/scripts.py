"""Load a script of ``benchmarks/`` or ``scripts/`` as a module, to test its own logic.

Scripts are not a library: they import the package, never each other, and nothing edits
``sys.path`` to reach them. A test that checks a script's own functions loads it from its file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """The script at ``relpath`` (from the repository root), loaded once per test session under
    its file's stem, its ``__main__`` block not run."""
    path = ROOT / relpath
    name = f"_script_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
