"""Durable file-system writes: what checkpoints, conversion outputs and logs rely on.

A file is replaced atomically (write a sibling, fsync it, ``os.replace``), and a rename becomes
durable only once its directory is fsynced too; a crash at any point leaves the old or the new
content, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (the directory's own fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
