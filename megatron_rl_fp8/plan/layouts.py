"""Other layouts of the same GPUs that would fit, best first.

The search tries every TP that divides the query heads and the KV groups (at most one node's
GPUs: TP's all-reduces want NVLink), every PP that divides the layers, CP in powers of two (TE spec
only: Megatron's local attention has none), the distributed optimizer off and on, and recomputation none / selective (``core_attn``,
with the local spec's unfused attention only: TE's and SDPA's keep no s^2 scores, so it would
save nothing) / full (uniform, one layer), with sequence parallelism whenever TP > 1 (it only saves memory). A layout must also
split the config's batch: each mini-batch's rows over the DP ranks, in whole micro-batches. Optimizer
offload is not tried (the last resort), and the config's own setting is not carried over.

A mixture-of-experts model also tries every expert parallelism EP that divides the experts and the
DP x CP ranks (TP must then divide the expert width too).

Ranking: fewest model-parallel ranks (TP x PP x CP: less communication, more DP), then the
cheapest recomputation (none, selective, full: full adds ~1/3 of the forward to the backward),
then (MoE) the smallest EP that stays within a node with TP, then the largest margin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from megatron_rl_fp8.plan.memory import Estimate, Layout, World, estimate
from megatron_rl_fp8.plan.model_bytes import Spec

if TYPE_CHECKING:
    from megatron_rl_fp8.config import RunConfig
    from megatron_rl_fp8.plan.model_bytes import LogitsCost

RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits_batch(cfg: RunConfig, dp: int) -> bool:
    """Whether each mini-batch's rows split over ``dp`` ranks (in whole micro-batches unless a
    token budget groups them), the rule ``RunConfig.validate`` applies."""
    t = cfg.train
    rows = t.prompts_per_step * cfg.rollout.n_samples_per_prompt
    unit = dp if getattr(t, "max_tokens_per_gpu", None) else dp * t.micro_batch_size
    return rows % t.updates_per_step == 0 and (rows // t.updates_per_step) % unit == 0


def candidate_layouts(cfg: RunConfig, world: World, spec: Spec) -> Iterator[Layout]:
    m, n = cfg.model, world.size
    heads = math.gcd(m.num_attention_heads, m.num_query_groups)
    width = m.ffn_hidden_size if m.num_experts is None else m.expert_ffn_hidden_size
    tps = [
        t
        for t in _divisors(heads)
        if t <= world.gpus_per_node and m.ffn_hidden_size % t == 0 and width % t == 0 and n % t == 0
    ]
    cps = [2**i for i in range(n.bit_length()) if spec == "te" or i == 0]
    # Selective recompute drops the unfused attention's s^2 scores; fused attention keeps none.
    scores = spec == "local" and not m.uses_sdpa(on_cpu=world.device == "cpu")
    recomputes = ("none", "selective", "full") if scores else ("none", "full")
    for tp in tps:
        for pp in _divisors(m.num_layers):
            for cp in cps:
                if n % (tp * pp * cp):
                    continue
                dp = n // (tp * pp * cp)
                if not _splits_batch(cfg, dp):
                    continue
                eps = [1]
                if m.num_experts is not None:
                    eps = [e for e in _divisors(m.num_experts) if (dp * cp) % e == 0]
                for dist_opt in (False, True) if dp * cp > 1 else (False,):
                    for recompute in recomputes:
                        for ep in eps:
                            yield Layout(
                                tp=tp,
                                pp=pp,
                                cp=cp,
                                dp=dp,
                                ep=ep,
                                sequence_parallel=tp > 1,
                                distributed_optimizer=dist_opt,
                                recompute=recompute,
                            )


def _rank(e: Estimate) -> tuple:
    lay = e.layout
    # MoE: an EP whose all-to-all leaves the node is dearer than any within it.
    across = lay.ep * lay.tp > e.world.gpus_per_node
    return (lay.model_parallel_size, RECOMPUTE_COST[lay.recompute], across, lay.ep, -e.margin_gb)


def alternatives(cfg: RunConfig, world: World, *, spec: Spec, logits: LogitsCost) -> list[Estimate]:
    """Every candidate layout that fits ``world``, best first (see the module docstring)."""
    fits = []
    for layout in candidate_layouts(cfg, world, spec):
        e = estimate(cfg, world, layout=layout, spec=spec, logits=logits)
        if e.fits:
            fits.append(e)
    return sorted(fits, key=_rank)
