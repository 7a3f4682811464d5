"""The trainer's object collectives (rollout batches, metrics and bounds travel as Python objects)."""

from __future__ import annotations

import torch.distributed as dist


def broadcast_object(obj, src: int):
    """``obj`` from global rank ``src`` on every rank (the default group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
