"""A rollout engine that records the weights pushed into it, for sync tests without SGLang: the
``SyncPlan`` and ``SyncSender`` of the contract (``rollout/base.py``), with plain fields so a
delta receiver in another process rebuilds the plan (``rollout/receiver.py``). Each push adds the
SHA-1 of every tensor it got to the engine's record, written to ``<out>/<node>.json`` after every
push (the engine's weights as a later sync leaves them)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from megatron_rl_fp8.rollout.base import SyncPlan
from megatron_rl_fp8.sync.timing import SyncTimes


def sha1(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@dataclasses.dataclass(kw_only=True)
class RecordingPlan(SyncPlan):
    engine_nodes: list[str]
    out: str
    from_stages: bool = True

    def new_sender(self) -> RecordingSender:
        return RecordingSender()

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.engine_nodes))

    def on_node(self, node: str) -> RecordingPlan:
        return dataclasses.replace(self, engine_nodes=[node])


class RecordingSender:
    """The engines of one node, as their pushing side sees them: every tensor's latest bytes."""

    def __init__(self):
        self.times = SyncTimes()
        self.held: dict[str, str] = {}

    def push(self, plan: RecordingPlan, buckets) -> str | None:
        for bucket in buckets:
            self.held.update((n, sha1(t)) for n, t in bucket.tensors)
        (node,) = plan.nodes
        path = Path(plan.out) / f"{node}.json"
        path.write_text(json.dumps(self.held))
        return None

    def close(self) -> None:
        pass
