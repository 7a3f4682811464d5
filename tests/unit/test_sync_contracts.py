"""Contracts of the weight sync that hold on any machine, each named after what it guarantees.

The NCCL sync group and its GPUs (``rollout.sglang.transport=distributed``). Precondition, from
NCCL itself: NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected",
nccl ``src/init.cc``, ``initTransportsRank``: two ranks with the same host hash and the same bus
id fail with ``ncclInvalidUsage``; recorded in PLATFORM_NOTES.md, "GPU library contracts").
Every pipeline stage's sending rank (TP rank 0 of the DP-rank-0 / CP-rank-0 replica,
``trainer/engine_link.py``) forms such a group with every engine's TP ranks
(``rollout/sglang/sender.py``, ``transports.join_sender_group``), so no engine may sit on a GPU
where any sending rank runs. Under torchrun, global rank r has local
rank ``r % gpus_per_node`` and the trainer takes that GPU (``parallel.initialize``); Megatron's
default order ``tp-cp-ep-dp-pp`` makes stage s's sender global rank ``s * world / PP``. The
``tensor`` transport (CUDA IPC over HTTP) forms no NCCL group and may share a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.launch.layout import plan_layout
from megatron_rl_fp8.launch.slurm import SlurmEnv
from megatron_rl_fp8.rollout.sglang.sender import Senders, free_engine_blocks
from tests.unit import test_launch
from tests.unit.test_launch import Q8B, commands, dry_run, refused

paths = test_launch.paths  # the fixture: the 8B example's config.json and prompt files

# Issue 30's example: one node of 8 GPUs, trainer TP2 x PP2 (DP2), engines colocated.
TP2_PP2 = (
    "parallel.tensor_model_parallel_size=2",
    "parallel.pipeline_model_parallel_size=2",
    "parallel.sequence_parallel=false",
    "rollout.placement=colocated",
    "rollout.sglang.transport=distributed",
)
ONE_NODE = ("--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "141")


def engines(num: int, tp: int, base: int | None) -> tuple[str, ...]:
    """The overrides of ``num`` engines of TP ``tp`` from GPU ``base`` (None: placed for us)."""
    return (
        f"rollout.sglang.num_engines={num}",
        f"rollout.sglang.tp_size={tp}",
        f"rollout.sglang.base_gpu_id={'null' if base is None else base}",
    )


def _q8b(paths, *more: str) -> list[str]:
    """The 8B example's command line in the TP2 x PP2 layout, with ``more`` overrides."""
    return [Q8B, f"model.hf_checkpoint={paths['8b']}", *paths["data"], *TP2_PP2, *more]


def _config(paths, *more: str):
    """The 8B example's config as the launcher loads it, with ``more`` overrides (after TP2_PP2)."""
    config, *overrides = _q8b(paths, *more)
    return load_config(config, overrides)


@pytest.mark.parametrize(
    "tp, pp, cp, dp", [(1, 1, 1, 8), (2, 2, 1, 2), (1, 4, 1, 2), (2, 2, 2, 1), (8, 2, 1, 1)]
)
def test_nccl_sync_group_sending_ranks_are_megatrons_stage_senders(tp, pp, cp, dp):
    """``Senders.ranks`` is what the trainer sends from: per stage, TP rank 0 of the DP-rank-0,
    CP-rank-0 replica in Megatron's own rank order (its RankGenerator, as parallel_state uses)."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    stage = {r: g.index(r) for g in gen.get_ranks("pp") for r in g}
    first = set.intersection(*({g[0] for g in gen.get_ranks(k)} for k in ("tp", "dp", "cp")))
    expected = [[r for r in sorted(stage) if stage[r] == s and r in first] for s in range(pp)]
    assert all(len(ranks) == 1 for ranks in expected)  # one sender per stage
    senders = Senders(
        world_size=tp * pp * cp * dp, pipeline_model_parallel_size=pp, gpus_per_node=8
    )
    assert [[r] for r in senders.ranks] == expected


def test_nccl_sync_group_no_duplicate_gpu_tp2_pp2_one_node_places_engines_off_senders(
    capsys, paths
):
    """TP2 x PP2 on one 8-GPU node: stage 1's sender is global rank 4, on GPU 4. The launcher's
    automatic colocated placement (base_gpu_id null) keeps every engine off GPUs 0 and 4; the
    old one put engines on the node's last GPUs, 4-7.

    Precondition: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected", nccl src/init.cc; PLATFORM_NOTES.md, "GPU library contracts")."""
    for more, want in ((engines(2, 2, None), ["2,3", "6,7"]), (engines(4, 1, None), "3567")):
        # (4 x TP1: engines 0-3 on GPUs 3, 5, 6, 7)
        argv = _q8b(paths, *more)
        rc, out, err = dry_run(capsys, *argv, *ONE_NODE)
        assert rc == 0, err
        for e, gpus in enumerate(want):
            assert f"engine {e}: node1 GPUs {gpus} " in out
        assert "weight sync: sending ranks 0, 4 (one per pipeline stage) on GPU(s) 0, 4" in out
        assert set(commands(out)) == {"trainer", "rollout-0"}  # both roles on the one node


