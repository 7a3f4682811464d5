"""sync/relay.py on 3 real gloo ranks: a stage's buckets reach the other members of the relay
group equal in names, dtypes (FP8 codes included), shapes and bytes, in order, and a rank outside
the group takes no part."""

from __future__ import annotations

import os

import torch

from tests.dist_utils import run_distributed


def _buckets():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, generator=g)
    return [
        [
            ("a.weight", w.to(torch.bfloat16)),
            ("a.weight_scale_inv", torch.rand(1, 3, generator=g)),  # 12 bytes: the next aligns
            ("b.weight", (w * 10).to(torch.float8_e4m3fn)),
        ],
        [
            ("c.bias", torch.arange(3, dtype=torch.int64)),
            ("d", torch.randn(2, 2, 2, generator=g)[:, 0]),
        ],
    ]


def _body(rank, world_size):
    import torch.distributed as dist

    from megatron_rl_fp8.sync.buckets import Bucket
    from megatron_rl_fp8.sync.relay import relay
    from megatron_rl_fp8.sync.timing import SyncTimes

    group = dist.new_group([0, 2])  # rank 1 is outside: it must not be needed
    if rank == 1:
        return None
    times = SyncTimes()
    src = [Bucket(i, b) for i, b in enumerate(_buckets())] if rank == 2 else None
    got = list(relay(src, src=2, group=group, device=torch.device("cpu"), times=times))
    rows = [
        (
            b.index,
            [
                (n, t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).tolist())
                for n, t in b.tensors
            ],
        )
        for b in got
    ]
    # What the tensor transport may hand the engines as it is: one buffer per received bucket.
    shared = [
        (b.handover, len({t.untyped_storage().data_ptr() for _, t in b.tensors})) for b in got
    ]
    return rows, times.relay, shared


def test_a_stage_sender_relays_its_buckets_byte_for_byte():
    results = run_distributed(_body, world_size=3)
    (received, t_recv, shared_recv), none, (sent, t_sent, shared_sent) = results
    assert none is None
    # NC-5 (issue 43 #5): a received bucket is one buffer made for handing over (the engines
    # get it without another copy); the sender's own stay the trainer's (copied before sharing).
    assert shared_recv == [(True, 1), (True, 1)]
    assert [handover for handover, _ in shared_sent] == [False, False]
    assert received == sent and len(sent) == 2
    expected = [
        (
            i,
            [
                (n, t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).tolist())
                for n, t in b
            ],
        )
        for i, b in enumerate(_buckets())
    ]
    assert sent == expected
    assert t_sent > 0 and t_recv == 0  # the sender's broadcasts are the relay's seconds


def _broken_relay_body(rank, world_size):

    import torch.distributed as dist

    from megatron_rl_fp8.parallel import Groups
    from megatron_rl_fp8.rollout.sglang.sender import SGLangSyncPlan
    from megatron_rl_fp8.sync.buckets import Bucket
    from megatron_rl_fp8.sync.timing import SyncTimes
    from megatron_rl_fp8.trainer.node_sync import NodeSync, RelayFailed

    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    # DP 2 on two nodes: rank 0 is the stage's sender, rank 1 node n2's relay rank.
    groups = Groups(None, None, None, 0, 1, 0, 1, rank, 2, True, True, rank=rank)
    sync = NodeSync(groups)
    plan = SGLangSyncPlan(
        version=1, export_options={}, engines=[("http://a:1", 1), ("http://b:1", 1)],
        device="cpu", timeout=1.0, failed=[], transport="tensor", engine_nodes=["n1", "n2"],
    )  # fmt: skip

    class Dies:
        """n2's rank: takes one bucket, then its process group goes (as when it dies)."""

        times = SyncTimes()

        def push(self, plan, buckets):
            next(iter(buckets))
            dist.destroy_process_group()
            raise _Died

    class Takes:
        times = SyncTimes()

        def push(self, plan, buckets):
            list(buckets)  # n1's rank: takes every bucket the sender relays

    def export(times):
        for i in range(50):
            yield Bucket(i, [("w", torch.full((1000,), float(i)))])

    try:
        sync.push(plan, export=export, sender=lambda: Dies() if rank == 1 else Takes())
    except RelayFailed as e:
        return str(e)
    except _Died:
        return "gone"
    return "no error"


class _Died(BaseException):
    """The dying rank's way out of the sync (not an error the sync handles)."""


def test_a_relay_rank_that_dies_fails_the_sync_in_one_line():
    line, gone = run_distributed(_broken_relay_body, world_size=2, timeout=120)
    assert gone == "gone"
    assert "\n" not in line and line.startswith("per-node weight sync, stage 0: the relay between")
    assert "n1 (rank 0), n2 (rank 1)" in line and "resumes from the last checkpoint" in line


def _moe_per_node_body(rank, world):
    """A MoE actor at EP 2 on 4 ranks, DP 4, over two "nodes" (ranks 0-1 on n1, 2-3 on n2), an
    engine on each: rank 0 gathers its stage and sends, rank 1 (its expert-parallel peer, which
    holds experts 2-3) joins each expert's gather, rank 2 relays to n2's engine. Each node's
    pushing rank returns the names it pushed."""
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.rollout.sglang.sender import SGLangSyncPlan
    from megatron_rl_fp8.sync.timing import SyncTimes
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.engine_link import EngineLink

    os.environ["SLURMD_NODENAME"] = f"n{rank // 2 + 1}"
    cfg = load_config(None, [*MOE, "parallel.expert_model_parallel_size=2"])
    g = parallel.initialize(cfg.parallel, seed=1)
    actor = Actor(cfg.model, cfg.optim, g, parallel=cfg.parallel)
    link = EngineLink(cfg, g, actor, None, None)
    pushed: list[str] = []

    class Takes:
        times = SyncTimes()

        def push(self, plan, buckets):
            pushed.extend(n for b in buckets for n, _ in b.tensors)

    link._sender = lambda plan: Takes()
    plan = SGLangSyncPlan(
        version=1, export_options={}, engines=[("http://a:1", 1), ("http://b:1", 1)],
        device="cpu", timeout=1.0, failed=[], transport="tensor", engine_nodes=["n1", "n2"],
    )  # fmt: skip
    assert link.node_sync.relayed(plan)
    error, _ = link._push(plan)
    parallel.destroy()
    return error, pushed


MOE = ["model.num_experts=4", "model.moe_topk=2", "model.moe_ffn_hidden_size=64"]


def test_a_moe_per_node_sync_gathers_the_experts_of_every_expert_parallel_rank():
    results = run_distributed(_moe_per_node_body, world_size=4, timeout=300)
    n1, peer, n2, idle = results
    assert peer == idle == (None, [])  # an EP peer gathers only; rank 3 neither gathers nor relays
    for error, names in (n1, n2):
        experts = [n for n in names if ".mlp.experts." in n]
        assert error is None and len(experts) == len(set(experts)) == 2 * 4 * 3
        assert sorted(names) == sorted(n1[1])  # both nodes' engines get the same tensors
