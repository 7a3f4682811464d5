"""Delta weight syncs over the per-node relay (issue 48, ``rollout.delta_sync``): a real actor at
PP 2 x DP 2 on four gloo ranks over two "nodes", block-FP8 rollout export, 20 syncs with an
optimizer-sized step before each. Each stage's sender relays its stage to the other node's relay
rank, which applies the delta to its node's copy and pushes full tensors to its engine; the
sender's own node's engine gets the sender's full buckets. So at every sync the two engines hold
the same tensors bit for bit exactly when the delta-applied copy equals a full sync's.

Along the way, the cases that must fall back to a full sync (or need none on the wire):
- sync 8: n2's engine was relaunched (it holds nothing): its relay rank pushes it every tensor
  from its copy, and the wire stays a delta;
- sync 12: n2's engines are out of the fleet (the plan names n1 only), so its relay rank misses
  that sync; at sync 13 it is one version behind and gets stage 0 in full, with the reason;
- sync 16: one byte of n2's copy goes bad: the digest check fails that node's push in one line,
  and the sync's rerun goes in full.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from tests.dist_utils import run_distributed

SYNCS = 20
CFG = [
    "parallel.pipeline_model_parallel_size=2",
    "rollout.fp8.weight_quant=blockwise",
    "rollout.fp8.quantizer=builtin",
    "rollout.delta_sync=true",
    "rollout.delta_verify_every=1",  # every sync's tensors checked by their digests
]


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.rollout.sglang.sender import SGLangSyncPlan
    from megatron_rl_fp8.sync.timing import SyncTimes
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.engine_link import EngineLink

    os.environ["SLURMD_NODENAME"] = f"n{rank // 2 + 1}"  # ranks 0-1 on n1, 2-3 on n2
    cfg = load_config(None, CFG)
    g = parallel.initialize(cfg.parallel, seed=1)
    actor = Actor(cfg.model, cfg.optim, g, parallel=cfg.parallel)
    link = EngineLink(cfg, g, actor, None, None)
    engine: dict[str, torch.Tensor] = {}  # what this node's engine holds (on its relay rank)

    class Engine:
        """The node's engine as the relay rank sees it: it loads every tensor pushed."""

        times = SyncTimes()

        def push(self, plan, buckets):
            for b in buckets:
                engine.update((n, t.clone()) for n, t in b.tensors)

    link._sender = lambda plan: Engine()
    params = list(actor.model.parameters())
    master = [p.detach().float().clone() for p in params]  # the optimizer's fp32 copies
    records = []
    for version in range(1, SYNCS + 1):
        if version > 1:  # an Adam-sized step: every weight moves by 1e-5 (the same on DP peers)
            gen = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for p, m in zip(params, master):
                    m.add_(1e-5 * torch.randn(m.shape, generator=gen).sign())
                    p.copy_(m)
        nodes = ["n1"] if version == 12 else ["n1", "n2"]
        if version == 8 and rank == 2:
            engine.clear()  # n2's engine relaunched: empty
        if version == 16 and rank == 2:
            t = link.node_sync.links[0].receiver.tensors
            name = sorted(n for n in t if n.endswith("mlp.down_proj.weight"))[0]
            t[name].view(-1).view(torch.uint8)[7] ^= 1  # one byte of n2's copy goes bad
        plan = SGLangSyncPlan(
            version=version, export_options={}, engines=[(f"http://{n}:1", 1) for n in nodes],
            device="cpu", timeout=1.0, failed=[], transport="tensor", engine_nodes=nodes,
        )  # fmt: skip
        attempts = _sync(link, plan, world)
        records.append((attempts, {n: _hash(t) for n, t in engine.items()}))
    parallel.destroy()
    return records


def _sync(link, plan, world, before_rerun=None) -> list:
    """``link``'s part of ``plan``, run again once if any rank failed (as ``EngineLink.sync``
    reruns a failed sync; ``before_rerun()`` first): per attempt every rank's error, this rank's
    relayed and full megabytes, and its delta links' full-sync reasons by stage."""
    attempts = []
    for attempt in range(2):
        if attempt:
            if before_rerun is not None:
                before_rerun()
            torch.distributed.barrier()
        error, times = link._push(plan)
        errors = [None] * world
        torch.distributed.all_gather_object(errors, error)
        logs = {s: list(d.log) for s, d in link.node_sync.links.items()}
        attempts.append((errors, times.relay_mb, times.relay_full_mb, logs))
        if not any(errors):
            break
    return attempts