@pytest.mark.parametrize(
    "more, engine, gpu, fix",
    [
        # Pinned: the user's base_gpu_id puts engine 0 on GPUs 4,5.
        (engines(2, 2, 4), 0, 4, "base_gpu_id=null"),
        # Automatic, but a TP4 engine has no 4 free GPUs in a row off GPUs 0 and 4.
        (engines(1, 4, None), 0, 4, "has room for 0 engine(s)"),
    ],
)
def test_nccl_sync_group_no_duplicate_gpu_tp2_pp2_one_node_refuses_what_cannot_fit(
    capsys, paths, more, engine, gpu, fix
):
    """Where the engines cannot avoid the senders' GPUs, the dry-run refuses in one line naming
    the engine, the GPU, the sending rank there and what to change (the old launcher checked GPU 0
    only and accepted both).

    Precondition: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected", nccl src/init.cc; PLATFORM_NOTES.md, "GPU library contracts")."""
    line = refused(capsys, *_q8b(paths, *more), *ONE_NODE)
    assert f"engine {engine} would use GPU {gpu} of node1" in line
    assert "sending rank 4 (pipeline stage 1 of 2) runs" in line
    assert fix in line and "rollout.sglang.transport=tensor" in line


def test_nccl_sync_group_no_duplicate_gpu_tensor_transport_may_share(paths):
    """The tensor transport forms no NCCL group: one node, engines on the senders' GPUs too."""
    cfg = _config(
        paths,
        "rollout.sglang.transport=tensor",
        "rollout.sglang.num_engines=4",
        "rollout.sglang.base_gpu_id=0",
    )
    layout = plan_layout(cfg, SlurmEnv(nodes=("n1",), gpus_per_node=8, job_id=0))
    assert [e.gpus for e in layout.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert not any("one per pipeline stage" in n for n in layout.servers.notes)  # none kept off


def test_nccl_sync_group_no_duplicate_gpu_several_nodes_keeps_every_nodes_sender_gpus(paths):
    """Two nodes, PP4 (world 16): senders 0, 4, 8, 12 sit on GPUs 0 and 4 of whichever node
    torchrun ranks first or second, so both nodes keep GPUs 0 and 4 free.

    Precondition: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected", nccl src/init.cc; PLATFORM_NOTES.md, "GPU library contracts")."""
    cfg = _config(
        paths,
        "parallel.tensor_model_parallel_size=4",
        "parallel.pipeline_model_parallel_size=4",
        *engines(4, 2, None),
    )
    layout = plan_layout(cfg, SlurmEnv(nodes=("n1", "n2"), gpus_per_node=8, job_id=0))
    assert "sending ranks 0, 4, 8, 12 (one per pipeline stage) on GPU(s) 0, 4" in "".join(
        layout.servers.notes
    )
    assert [(e.node, e.gpus) for e in layout.engines] == [
        ("n1", (2, 3)), ("n2", (2, 3)), ("n1", (6, 7)), ("n2", (6, 7)),
    ]  # fmt: skip


def test_nccl_sync_group_free_blocks_fit_the_most_engines():
    """The automatic placement's blocks: TP-wide, from the node's last GPUs down, none holding
    a sender's GPU, as many as fit (greedy from the top is optimal for blocks of one width)."""
    assert free_engine_blocks(8, 1, {0, 4}) == [1, 2, 3, 5, 6, 7]
    assert free_engine_blocks(8, 2, {0, 4}) == [2, 6]
    assert free_engine_blocks(8, 4, {0, 4}) == []
    assert free_engine_blocks(8, 2, {0}) == [2, 4, 6]
    assert free_engine_blocks(8, 4, {0}) == [4]
    assert free_engine_blocks(8, 8, ()) == [0]


# -- the fleet's start-up check and the launcher: one rule ----------------------------------------


def _fleet_gpus(tmp_path, monkeypatch, cfg, pp: int):
    """The GPUs the in-process fleet (``SGLangFleet``, colocated, launching its own engines on a
    simulated 8-GPU node) gives each engine at start-up, or its refusal. Nothing is started: the
    launch, health wait and router are recorded instead."""
    import torch

    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.hf_mapping import hf_config
    from megatron_rl_fp8.rollout.errors import RolloutEngineError
    from megatron_rl_fp8.rollout.sglang import SGLangFleet

    launched = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(
        SGLangFleet, "_launch", lambda self, eng: launched.append(self._gpus[eng.index])
    )
    monkeypatch.setattr(SGLangFleet, "_wait_or_relaunch", lambda self, eng: None)
    monkeypatch.setattr(SGLangFleet, "_launch_router", lambda self: None)
    monkeypatch.setattr(SGLangFleet, "shutdown", lambda self: None)
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun's, on the one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    sg = dataclasses.replace(
        cfg.rollout.sglang, python="", device="cuda", work_dir=str(tmp_path)
    )  # this interpreter (nothing runs), GPU engines
    rollout = dataclasses.replace(cfg.rollout, sglang=sg)
    try:
        SGLangFleet(
            rollout,
            hf_config(ModelConfig(vocab_size=53)),
            pad_token_id=0,
            eos_token_id=2,
            senders=Senders.from_env(pp),
        )
    except RolloutEngineError as e:
        return str(e)
    return launched


