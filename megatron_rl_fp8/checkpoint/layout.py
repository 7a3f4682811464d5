"""The checkpoint directory's layout and names (see the package docstring), the manifest's
checksum, and the small collectives every checkpoint call shares: rank 0 reads the file system
once and every rank decides alike."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import torch.distributed as dist

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RANK_STATE = "rank_state"
"""Directory of the per-rank state files, and the key :func:`load` returns their content under."""
MANIFEST_FORMAT = 1
# zlib's crc32, streamed in 8 MiB chunks: in memory 2.1 GB/s on one core of the project's CPU
# machine (sha1 1.5, sha256 1.4, md5 0.6, blake2b 0.6), ~1.6 GB/s reading a file from the page
# cache (benchmarks/bench_checkpoint.py). It detects accidental damage (torn writes, bad copies, bit
# rot), which is all a manifest is for; it is no defence against a shard forged on purpose.
CHECKSUM = "crc32"
_CHUNK = 8 << 20
_ITER = re.compile(r"iter_(\d+)")
VERIFY_MODES = ("sizes", "full")
NONFINITE = "non-finite values"


class CheckpointError(Exception):
    """A checkpoint could not be read. ``reason`` is the underlying error in one line."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot load checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason


def file_checksum(path: Path) -> str:
    """crc32 of a file's bytes as 8 hex digits, streamed (memory: one 8 MiB buffer)."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(obj) -> list:
    _, world = rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank: the file system is read once and every rank decides alike."""
    _, world = rank_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def one_line(e: BaseException, limit: int = 200) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    text = "; ".join(lines) if len(lines) > 1 else (lines[0] if lines else "")
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def step_of(name: str) -> int | None:
    m = _ITER.fullmatch(name)
    return int(m.group(1)) if m else None


def complete_names(root: Path) -> list[str]:
    """Renamed (finished) ``iter_*`` directories, newest step first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(names, key=step_of, reverse=True)


def latest_entry(root: Path) -> tuple[str | None, str | None]:
    """(what ``latest`` names if it is a directory here, else None; what is wrong with it)."""
    marker = root / "latest"
    if not marker.exists():
        return None, None
    try:
        text = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"latest is unreadable ({one_line(e)})"
    if not text:
        return None, "latest is empty"
    if "/" in text or text in (".", "..") or text.endswith(".tmp") or not (root / text).is_dir():
        return None, f"latest names {text[:80]!r}, which is not a checkpoint in {root}"
    return text, None
