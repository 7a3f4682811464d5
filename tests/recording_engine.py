"""A rollout engine that lives in the test suite alone (issue 45 item 2): a run picks it with
``rollout.engine=tests.recording_engine:RECORDING`` and nothing in the package names it.

It is the in-process engine with every call of the rollout contract (``rollout/base.py``) noted in
``<train.output_dir>/engine_calls.jsonl``. So a run through it must equal the same run on
``local`` bit for bit, and its file shows the trainer reached the engine through the contract and
the registry alone (the restart policy and the error word are its spec's too).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from megatron_rl_fp8.rollout.registry import LOCAL, EngineSpec

CALLS = "engine_calls.jsonl"


class RecordingEngine:
    def __init__(self, inner, log: Path):
        self.inner = inner
        self.log = log
        self._lock = threading.Lock()  # the pipelined rollout generates from a thread

    def _note(self, call: str, **fields) -> None:
        with self._lock, self.log.open("a") as f:
            f.write(json.dumps({"call": call, **fields}) + "\n")

    def generate(self, prompts, **kwargs):
        self._note(
            "generate", prompts=len(prompts), n=kwargs["n"], greedy=kwargs.get("greedy", False)
        )
        out = self.inner.generate(prompts, **kwargs)
        self.wait_s = getattr(self.inner, "wait_s", 0.0)
        return out

    @property
    def export_options(self) -> dict:
        return self.inner.export_options

    def update_weights(self, buckets, *, version: int) -> None:
        self._note("update_weights", version=version)
        self.inner.update_weights(buckets, version=version)

    def begin_sync(self, version: int):
        self._note("begin_sync", version=version)
        return self.inner.begin_sync(version)

    @property
    def sender(self):
        return self.inner.sender

    def end_sync(self, plan, errors) -> None:
        self._note("end_sync", version=plan.version)
        self.inner.end_sync(plan, errors)

    def release_memory(self, tags) -> None:
        self.inner.release_memory(tags)

    def resume_memory(self, tags) -> None:
        self.inner.resume_memory(tags)

    def weight_version(self) -> int:
        return self.inner.weight_version()

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def health(self) -> bool:
        return self.inner.health()

    def shutdown(self) -> None:
        self._note("shutdown")
        self.inner.shutdown()


def _build(cfg, hf_cfg, *, output_dir=None, **kwargs):
    return RecordingEngine(LOCAL.build(cfg, hf_cfg, **kwargs), Path(output_dir) / CALLS)


RECORDING = EngineSpec(
    name="recording",
    help="the in-process engine with every contract call noted (tests only)",
    build=_build,
    max_restarts=lambda cfg: 2,
    error_label="recording error",
    in_process=True,  # it runs in the driver, as local does: the launcher places no server
)
