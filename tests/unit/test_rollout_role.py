"""The rollout role of a Slurm job (megatron_rl_fp8/rollout/sglang/role.py): which engines, ports
and GPUs node K runs, and the exact commands it starts, checked against the URLs the dry-run
gives the trainer. Pure: nothing is started (the end-to-end check is manual, see the role's
docstring)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_rl_fp8.config import EXAMPLES_DIR, load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.launch.cli import main, node_index
from megatron_rl_fp8.launch.layout import Ports, node_role, plan_layout
from megatron_rl_fp8.launch.render import trainer_overrides
from megatron_rl_fp8.launch.slurm import read_env
from megatron_rl_fp8.rollout.sglang.role import listen_host, node_dir, role_commands

TINY = str(EXAMPLES_DIR / "tiny_cpu.yaml")
SGLANG = ("rollout.engine=sglang", 'rollout.sglang.python=""')


def layout_for(nodes: str, gpus: int, *overrides: str, train_nodes=None, addrs=None, job_id=7):
    cfg = load_config(TINY, [*SGLANG, *overrides])
    env = read_env({}, nodelist=nodes, gpus_per_node=gpus, job_id=job_id)
    return cfg, plan_layout(cfg, env, addrs=addrs, train_nodes=train_nodes)


def commands(cfg, layout, k, device="cuda"):
    return role_commands(
        node_role(layout, k),
        cfg.rollout.sglang,
        python="/py",
        model_dir=Path("/m"),
        device=device,
        dtype="bfloat16",
        fp8_checkpoint=False,
        colocated=layout.placement == "colocated",
    )


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_four_nodes_two_rollout_nodes_split_the_engines():
    """4 engines x TP 2 over rollout nodes n3, n4: round robin, the router on n3 with all four."""
    cfg, layout = layout_for(
        "n[1-4]",
        8,
        "rollout.sglang.num_engines=4",
        "rollout.sglang.tp_size=2",
        train_nodes=2,
        addrs={"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3", "n4": "10.0.0.4"},
    )
    base = Ports.for_job(7).base
    r2, r3 = node_role(layout, 2), node_role(layout, 3)
    assert [e.index for e in r2.engines] == [0, 2] and [e.index for e in r3.engines] == [1, 3]
    assert [e.gpus for e in r2.engines] == [(0, 1), (2, 3)]
    assert r2.router_url == f"http://10.0.0.3:{base + 1}" and r3.router_url is None

    cmds = commands(cfg, layout, 2)
    assert [c.name for c in cmds] == ["engine0", "engine2", "router"]
    e0, e2, router = (list(c.argv) for c in cmds)
    assert e0[:3] == ["/py", "-m", "sglang.launch_server"]
    assert flag(e0, "--host") == "10.0.0.3"  # the node's address, not 127.0.0.1
    assert (flag(e0, "--port"), flag(e2, "--port")) == (str(base + 10), str(base + 20))
    assert (flag(e0, "--base-gpu-id"), flag(e2, "--base-gpu-id")) == ("0", "2")
    assert flag(e0, "--tp-size") == "2" and flag(e0, "--model-path") == "/m"
    assert flag(e0, "--load-format") == "dummy" and "--enable-metrics" in e0
    assert flag(e0, "--weight-version") == "-1" and "--enable-memory-saver" not in e0
    assert router[:3] == ["/py", "-m", "sglang_router.launch_router"]
    assert flag(router, "--port") == str(base + 1) and flag(router, "--host") == "10.0.0.3"
    workers = router[router.index("--worker-urls") + 1 :]
    assert workers == layout.engine_urls  # every engine of the job, n4's included

    # What node 2 serves is exactly what the trainer is told to attach to.
    urls = {c.url for k in (2, 3) for c in commands(cfg, layout, k)}
    attach = trainer_overrides(layout)
    assert urls == {*layout.engine_urls, layout.router_url}
    assert attach[1] == 'rollout.sglang.engine_nodes=["n3","n4","n3","n4"]'
    assert attach[2] == f"rollout.sglang.router_url={layout.router_url}"
    assert [c.name for c in commands(cfg, layout, 3)] == ["engine1", "engine3"]


def test_one_engine_no_router_and_a_cpu_engine():
    cfg, layout = layout_for("n[1-2]", 1, train_nodes=1, addrs={"n1": "a", "n2": "127.0.0.1"})
    (cmd,) = commands(cfg, layout, 1, device="cpu")
    argv = list(cmd.argv)
    assert cmd.name == "engine0" and cmd.url == layout.engine_urls[0]
    assert flag(argv, "--device") == "cpu" and "--base-gpu-id" not in argv  # CPU: no GPU index
    assert flag(argv, "--host") == "127.0.0.1"


def test_colocated_engines_take_the_last_gpus_and_save_memory():
    cfg, layout = layout_for(
        "n[1-2]", 4, "rollout.placement=colocated", "rollout.sglang.num_engines=2"
    )
    cmds = commands(cfg, layout, 0)
    assert [c.name for c in cmds] == ["engine0", "router"]
    argv = list(cmds[0].argv)
    assert flag(argv, "--base-gpu-id") == "3" and "--enable-memory-saver" in argv
    assert [c.name for c in commands(cfg, layout, 1)] == ["engine1"]


def test_nodes_without_a_rollout_role_are_refused():
    _, layout = layout_for("n[1-2]", 1, train_nodes=1)
    with pytest.raises(ConfigError, match=r"node 0 \(n1\) runs no rollout role"):
        node_role(layout, 0)
    with pytest.raises(ConfigError, match="indices 0..1"):
        node_role(layout, 5)


@pytest.mark.parametrize(
    "configured,addr,expected",
    [
        ("127.0.0.1", "10.1.2.3", "10.1.2.3"),  # scontrol's NodeAddr
        ("127.0.0.1", "gpu-a01", "0.0.0.0"),  # a name may resolve to 127.0.1.1 at home
        ("127.0.0.1", "fd00::3", "fd00::3"),
        ("0.0.0.0", "10.1.2.3", "0.0.0.0"),  # chosen by the user
        ("10.9.9.9", "gpu-a01", "10.9.9.9"),
    ],
)
def test_listen_host(configured, addr, expected):
    assert listen_host(configured, addr) == expected


def test_node_index_from_flag_or_slurm():
    nodes = ("n1", "n2", "n3")
    assert node_index(2, nodes, {"SLURMD_NODENAME": "n1"}) == 2
    assert node_index(None, nodes, {"SLURMD_NODENAME": "n3", "SLURM_NODEID": "0"}) == 2
    assert node_index(None, nodes, {"SLURM_NODEID": "1"}) == 1
    with pytest.raises(ConfigError, match="--node-index"):
        node_index(None, nodes, {})


def test_node_dir():
    cfg = load_config(TINY, [*SGLANG, "train.output_dir=/runs/x"])
    assert node_dir(cfg, 3) == Path("/runs/x/sglang/node3")
    cfg.rollout.sglang = dataclasses.replace(cfg.rollout.sglang, work_dir="/scratch/e")
    assert node_dir(cfg, 3) == Path("/scratch/e/node3")


def test_cli_rollout_role_refusals_are_one_line(capsys):
    """Without --dry-run only the rollout role runs; a node that serves nothing, or an address
    that is not this host's, is refused before anything starts."""
    job = ["--nodelist", "n[1-2]", "--gpus-per-node", "1", "--train-nodes", "1"]
    assert main([TINY, *SGLANG, *job, "--role", "trainer"], environ={}) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert main([TINY, *SGLANG, *job, "--role", "rollout", "--node-index", "0"], environ={}) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "node 0 (n1) runs no rollout role" in line
    far = ["--node-addrs", "n1=198.51.100.1,n2=198.51.100.2"]  # TEST-NET-2
    rc = main([TINY, *SGLANG, *job, *far, "--role", "rollout", "--node-index", "1"], environ={})
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and "address 198.51.100.2 in the layout, which is not an address of this host" in line
    )
