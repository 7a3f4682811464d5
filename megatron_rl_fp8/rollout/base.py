"""The rollout side's contract: what any engine (in-process, SGLang servers) must offer the
trainer, which talks to every engine through it alone.

    generate              sample completions (the driver's engine)
    begin_sync / end_sync one weight sync, planned and finished by the driver's engine; in between
                          the sending ranks push their buckets (:class:`SyncPlan` says which ranks,
                          :class:`SyncSender` is a rank's side)
    release / resume      colocated placement: the engines' GPU memory handed to the trainer and
                          back around each training phase
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from megatron_rl_fp8.sync.buckets import Bucket
    from megatron_rl_fp8.sync.timing import SyncTimes


def prompt_limits(max_new_tokens: int | Sequence[int], n_prompts: int) -> list[int]:
    """``generate``'s ``max_new_tokens`` as one limit per prompt (one int applies to all)."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * n_prompts
    limits = [int(m) for m in max_new_tokens]
    if len(limits) != n_prompts:
        raise ValueError(f"max_new_tokens: {len(limits)} limits for {n_prompts} prompts")
    return limits


def eos_ids(eos_token_id: int | Iterable[int]) -> tuple[int, ...]:
    """``eos_token_id`` as transformers takes it (one id or several, e.g. Qwen's ``<|im_end|>``
    and ``<|endoftext|>``) -> the tuple of ids that end a completion."""
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(int(i) for i in eos_token_id)
    if not ids:
        raise ValueError("eos_token_id: need at least one end-of-sequence id")
    return ids


@dataclasses.dataclass
class Completion:
    """One sampled completion (token ids exclude the prompt; eos included when produced)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finished: bool  # ended with an eos id (False = truncated at max_new_tokens)
    version: int = -1
    """The weight version (``begin_sync``'s ``version``: the trainer's step) of the engine that
    sampled it; -1 = unknown. The trainer refuses rows older than ``train.max_staleness``."""
    response_mask: list[int] | None = None
    """Per response token: 1 where the policy sampled it, 0 where an environment inserted it (a
    tool's answer between turns: its ``response_logprobs`` entry is a 0.0 placeholder, and it
    gets no gradient, ratio or clip statistic). None: every token was sampled (one turn)."""
    turns: int = 1
    """Policy turns in the response (``rollout/turns.py``)."""
    routed_experts: Any = None
    """Mixture-of-experts engines asked for their routes (``rollout.routing_replay``): the
    experts each token of prompt + response but the last went to, per layer, an int16 tensor
    [len(prompt_ids) + len(response_ids) - 1, layers, top-k]; None otherwise."""
    tool_calls: int = 0
    """Tool calls the environment answered or tried to."""
    end: str = ""
    """Why a multi-turn trajectory ended (``turns.ENDS``); "" for one turn."""
    final_start: int = 0
    """Where the policy's last turn starts in ``response_ids``: the reward scores the text from
    there (0 for one turn: the whole response)."""

    def sampled(self) -> list[int]:
        """:attr:`response_mask`, or all ones for a one-turn completion."""
        return [1] * len(self.response_ids) if self.response_mask is None else self.response_mask


@dataclasses.dataclass(kw_only=True)
class SyncPlan:
    """One weight sync as the driver's engine plans it (``begin_sync``); picklable: the driver
    broadcasts it to every rank."""

    version: int
    export_options: dict
    """How the engine wants its weights exported: keyword arguments of
    ``sync.buckets.export_for_rollout`` (``bucket_mb``, ``dequantize_to``)."""
    from_stages: bool = False
    """False: the driver gathers every pipeline stage's full tensors and pushes them all (an
    in-process engine, reachable from the driver alone). True: each pipeline stage's sending
    rank pushes its own stage's, one stage after the other (servers that every rank reaches)."""

    def new_sender(self) -> SyncSender:
        """The sending side of a rank other than the driver (``from_stages``), kept for the next
        syncs. The driver pushes with its engine's ``sender``."""
        raise TypeError(f"{type(self).__name__}: only the driver pushes weights into this engine")

    @property
    def nodes(self) -> list[str]:
        """The nodes of engines that take their weights from a rank of their own node (a
        per-node sync, ``trainer/node_sync.py``, where some stage's sender is elsewhere), or
        ``[]``: the senders reach every engine."""
        return []

    def on_node(self, node: str) -> SyncPlan:
        """The plan for ``node``'s engines alone (a per-node sync's part of one node)."""
        return self

    @property
    def reach_every_node(self) -> str:
        """The setting that makes the senders reach every engine without a per-node sync (for
        the error that a node's engines have no trainer rank to hand them their weights)."""
        return "a transport that reaches every node"


class SyncSender(Protocol):
    """One sending rank's side of a sync: pushes its buckets into the engines of a plan."""

    times: SyncTimes
    """The last push's ``transfer`` and ``load`` seconds (``sync/timing.py``)."""

    def push(self, plan: SyncPlan, buckets: Iterable[Bucket]) -> str | None:
        """Send every bucket; returns the first failure (the rest of the stream is then only
        consumed: the export is a collective), or None."""

    def close(self) -> None: ...


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        greedy: bool = False,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt, grouped: result[i * n + j] is prompt i, sample j.

        ``max_new_tokens``: one limit, or one per prompt (:func:`prompt_limits`; a multi-turn
        rollout's later turns each have the room their trajectory has left, and a server engine
        refuses a prompt whose length plus its limit passes the model's context).

        An engine may set ``wait_s``: the seconds of this call spent waiting on its slowest
        engines (``perf/rollout_wait_time_s``, docs/logging.md); absent means 0."""

    @property
    def export_options(self) -> dict:
        """How this engine wants its weights exported: ``bucket_mb`` and ``dequantize_to``,
        keyword arguments of ``sync.buckets.export_for_rollout``."""

    def update_weights(self, buckets: Iterable[Bucket], *, version: int) -> None:
        """Load new weights (buckets of HF-named full tensors, as ``export_for_rollout`` makes
        them), then serve only that version: a whole sync from this one process."""

    def begin_sync(self, version: int) -> SyncPlan:
        """Prepare sync ``version`` on the driver; returns the plan every rank pushes by."""

    @property
    def sender(self) -> SyncSender:
        """The driver's sending side: the driver's own share of every sync goes through it."""

    def end_sync(self, plan: SyncPlan, errors: list[str | None]) -> None:
        """Finish ``plan`` after every sending rank pushed (``errors``: each rank's failure, or
        None), then serve only ``plan.version``. Raises ``rollout.errors.SyncFailed`` when the
        sync is to be run again."""

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Colocated placement: give the GPU memory of ``tags`` (``weights``, ``kv_cache``) to
        the trainer. Released weights are gone: generating needs a sync first."""

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Colocated placement: take the memory of ``tags`` back (weights before a sync, the KV
        cache before generating)."""

    def weight_version(self) -> int: ...

    def metrics(self) -> dict[str, float]:
        """The engine's numbers for the step's metrics line (``rollout/...``; may be empty)."""

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...
