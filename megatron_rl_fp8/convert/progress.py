"""A progress bar over bytes and the one summary line every command ends with."""

from __future__ import annotations

import time

from tqdm.auto import tqdm


class Meter:
    """Counts tensors and bytes; shows a tqdm bar (rank 0, if ``show``) and formats the summary."""

    def __init__(self, desc: str, total_bytes: int, *, show: bool = True):
        self.desc = desc
        self.tensors = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            disable=None if show else True,  # None: off when stderr is not a terminal
            dynamic_ncols=True,
            leave=False,
        )

    def update(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        self.bar.update(nbytes)

    def close(self) -> dict:
        self.bar.close()
        seconds = time.perf_counter() - self.t0
        return {
            "tensors": self.tensors,
            "bytes": self.bytes,
            "seconds": seconds,
            "gb_per_s": self.bytes / 1e9 / max(seconds, 1e-9),
        }


def summary_line(desc: str, stats: dict, out) -> str:
    size = stats["bytes"]
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
    return (
        f"{desc}: {stats['tensors']} tensors, {shown} in {stats['seconds']:.2f} s "
        f"({stats['gb_per_s']:.3f} GB/s) -> {out}"
    )
