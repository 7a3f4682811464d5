"""The run's checkpoints as one component: what a checkpoint holds, and save / restore / prune /
discard over it (the files, manifests and verification are ``megatron_rl_fp8/checkpoint/``).

A checkpoint holds the actor (weights and optimizer as sharded tensors, plus each rank's own
state) and, in ``trainer_state.json``, the step and every stateful component's ``state_dict()``
under its name. The names are the file format: ``train_data`` (dataset position), ``calib``
(calibrator), ``opt_param_scheduler`` (learning-rate schedule), ``guard`` (stability guard).
A component absent from an older checkpoint keeps its fresh state; ``train_data`` is required.
*Rank components* hold what one rank alone has (the driver's held rollout, ``pipeline.py``):
their states go into that rank's own file (``rank_state/<rank>.pt``, hashed in the manifest and
read with ``weights_only``) under their names, beside the actor's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from megatron_rl_fp8 import checkpoint
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.collectives import broadcast_object
from megatron_rl_fp8.trainer.config import TrainConfig
from megatron_rl_fp8.utils.fs import atomic_write_text


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class StateOf:
    """A component from a getter and a setter (state that lives inside another object)."""

    def __init__(self, get: Callable[[], Any], set: Callable[[Any], None]):
        self.state_dict, self.load_state_dict = get, set


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


class Checkpointer:
    def __init__(
        self,
        root: Path,
        actor: Actor,
        components: dict[str, Stateful],
        *,
        verify: str,
        keep: int,
        is_driver: bool,
        driver_rank: int = 0,
        rank_components: dict[str, Stateful] | None = None,
    ):
        self.root = root
        self.actor = actor
        self.components = components
        self.rank_components = rank_components or {}
        self.verify = verify
        self.keep = keep
        self.is_driver = is_driver
        self.driver_rank = driver_rank

    @classmethod
    def for_run(
        cls,
        train: TrainConfig,
        groups: Groups,
        actor: Actor,
        rank_components: dict[str, Stateful] | None = None,
        **components: Stateful,
    ):
        """The checkpoints of a run: ``<train.output_dir>/checkpoints``, ``components`` by name."""
        return cls(
            Path(train.output_dir) / "checkpoints",
            actor,
            components,
            verify=train.checkpoint_verify,
            keep=train.keep_checkpoints,
            is_driver=groups.is_driver,
            driver_rank=groups.driver_rank,
            rank_components=rank_components,
        )

    def save(self, step: int, *, param_norm: float, protect: Iterable[int] = ()) -> None:
        """Write step ``step``'s checkpoint, then prune to ``train.keep_checkpoints`` plus the
        steps in ``protect``. Weights that are not finite (``param_norm``) are refused: a
        checkpoint nobody can resume from is worse than none (the previous one stays latest;
        reached only with guard.enabled=false). Collective."""
        if not math.isfinite(param_norm):
            raise RuntimeError(
                f"refusing to write the step {step} checkpoint: the weights are not finite "
                f"(train/param_norm={param_norm}); turn on the guard (guard.enabled=true) or "
                "lower optim.lr"
            )
        state = {"step": step, **{k: c.state_dict() for k, c in self.components.items()}}
        rank_state = self.actor.rank_state()
        for name, component in self.rank_components.items():
            if own := component.state_dict():
                rank_state = {**rank_state, name: own}
        checkpoint.save(
            self.root,
            iter_name(step),
            self.actor.sharded_state_dict(with_optimizer=True),
            state,
            rank_state=rank_state,
        )
        if self.is_driver:
            checkpoint.prune(self.root, keep=self.keep, protect=[iter_name(s) for s in protect])

    def restore(self, skip: Iterable[str] = ()) -> tuple[Path, dict] | None:
        """Load the newest checkpoint that verifies and loads (a damaged one is named in one line
        and an older one tried) into the actor and every component not in ``skip``. Returns
        (its path, its trainer state), None when there is no checkpoint. Collective."""
        found = checkpoint.load_newest_intact(
            self.root,
            lambda: self.actor.sharded_state_dict(with_optimizer=True, is_loading=True),
            verify=self.verify,
            required={"step": int, "train_data": dict},
        )
        if found is None:
            return None
        path, loaded, state = found
        if self.is_driver and checkpoint.latest_name(self.root) != path.name:
            # ``latest`` garbled, or naming a damaged checkpoint: it names the one resumed from,
            # so tools and a study's bookkeeping (which read ``latest``) agree with the run.
            atomic_write_text(self.root / "latest", path.name + "\n")
            print_rank0(f"checkpoint: latest now names {path.name}, the checkpoint resumed from")
        self.actor.load_sharded(loaded)
        rank_state = dict(loaded.get(checkpoint.RANK_STATE) or {})
        for name, component in self.rank_components.items():
            own = rank_state.pop(name, None)
            if name not in skip:
                component.load_state_dict(own)
        self.actor.load_rank_state(rank_state or None)
        for name, component in self.components.items():
            if name in state and name not in skip:
                component.load_state_dict(state[name])
        return path, state

    def discard_from(self, first_step: int) -> tuple[list[str], str | None]:
        """Remove the checkpoints of step >= ``first_step`` and point ``latest`` at the newest
        left. Returns (the names removed, the name ``latest`` now holds or None), the same on
        every rank. Collective."""
        result = None
        if self.is_driver:
            removed = checkpoint.discard_from(self.root, first_step)
            result = (removed, checkpoint.latest_name(self.root))
        return broadcast_object(result, self.driver_rank)
