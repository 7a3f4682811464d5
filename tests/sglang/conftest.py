"""SGLang tests need a Python with SGLang: ``MRF8_SGLANG_PYTHON`` or the venv made by
``scripts/install_sglang_cpu.sh`` (.venv-sglang). Without one they are skipped, not failed; they are
also deselected by default (marker ``sglang``): run them with ``make test-sglang``."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sglang_python() -> str | None:
    path = os.environ.get("MRF8_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    return path if Path(path).exists() else None


@pytest.fixture(scope="session")
def sglang_py():
    path = sglang_python()
    if path is None:
        pytest.skip("no SGLang python: run scripts/install_sglang_cpu.sh or set MRF8_SGLANG_PYTHON")
    return path