def test_twenty_delta_syncs_keep_both_nodes_engines_equal_to_a_full_sync():
    n1, _, n2, _ = run_distributed(_body, world_size=4, timeout=600)
    for version in range(1, SYNCS + 1):
        (a1, e1), (a2, e2) = n1[version - 1], n2[version - 1]
        errors, mb, full_mb, logs = a1[-1]
        assert not any(errors), (version, errors)
        assert e1 and len(e1) >= 10
        if version != 12:  # both nodes synced: the delta-applied copy is the full sync's
            assert e2 == e1, version
        if version == 1:
            assert logs[0] == ["the first sync"] and abs(mb - full_mb) < 0.01 * full_mb
        elif version == 13:  # n2 missed sync 12: stage 0 (rank 0 sends) goes in full to it
            assert logs[0] == ["rank 2 holds version 11, not 12"], logs
        elif version == 16:  # the bad byte: n2's push failed in one line, the rerun is full
            assert len(a2) == 2
            first = a2[0][0][2]
            assert first.startswith(
                "node n2's relay rank could not apply the delta sync of stage 0"
            )
            assert "differs from the sender's after the sync" in first and "\n" not in first
            assert a1[1][3][0] == ["rank 2 holds version None, not 16"]
        else:  # a delta: a fraction of the full bytes
            assert logs[0] == [] and 0 < mb < 0.5 * full_mb, (version, mb, full_mb)
    assert n2[11][1] == n2[10][1]  # sync 12 never reached n2's engine
    assert n1[11][1] != n1[10][1]  # the weights moved at every step


def _receiver_body(rank, world, out):
    import json

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.engine_link import EngineLink
    from tests.delta_utils import RecordingPlan, RecordingSender, start_receiver

    os.environ["SLURMD_NODENAME"] = "n1"  # both trainer ranks; n3 has engines and no trainer rank
    log = Path(out) / "receiver.log"
    proc, port = start_receiver(0, log) if rank == 0 else (None, None)
    g = parallel.initialize(load_config(None, CFG).parallel, seed=1)
    box = [port]
    torch.distributed.broadcast_object_list(box, src=0)
    port = box[0]
    cfg = load_config(None, [*CFG, f"rollout.delta_receivers=[n3=127.0.0.1:{port}]"])
    actor = Actor(cfg.model, cfg.optim, g, parallel=cfg.parallel)
    link = EngineLink(cfg, g, actor, None, None)
    n1 = RecordingSender()
    link._sender = lambda plan: n1
    params = list(actor.model.parameters())
    master = [p.detach().float().clone() for p in params]
    records = []
    try:
        for version in range(1, 9):
            if version > 1:
                gen = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p, m in zip(params, master):
                        m.add_(1e-5 * torch.randn(m.shape, generator=gen).sign())
                        p.copy_(m)
            if rank == 0 and version in (4, 5):
                proc.kill()  # 4: relaunched (its copy is gone); 5: down for one attempt
                proc.wait()
                if version == 4:
                    proc, _ = start_receiver(port, log)
            torch.distributed.barrier()
            plan = RecordingPlan(
                version=version, export_options={}, engine_nodes=["n1", "n3"], out=out
            )

            def restart():
                nonlocal proc
                if rank == 0:
                    proc, _ = start_receiver(port, log)

            attempts = _sync(link, plan, world, before_rerun=restart)
            held = [json.loads((Path(out) / f"{n}.json").read_text()) for n in ("n1", "n3")]
            records.append((attempts, held))
            torch.distributed.barrier()
    finally:
        if proc is not None:
            proc.kill()
        parallel.destroy()
    return records


def test_a_delta_receiver_beside_engines_no_trainer_rank_reaches(tmp_path):
    """``megatron-rl-fp8 receiver`` (a process of its own) serves node n3's engine: each stage's
    sender streams it the sync over TCP, it applies deltas to its copy and pushes full tensors;
    its engine holds what n1's (which gets the senders' full buckets) holds, bit for bit, at
    every sync. Relaunched (its copy gone): the next sync goes in full, saying why. Down: the sync
    fails in one line naming it and the command to start it, and its rerun goes in full."""
    r0, r1 = run_distributed(_receiver_body, world_size=2, args=(str(tmp_path),), timeout=600)
    for version, ((attempts, (n1, n3)), (attempts1, _)) in enumerate(zip(r0, r1), start=1):
        assert n1 and n1 == n3, version
        errors, mb, full_mb, logs = attempts[-1]
        assert not any(errors), (version, errors)
        sent = [a for a in (attempts, attempts1)]
        if version == 4:
            why = "node n3's delta receiver (127.0.0.1:"
            assert any(why in line and "holds version None, not 3" in line
                       for a in sent for line in a[-1][3].get(0, []) + a[-1][3].get(1, []))  # fmt: skip
        if version == 5:
            first = [e for e in attempts[0][0] if e]
            assert len(attempts) == 2 and first, attempts
            assert "asking its version failed" in first[0] and "\n" not in first[0]
            assert "megatron-rl-fp8 receiver --port" in first[0]
        if version in (2, 3, 6, 7, 8):  # deltas: every stage sent a fraction of its bytes
            assert all(not lines for a in sent for lines in a[-1][3].values()), version
            assert all(0 < a[-1][1] < 0.5 * a[-1][2] for a in sent), version
    log = (tmp_path / "receiver.log").read_text()
    assert "(delta from 1)" in log and "full" in log
