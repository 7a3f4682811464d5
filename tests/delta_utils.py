"""Helpers of the delta-sync tests: ``start_receiver`` runs ``megatron-rl-fp8 receiver`` in a
process of its own; ``RecordingPlan`` is a rollout engine that records the weights pushed into
it, for sync tests without SGLang: the
``SyncPlan`` and ``SyncSender`` of the contract (``rollout/base.py``), with plain fields so a
delta receiver in another process rebuilds the plan (``rollout/receiver.py``). Each push adds the
SHA-1 of every tensor it got to the engine's record, written to ``<out>/<node>.json`` after every
push (the engine's weights as a later sync leaves them)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
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
        """Nothing to release: the record is written after every push."""


def start_receiver(port: int, log: Path) -> tuple[subprocess.Popen, int]:
    """``megatron-rl-fp8 receiver`` in a process of its own (port 0: one it picks), its output
    appended to ``log``; returns it and the port it listens on."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))  # it rebuilds tests.delta_utils' plans
    start = log.stat().st_size if log.exists() else 0
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "receiver", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
    for _ in range(1200):
        text = log.read_bytes()[start:].decode(errors="replace")
        found = re.search(r"listening on 127.0.0.1:(\d+)", text)
        if found:
            return proc, int(found.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"the receiver exited: {text[-500:]}")
        time.sleep(0.1)
    raise RuntimeError("the receiver did not start")