@pytest.mark.parametrize(
    "overrides",
    [
        engines(2, 2, None),  # placed: GPUs 2,3 and 6,7
        engines(4, 1, None),  # placed: GPUs 3, 5, 6, 7
        engines(2, 2, 4),  # refused: engine 0 on stage 1's sender GPU
        engines(1, 4, None),  # refused: no room
        engines(3, 2, 2),  # refused: engine 1 on GPUs 4,5
        # PP1 (TP4 x DP2): only the driver sends; GPUs 4-7 are free.
        ("parallel.pipeline_model_parallel_size=1", "parallel.tensor_model_parallel_size=4",
         *engines(2, 2, None)),
    ],
)  # fmt: skip
def test_nccl_sync_group_no_duplicate_gpu_fleet_and_launcher_agree(
    tmp_path, monkeypatch, paths, overrides
):
    """The fleet's start-up placement and check (in-process engines on the driver's node) give
    every engine the launcher's GPUs on one node, and refuse exactly what the launcher refuses,
    naming the same engine, GPU and sending rank (one shared rule, ``engine_gpus_on_node``).

    Precondition: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected", nccl src/init.cc; PLATFORM_NOTES.md, "GPU library contracts")."""
    cfg = _config(paths, *overrides)
    pp = cfg.parallel.pipeline_model_parallel_size
    try:
        layout = plan_layout(cfg, SlurmEnv(nodes=("n1",), gpus_per_node=8, job_id=0))
        launcher = [e.gpus for e in layout.engines]
    except ConfigError as e:
        launcher = str(e)
    fleet = _fleet_gpus(tmp_path, monkeypatch, cfg, pp)
    if isinstance(launcher, str):
        assert fleet == "rollout.sglang: " + launcher.replace(" of n1,", " of this node,")
    else:
        assert fleet == launcher
        busy = set(Senders(world_size=8, pipeline_model_parallel_size=pp, gpus_per_node=8).gpus)
        assert not busy & {g for gpus in fleet for g in gpus}


def test_nccl_sync_group_no_duplicate_gpu_plan_notes_what_the_launcher_refuses(capsys, paths):
    """``megatron-rl-fp8 plan`` counts the config's engines; where the launcher's placement
    refuses them (an engine pinned onto stage 1's sender GPU), the plan says so with the
    launcher's own line, and says nothing where the launcher places them.

    Precondition: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected", nccl src/init.cc; PLATFORM_NOTES.md, "GPU library contracts")."""
    from megatron_rl_fp8 import cli

    pinned = engines(2, 2, 4)
    argv = ["plan", *_q8b(paths, *pinned), "--nodes", "1", "--gpu-memory-gb", "141"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    with pytest.raises(ConfigError) as e:
        plan_layout(_config(paths, *pinned), SlurmEnv(nodes=("node1",), gpus_per_node=8, job_id=0))
    assert (
        f"note: `megatron-rl-fp8 launch` would refuse this run's engines on these GPUs: {e.value}"
        in out
    )
    argv[argv.index("rollout.sglang.base_gpu_id=4")] = "rollout.sglang.base_gpu_id=null"
    assert cli.main(argv) == 0
    assert "would refuse" not in capsys.readouterr().out


def test_nccl_one_rank_per_gpu_local_rank_refused_past_the_gpus():
    """NCCL refuses two ranks of one communicator on one GPU (nccl ``src/init.cc:
    initTransportsRank``, "Duplicate GPU detected"): a torchrun job with more ranks per node than
    visible GPUs is refused at start-up in one line, not wrapped onto shared GPUs."""
    from megatron_rl_fp8.parallel import local_gpu

    assert [local_gpu(r, 8, "nccl") for r in range(8)] == list(range(8))
    with pytest.raises(RuntimeError, match="LOCAL_RANK=8 but this node shows 8 GPU") as e:
        local_gpu(8, 8, "nccl")
    assert "\n" not in str(e.value)
    assert local_gpu(3, 2, "gloo") == 1  # gloo ranks may share a device
