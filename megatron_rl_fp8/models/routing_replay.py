"""Rollout routing replay (R3) for a mixture-of-experts actor: the trainer's forward passes route
each token to the experts the rollout engine routed it to, and count how often their own routers
would have chosen otherwise.

The engine returns, per token it ran and per layer, the ``moe_topk`` experts its router picked.
The batch carries them as ``routed_experts`` [rows, positions, layers, top-k] (expert + 1, 0
where the engine ran no routing: padding, a sequence's last token; uint8 up to 254 experts, else
int32: types gloo and NCCL both move). Before each micro-batch's
forward, :meth:`RoutingReplay.feed` cuts its routes into each router's token order (Megatron's
[sequence, batch] flattened; this rank's sequence slice under sequence parallelism) and queues
them per router. Megatron's ``TopKRouter`` asks its ``router_replay`` object for the top-k
(``moe_utils.topk_routing_with_score_function``); ours is :class:`_Router`:

* it computes the router's own top-k, and on a first forward counts the tokens whose expert set
  differs from the engine's (``moe/routing_mismatch``, per token and layer);
* replaying, it takes the engine's experts where there are some and weights them by the router's
  own scores of those experts (``scores.gather``, then Megatron's softmax over the k), so the
  router still learns from the replayed tokens;
* a forward recomputed in the backward pass (activation recomputation) takes its micro-batch's
  routes again, in order, from a second cursor over the same queue: pipeline schedules run
  several forwards before the first backward, and recomputation follows the backward order.

Passes without routes (the KL reference, the warm start) route freely.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

ROUTES = "routed_experts"  # the batch field (trainer/batch.py)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread: a forward called then is an
    activation recomputation (torch's own checkpoint tells them apart the same way)."""
    return torch._C._current_graph_task_id() != -1


def route_dtype(highest_expert: int) -> torch.dtype:
    """The batch's type for routes whose largest expert id is ``highest_expert``."""
    return torch.uint8 if highest_expert + 1 <= 255 else torch.int32


def encode_routes(experts: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Engine expert ids [..., k] (>= 0) as the batch stores them: expert + 1, in ``dtype``
    (default :func:`route_dtype` of their largest)."""
    dtype = dtype or route_dtype(int(experts.max()) if experts.numel() else 0)
    return (experts.to(torch.int32) + 1).to(dtype)


class _Router:
    """One router's side (``TopKRouter.router_replay``): the queue of its micro-batches' routes."""

    def __init__(self, owner: RoutingReplay):
        self.owner = owner
        self.queue: list[torch.Tensor | None] = []
        self.forward = 0  # the next first forward's entry
        self.recompute = 0  # the next recomputed forward's entry

    def reset(self) -> None:
        self.queue, self.forward, self.recompute = [], 0, 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, compute_topk=None):
        probs, idx = compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.owner.mode is None:
            return probs, idx
        recomputed = _in_backward()
        if recomputed:
            target, self.recompute = self.queue[self.recompute], self.recompute + 1
        else:
            target, self.forward = self.queue[self.forward], self.forward + 1
        if target is None:
            return probs, idx
        target = target.to(idx.device)
        if target.shape != idx.shape:
            raise RuntimeError(
                f"routing replay: {tuple(target.shape)} routes for a router of "
                f"{tuple(idx.shape)} tokens x top-k (the batch's routes do not match its tokens)"
            )
        have = target[:, 0] >= 0
        if not recomputed and self.owner.counting:
            own = idx.sort(dim=1).values != target.sort(dim=1).values
            self.owner.count((own.any(dim=1) & have).sum(), have.sum())
        if self.owner.mode != "replay":
            return probs, idx
        idx = torch.where(have[:, None], target, idx)
        return scores.gather(1, idx), idx


class RoutingReplay:
    """The routers of ``module`` (a Megatron GPT with MoE layers), replaying or measuring inside
    :meth:`passing`. ``sequence_parallel`` / ``tp_rank`` / ``tp_size``: how a router's tokens are
    this rank's slice of each sequence."""

    def __init__(self, module: torch.nn.Module, *, sequence_parallel: bool, tp_rank: int, tp_size):
        from megatron.core.transformer.moe.router import TopKRouter  # lazy: MoE actors only

        self.routers: dict[int, _Router] = {}
        for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
            hook = _Router(self)
            router.router_replay = hook
            self.routers[router.layer_number - 1] = hook
        self.split = tp_size if sequence_parallel else 1
        self.tp_rank = tp_rank
        self.mode: str | None = None
        self.counting = False
        # Routes whose expert set differed from the engine's, and routes compared (this rank):
        # device tensors, read once by metrics() (no host sync per router call).
        self.differ: torch.Tensor | int = 0
        self.compared: torch.Tensor | int = 0

    def count(self, differ: torch.Tensor, compared: torch.Tensor) -> None:
        if self.counting:
            self.differ = self.differ + differ
            self.compared = self.compared + compared

    @contextlib.contextmanager
    def passing(self, mode: str, *, count: bool = False) -> Iterator[None]:
        """Inside: micro-batches fed with routes are replayed (``replay``) or only compared
        (``measure``); ``count``: their mismatches count into :meth:`metrics`. Every queued
        route must have been used by the end."""
        for r in self.routers.values():
            r.reset()
        self.mode, self.counting = mode, count
        try:
            yield
            for layer, r in self.routers.items():
                if r.forward != len(r.queue) or r.recompute not in (0, len(r.queue)):
                    raise RuntimeError(
                        f"routing replay: layer {layer}'s router ran {r.forward} forwards and "
                        f"{r.recompute} recomputations for {len(r.queue)} micro-batches"
                    )
        finally:
            self.mode = None
            for r in self.routers.values():
                r.reset()

    def feed(self, mb: dict[str, torch.Tensor]) -> None:
        """Queue micro-batch ``mb``'s routes (its ``routed_experts``, [b, s, layers, k] after
        any context-parallel split) for every router of this rank, in that router's token order;
        a micro-batch without routes routes freely. Called before the micro-batch's forward."""
        if self.mode is None:
            return
        routes = mb.get(ROUTES)
        for layer, r in self.routers.items():
            if routes is None:
                r.queue.append(None)
                continue
            mine = routes[:, :, layer].transpose(0, 1)  # [s, b, k]: Megatron's token order
            if self.split > 1:
                mine = mine.chunk(self.split, dim=0)[self.tp_rank]
            r.queue.append(mine.reshape(-1, mine.shape[-1]).to(torch.int64) - 1)

    def metrics(self, *, device: torch.device, counts_here: bool) -> dict[str, float]:
        """``moe/routing_mismatch``: the share of (token, layer) routes where the trainer's own
        routers chose another expert set than the engine's, over every rank since the last call
        (collective over all ranks; ``counts_here``: this rank's tokens are its own, not a
        tensor-parallel copy). {} when nothing was compared."""
        total = torch.zeros(2, dtype=torch.float64, device=device)
        if counts_here:
            total[0] += self.differ
            total[1] += self.compared
        dist.all_reduce(total)
        self.differ = self.compared = 0
        differ, compared = total.tolist()
        return {"moe/routing_mismatch": differ / compared} if compared else {}
