"""The Slurm launcher (megatron_rl_fp8/launch, slurm/train.sbatch): node lists expanded as Slurm
prints them, the roles of simulated 2-, 4- and 8-node jobs and their exact commands, bad layouts
refused with one line before anything starts, and the sbatch script (shellcheck, and its
signal / requeue flow against stub srun and scontrol)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl_fp8.config import EXAMPLES_DIR, load_config, parse_override, read_config_dict
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.launch import REQUEUE_EXIT_CODE
from megatron_rl_fp8.launch.cli import main
from megatron_rl_fp8.launch.layout import Ports, check_run, plan_layout
from megatron_rl_fp8.launch.render import RenderOptions, render
from megatron_rl_fp8.launch.slurm import (
    expand_nodelist,
    gpus_from_env,
    parse_scontrol_nodes,
    read_env,
    read_node_addrs,
)

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"
TINY = str(EXAMPLES_DIR / "tiny_cpu.yaml")
Q8B = str(EXAMPLES_DIR / "qwen3_8b_grpo_math.yaml")
Q32B = str(EXAMPLES_DIR / "qwen3_32b_dapo_math_fp8.yaml")
# The tiny run with SGLang engines, served by this interpreter (no .venv-sglang needed).
TINY_SGLANG = (
    "rollout.engine=sglang",
    'rollout.sglang.python=""',
    "rollout.sglang.transport=distributed",
)

# What `scontrol show hostnames` (Slurm 22.05) prints for each form.
NODELISTS = {
    "n[1-3,7],gpu-a[01-02],x": "n1 n2 n3 n7 gpu-a01 gpu-a02 x",
    "rack[1-2]-n[01-02]": "rack1-n01 rack1-n02 rack2-n01 rack2-n02",
    "x[1,3-4]y[7]": "x1y7 x3y7 x4y7",
    "n[8-11]": "n8 n9 n10 n11",
    "n[008-10]": "n008 n009 n010",
    "n[09-010]": "n09 n10",
    "gpu[001-003,010]": "gpu001 gpu002 gpu003 gpu010",
    "n[3,1]": "n3 n1",
    "n1,,n2": "n1 n2",
    "a-1,b_2": "a-1 b_2",
    "single": "single",
}


# -- node lists and the Slurm environment ---------------------------------------------------------


@pytest.mark.parametrize("text", sorted(NODELISTS))
def test_nodelist_expands_as_slurm_prints_it(text):
    assert expand_nodelist(text) == NODELISTS[text].split()


def test_nodelist_matches_real_scontrol(tmp_path):
    """The same forms through the real `scontrol show hostnames`, where Slurm is installed."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for text, expected in NODELISTS.items():
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", text], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            pytest.skip(f"scontrol cannot run here: {proc.stderr.strip()[:200]}")
        assert proc.stdout.split() == expected.split() == expand_nodelist(text), text


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[a-b]", "n[]", "n[2-1]", "n[[1]]", ","])
def test_malformed_nodelist_is_one_line(text):
    with pytest.raises(ConfigError) as e:
        expand_nodelist(text)
    assert "\n" not in str(e.value) and "node list" in str(e.value)


def test_gpus_per_node_fallbacks():
    assert gpus_from_env({"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_GPUS": "0,1"}) == 8
    assert gpus_from_env({"SLURM_GPUS_PER_NODE": "h100:4"}) == 4
    assert gpus_from_env({"SLURM_JOB_GPUS": "0,1,2,3,4,5"}) == 6
    assert gpus_from_env({}) is None


def test_zero_gpus_per_node_names_the_flag():
    with pytest.raises(ConfigError, match="--gpus-per-node 0: give a count from 1 to 64"):
        read_env({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "8"}, gpus_per_node=0)


def test_env_is_read_and_flags_override_it():
    slurm = {
        "SLURM_JOB_ID": "4711",
        "SLURM_JOB_NODELIST": "gpu-a[01-04]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_NODEID": "2",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_CPUS_ON_NODE": "96",
    }
    env = read_env(slurm)
    assert env.nodes == ("gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04") and env.in_job
    assert (env.gpus_per_node, env.job_id, env.node_id, env.restart_count) == (8, 4711, 2, 1)
    assert env.cpus_per_node == 96
    flags = read_env(slurm, nodelist="n[1-2]", nodes=2, gpus_per_node=4, job_id=5)
    assert (flags.nodes, flags.gpus_per_node, flags.job_id) == (("n1", "n2"), 4, 5)
    assert read_env({}, nodes=3, gpus_per_node=1).nodes == ("node1", "node2", "node3")
    with pytest.raises(ConfigError, match="SLURM_JOB_NUM_NODES"):
        read_env({**slurm, "SLURM_JOB_NUM_NODES": "3"})
    with pytest.raises(ConfigError, match="--gpus-per-node"):
        read_env({"SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(ConfigError, match="twice"):
        read_env({}, nodelist="n[1-2],n1", gpus_per_node=1)


def test_node_addresses_from_scontrol_output_or_pairs(tmp_path):
    out = (
        "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=box Port=16818\n"
        "NodeName=n2 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.3 NodeHostName=box Port=16819\n"
    )
    assert parse_scontrol_nodes(out) == {"n1": "127.0.0.1", "n2": "10.1.2.3"}
    saved = tmp_path / "nodes.txt"
    saved.write_text(out)
    assert read_node_addrs(f"@{saved}", ("n1", "n2")) == {"n1": "127.0.0.1", "n2": "10.1.2.3"}
    assert read_node_addrs("n1=a,n2=b", ("n1", "n2")) == {"n1": "a", "n2": "b"}
    assert read_node_addrs("", ("n1",)) == {"n1": "n1"}
    with pytest.raises(ConfigError, match="no address for node 'n2'"):
        read_node_addrs("n1=a", ("n1", "n2"))


# -- simulated jobs: roles and commands -----------------------------------------------------------


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """For the 8B / 32B examples: a Hugging Face folder with their config.json (no weights) and
    empty prompt files, standing in for /models and /data."""
    root = tmp_path_factory.mktemp("launch")
    out = {}
    for name, example in (("8b", Q8B), ("32b", Q32B)):
        m = read_config_dict(example)["model"]
        hf = root / name
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(_hf_config(m)))
        out[name] = str(hf)
    for split in ("train", "val"):
        (root / f"{split}.parquet").touch()
    out["data"] = [
        f"task.train_path={root / 'train.parquet'}",
        f"task.val_path={root / 'val.parquet'}",
    ]
    return out


def _hf_config(m: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": m["num_layers"],
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["ffn_hidden_size"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_query_groups"],
        "head_dim": m["head_dim"],
        "vocab_size": m["vocab_size"],
        "max_position_embeddings": m["max_position_embeddings"],
        "tie_word_embeddings": m["tie_word_embeddings"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
    }


def overrides_for(size: str, paths, *more: str) -> list[str]:
    """The example's run on whole Slurm nodes: dedicated engines, placed by the launcher."""
    return [
        f"model.hf_checkpoint={paths[size]}",
        *paths["data"],
        "rollout.placement=dedicated",
        "rollout.sglang.num_engines=1",  # the examples' 0 (every TP group) is for colocated runs
        "rollout.sglang.base_gpu_id=null",
        "rollout.sglang.transport=distributed",
        *more,
    ]


def dry_run(capsys, *argv: str, environ: dict | None = None) -> tuple[int, str, str]:
    rc = main(["--dry-run", *argv], environ=environ or {})
    out, err = capsys.readouterr()
    return rc, out, err


def commands(out: str) -> dict[str, list[str]]:
    """The printed commands by role name, each as argv."""
    lines = out.splitlines()
    return {
        line[2:].split(" ")[0]: shlex.split(lines[i + 1])
        for i, line in enumerate(lines)
        if line.startswith("# ")
    }


def torchrun_args(argv: list[str]) -> dict[str, str]:
    i = next(i for i, a in enumerate(argv) if a.endswith("torchrun"))
    tail = argv[i + 1 :]
    return {a: tail[j + 1] for j, a in enumerate(tail) if a.startswith("--")}


def train_overrides(argv: list[str]) -> dict[str, object]:
    i = argv.index("train")
    return dict(parse_override(a) for a in argv[i + 2 :])


def test_two_nodes_tiny_run_trainer_and_engine(capsys):
    rc, out, err = dry_run(
        capsys,
        TINY,
        *TINY_SGLANG,
        "--nodelist",
        "n[1-2]",
        "--gpus-per-node",
        "1",
        "--job-id",
        "4242",
        "--node-addrs",
        "n1=10.0.0.1,n2=10.0.0.2",
    )
    assert rc == 0, err
    cmds = commands(out)
    assert set(cmds) == {"trainer", "rollout-1"}
    base = Ports.for_job(4242).base
    t = torchrun_args(cmds["trainer"])
    assert t["--nnodes"] == "1" and t["--nproc-per-node"] == "1"
    assert t["--rdzv-endpoint"] == f"10.0.0.1:{base}" and t["--rdzv-id"] == "4242"
    assert "SIGUSR1" in t["--signals-to-handle"]
    assert "--nodelist=n1" in cmds["trainer"]
    urls = train_overrides(cmds["trainer"])["rollout.sglang.engine_urls"]
    assert urls == [f"http://10.0.0.2:{base + 10}"]  # one engine: no router
    assert "rollout.sglang.router_url" not in train_overrides(cmds["trainer"])
    r = cmds["rollout-1"]
    assert "--nodelist=n2" in r and r[r.index("--role") + 1] == "rollout"
    assert r[r.index("--node-index") + 1] == "1" and r[r.index("--train-nodes") + 1] == "1"
    assert "TRAIN_NODES unset" in out


def test_two_nodes_8b_dedicated(capsys, paths):
    rc, out, err = dry_run(
        capsys,
        Q8B,
        *overrides_for("8b", paths, "rollout.sglang.num_engines=4"),
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--train-nodes",
        "1",
        "--job-id",
        "123",
    )
    assert rc == 0, err
    cmds = commands(out)
    t = torchrun_args(cmds["trainer"])
    assert (t["--nnodes"], t["--nproc-per-node"]) == ("1", "8")
    assert t["--rdzv-endpoint"].startswith("node1:")
    attach = train_overrides(cmds["trainer"])
    base = Ports.for_job(123).base
    assert attach["rollout.sglang.router_url"] == f"http://node2:{base + 1}"
    assert attach["rollout.sglang.engine_urls"] == [
        f"http://node2:{base + 10 + 10 * slot}" for slot in range(4)
    ]
    assert "engine 3: node2 GPUs 6,7" in out
    assert "TP 4 x PP 1 x CP 1 x DP 2" in out


def test_four_nodes_32b_from_the_slurm_environment(paths):
    """Roles from SLURM_* variables, engines dealt over the two rollout nodes."""
    env = read_env(
        {
            "SLURM_JOB_ID": "98765",
            "SLURM_JOB_NODELIST": "gpu-a[01-04]",
            "SLURM_JOB_NUM_NODES": "4",
            "SLURM_GPUS_ON_NODE": "8",
        }
    )
    addrs = {n: f"10.0.0.{i + 1}" for i, n in enumerate(env.nodes)}
    more = overrides_for("32b", paths, "rollout.sglang.num_engines=4")
    cfg = load_config(Q32B, more)
    layout = plan_layout(cfg, env, addrs=addrs)  # TRAIN_NODES derived: 4 x TP 4 = 2 nodes
    assert layout.train_nodes == ("gpu-a01", "gpu-a02")
    assert layout.rollout_nodes == ("gpu-a03", "gpu-a04")
    assert [(e.node, e.gpus) for e in layout.engines] == [
        ("gpu-a03", (0, 1, 2, 3)),
        ("gpu-a04", (0, 1, 2, 3)),
        ("gpu-a03", (4, 5, 6, 7)),
        ("gpu-a04", (4, 5, 6, 7)),
    ]
    assert layout.router_url.startswith("http://10.0.0.3:")
    est = check_run(cfg, layout, config_name=Q32B, gpu_memory_gb=141)
    assert est.fits and est.layout.dp == 1
    cmds = {
        c.name: list(c.argv)
        for c in render(layout, RenderOptions(config=Q32B, overrides=tuple(more)))
    }
    assert set(cmds) == {"trainer", "rollout-2", "rollout-3"}
    t = torchrun_args(cmds["trainer"])
    assert t["--nnodes"] == "2" and t["--rdzv-endpoint"] == f"10.0.0.1:{layout.ports.rdzv}"
    assert t["--rdzv-id"] == "98765"
    assert "--nodelist=gpu-a01,gpu-a02" in cmds["trainer"]
    # The overrides the trainer gets load back into the engines' URLs.
    trainer_cfg = load_config(Q32B, cmds["trainer"][cmds["trainer"].index("train") + 2 :])
    assert trainer_cfg.rollout.sglang.engine_urls == layout.engine_urls
    assert all(u.startswith(("http://10.0.0.3:", "http://10.0.0.4:")) for u in layout.engine_urls)


def test_eight_nodes_mixed_nodelist(capsys, paths):
    nodelist = "n[1-3,7],gpu-a[01-02],x[1-2]"
    environ = {
        "SLURM_JOB_ID": "31337",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": "8",
        "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
        "TRAIN_NODES": "4",
    }
    more = ("rollout.sglang.num_engines=8",)
    rc, out, err = dry_run(
        capsys, Q32B, *overrides_for("32b", paths, *more), "--gpu-memory-gb", "141", environ=environ
    )
    assert rc == 0, err
    cmds = commands(out)
    assert set(cmds) == {"trainer", "rollout-4", "rollout-5", "rollout-6", "rollout-7"}
    t = torchrun_args(cmds["trainer"])
    assert (t["--nnodes"], t["--nproc-per-node"]) == ("4", "8")
    assert t["--rdzv-endpoint"].startswith("n1:")
    assert "--nodelist=n1,n2,n3,n7" in cmds["trainer"]
    urls = train_overrides(cmds["trainer"])["rollout.sglang.engine_urls"]
    hosts = [u.split("//")[1].split(":")[0] for u in urls]
    assert hosts == ["gpu-a01", "gpu-a02", "x1", "x2"] * 2
    assert len(set(urls)) == 8
    assert "TP 8 x PP 2 x CP 1 x DP 2" in out


def test_colocated_every_node_trains_and_serves(capsys, paths):
    """The 8B example colocated with the distributed transport: 2 engines of TP 2 from GPU 6 on
    2 nodes."""
    more = [f"model.hf_checkpoint={paths['8b']}", *paths["data"], "rollout.sglang.num_engines=2",
            "rollout.sglang.transport=distributed", "rollout.sglang.base_gpu_id=6"]  # fmt: skip
    rc, out, err = dry_run(capsys, Q8B, *more, "--nodes", "2", "--gpus-per-node", "8")
    assert rc == 0, err
    cmds = commands(out)
    assert set(cmds) == {"trainer", "rollout-0", "rollout-1"}
    assert torchrun_args(cmds["trainer"])["--nnodes"] == "2"
    assert all("--overlap" in argv for argv in cmds.values())
    assert "engine 0: node1 GPUs 6,7" in out and "engine 1: node2 GPUs 6,7" in out
    assert train_overrides(cmds["trainer"])["rollout.sglang.router_url"].startswith("http://node1:")


def test_local_engine_trains_on_every_node(capsys):
    rc, out, err = dry_run(capsys, TINY, "--nodes", "2", "--gpus-per-node", "1")
    assert rc == 0, err
    cmds = commands(out)
    assert set(cmds) == {"trainer"}
    assert torchrun_args(cmds["trainer"])["--nnodes"] == "2"
    assert "rollout.sglang.engine_urls" not in " ".join(cmds["trainer"])


def test_write_scripts_for_the_sbatch(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, _, err = dry_run(
        capsys, TINY, *TINY_SGLANG, "--nodes", "2", "--gpus-per-node", "1",
        "--write-scripts", str(out_dir),
    )  # fmt: skip
    assert rc == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "commands.txt",
        "rollout-1.sh",
        "trainer.sh",
    ]
    trainer = (out_dir / "trainer.sh").read_text()
    assert os.access(out_dir / "trainer.sh", os.X_OK) and "\nexec srun " in trainer
    assert f"--output={out_dir}/trainer-%N.log" in trainer


def test_write_record_goes_into_the_run_directory(capsys, tmp_path, monkeypatch):
    """The sbatch's default: the record sits in the run's own directory, one folder per restart,
    with the node addresses it was given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nodes.txt").write_text(
        "NodeName=n1 NodeAddr=10.0.0.1\nNodeName=n2 NodeAddr=10.0.0.2\n"
    )
    rc, out, err = dry_run(
        capsys, TINY, *TINY_SGLANG, "train.output_dir=runs/mine", "--nodelist", "n[1-2]",
        "--gpus-per-node", "1", "--job-id", "31", "--node-addrs", "@nodes.txt", "--write-record",
    )  # fmt: skip
    assert rc == 0, err
    record = tmp_path / "runs" / "mine" / "slurm" / "31" / "restart-0"
    assert out.splitlines()[-1] == f"record: {record}"
    assert sorted(p.name for p in record.iterdir()) == [
        "commands.txt", "nodes.txt", "rollout-1.sh", "trainer.sh",
    ]  # fmt: skip
    assert "NodeAddr=10.0.0.2" in (record / "nodes.txt").read_text()
    assert f"--output={record}/rollout-1-%N.log" in (record / "rollout-1.sh").read_text()
    rc, _, err = dry_run(
        capsys, TINY, "--nodes", "1", "--gpus-per-node", "1", "--write-record",
        "--write-scripts", "x",
    )  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and "pick one" in err


def test_role_filter_prints_one_node(capsys):
    base = [TINY, *TINY_SGLANG, "--nodes", "2", "--gpus-per-node", "1", "--role", "rollout"]
    rc, out, _ = dry_run(capsys, *base, "--node-index", "1")
    assert rc == 0 and set(commands(out)) == {"rollout-1"}
    rc, _, err = dry_run(capsys, *base, "--node-index", "0")
    assert rc == 2 and "node 0 runs no rollout role" in err


# -- bad layouts: one line, exit 2, before anything starts ---------------------------------------


def refused(capsys, *argv: str, environ: dict | None = None) -> str:
    rc, out, err = dry_run(capsys, *argv, environ=environ)
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("launch error: ")
    return line


def test_gpus_that_do_not_match_the_parallel_layout(capsys, paths):
    line = refused(
        capsys, Q32B, *overrides_for("32b", paths),
        "--nodes", "2", "--gpus-per-node", "8", "--train-nodes", "1",
    )  # fmt: skip
    assert "1 trainer node(s) x 8 GPUs = 8 ranks" in line
    assert "parallel.tensor_model_parallel_size (8)" in line


def test_engines_that_do_not_fit_the_rollout_nodes(capsys, paths):
    line = refused(
        capsys, Q8B, *overrides_for("8b", paths, "rollout.sglang.num_engines=5"),
        "--nodes", "2", "--gpus-per-node", "8", "--train-nodes", "1",
    )  # fmt: skip
    assert "rollout.sglang.num_engines=5 x rollout.sglang.tp_size=2 = 10 GPUs" in line
    # base_gpu_id=6 leaves one engine per rollout node.
    line = refused(
        capsys, Q8B, *overrides_for("8b", paths, "rollout.sglang.base_gpu_id=6"),
        "rollout.sglang.num_engines=2",
        "--nodes", "2", "--gpus-per-node", "8", "--train-nodes", "1",
    )  # fmt: skip
    assert "base_gpu_id=6" in line


@pytest.mark.parametrize(
    "override, field",
    [
        ("task.train_path=/nonexistent/train.jsonl", "task.train_path"),
        ("model.hf_checkpoint=/nonexistent/Qwen3-8B", "model.hf_checkpoint"),
        ("rollout.sglang.python=/nonexistent/bin/python", "rollout.sglang.python"),
    ],
)
def test_missing_paths(capsys, override, field):
    line = refused(
        capsys, TINY, *TINY_SGLANG[::2], override, "--nodes", "2", "--gpus-per-node", "1"
    )
    assert field in line


def test_plan_says_it_does_not_fit(capsys, paths):
    line = refused(
        capsys, Q32B, *overrides_for("32b", paths),
        "--nodes", "4", "--gpus-per-node", "8", "--train-nodes", "2", "--gpu-memory-gb", "40",
    )  # fmt: skip
    assert line.startswith("launch error: memory:") and "megatron-rl-fp8 plan" in line


@pytest.mark.parametrize(
    "argv, needle",
    [
        ((*TINY_SGLANG, "--nodes", "2", "--gpus-per-node", "1", "--train-nodes", "2"), "TRAIN_NODES=2"),
        (("--nodes", "2", "--gpus-per-node", "1", "--train-nodes", "1"), "rollout.engine=local"),
        ((*TINY_SGLANG, "--nodes", "1", "--gpus-per-node", "1"), "leaving none for the trainer"),
        ((*TINY_SGLANG, "rollout.sglang.engine_urls=[http://h:1]", "--nodes", "2"), "remove them"),
        ((*TINY_SGLANG, "rollout.sglang.tp_size=2", "--nodes", "2", "--gpus-per-node", "1"), "tp_size=2"),
        (("rollout.engine=sglang", "rollout.sglang.transport=tensor", "--nodes", "2"), "transport=distributed"),
        ((*TINY_SGLANG, "rollout.placement=colocated", "rollout.sglang.transport=tensor", "rollout.sglang.num_engines=0", "rollout.sglang.tp_size=3", "--nodes", "2", "--gpus-per-node", "8"), "does not divide"),
        (("--nodelist", "n[1-2", "--gpus-per-node", "1"), "never closed"),
        (("--gpus-per-node", "1"), "no node list"),
        # Issue 44 #2: sizes past any cluster are refused at once (they used to run for minutes).
        (("--nodes", "100000", "--gpus-per-node", "1"), "--nodes 100000: give a count from 1 to 4096"),
        (("--nodes", "2", "--gpus-per-node", "99999999999999999999999"), "give a count from 1 to 64"),
        (("--nodelist", "n[1-100000000]", "--gpus-per-node", "1"), "names more than 4096 nodes"),
        (("--nodelist", "r[1-100]-n[1-100]", "--gpus-per-node", "1"), "more than 4096 nodes"),
    ],
)  # fmt: skip
def test_bad_splits(capsys, argv, needle):
    assert needle in refused(capsys, TINY, *argv, environ={"SLURM_GPUS_ON_NODE": "1"})


def test_colocated_engine_on_the_driver_gpu_is_refused(capsys, paths):
    more = [f"model.hf_checkpoint={paths['8b']}", *paths["data"], "rollout.sglang.base_gpu_id=null",
            "rollout.sglang.transport=distributed"]  # fmt: skip
    line = refused(
        capsys, Q8B, *more, "rollout.sglang.num_engines=8", "--nodes", "2", "--gpus-per-node", "8"
    )
    assert "GPU 0 of node1" in line


# -- an engine on every TP group (rollout.sglang.num_engines=0, rollout/sglang/placement.py) ---


def test_dry_run_places_an_engine_on_every_tp_group_of_the_8b_example(capsys, paths):
    """The 8B example on its one node: 4 TP 2 engines on GPUs 0-1 .. 6-7, synced over CUDA IPC,
    and the trainer attaches to the 4 of them."""
    more = [f"model.hf_checkpoint={paths['8b']}", *paths["data"]]
    rc, out, err = dry_run(capsys, Q8B, *more, "--nodes", "1", "--gpus-per-node", "8")
    assert rc == 0, err
    assert "rollout: 4 engine(s) x TP 2 on node1" in out
    assert "num_engines=0: an engine on every TP group of every node, 4 per node x 1 node(s)" in out
    for e, gpus in enumerate(("0,1", "2,3", "4,5", "6,7")):
        assert f"engine {e}: node1 GPUs {gpus} " in out
    assert "weight sync: rollout.sglang.transport=tensor" in out
    attach = train_overrides(commands(out)["trainer"])
    assert attach["rollout.sglang.num_engines"] == 4
    assert len(attach["rollout.sglang.engine_urls"]) == 4


def test_dry_run_of_the_32b_example_on_two_nodes(capsys, paths, monkeypatch):
    """Refused until the per-node sync lands; then 4 TP 4 engines, 2 on each node's 8 GPUs."""

    more = [f"model.hf_checkpoint={paths['32b']}", *paths["data"]]
    job = ("--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gb", "141")
    # The distributed transport instead: one engine per node, off GPU 0.
    broadcast = ("rollout.sglang.transport=distributed", "rollout.sglang.num_engines=2")
    rc, out, err = dry_run(capsys, Q32B, *more, *broadcast, *job)
    assert rc == 0, err
    assert "engine 0: node1 GPUs 4,5,6,7" in out and "engine 1: node2 GPUs 4,5,6,7" in out
    rc, out, err = dry_run(capsys, Q32B, *more, *job)
    assert rc == 0, err
    assert "4 engine(s) x TP 4 on node1,node2" in out and "2 per node x 2 node(s)" in out
    for e, where in enumerate(("node1 GPUs 0,1,2,3", "node2 GPUs 0,1,2,3",
                               "node1 GPUs 4,5,6,7", "node2 GPUs 4,5,6,7")):  # fmt: skip
        assert f"engine {e}: {where} " in out
    assert set(commands(out)) == {"trainer", "rollout-0", "rollout-1"}


@pytest.mark.parametrize(
    "more, needle",
    [
        (("rollout.sglang.transport=distributed",),
         "puts engine 0 on GPU 0 of node1, where sending rank 0"),
        (("rollout.sglang.transport=distributed",), "or rollout.sglang.num_engines=3 (off those"),
        (("rollout.sglang.base_gpu_id=6",), "set rollout.sglang.base_gpu_id=null"),
        (("rollout.sglang.tp_size=3",), "tp_size=3 does not divide its 8 GPUs"),
        (("rollout.placement=dedicated", "rollout.sglang.transport=distributed"),
         "is for rollout.placement=colocated, not dedicated"),
    ],
)  # fmt: skip
def test_every_tp_group_refusals_are_one_line(capsys, paths, more, needle):
    base = [f"model.hf_checkpoint={paths['8b']}", *paths["data"]]
    job = ("--nodes", "1", "--gpus-per-node", "8")
    if "dedicated" in more[0]:
        job = ("--nodes", "2", "--gpus-per-node", "8", "--train-nodes", "1")
    assert needle in refused(capsys, Q8B, *base, *more, *job)


def test_without_dry_run_it_refuses(capsys):
    assert main([TINY, "--nodes", "2"], environ={}) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--dry-run" in line


def test_cli_registers_launch(capsys):
    from megatron_rl_fp8 import cli

    assert cli.main(["launch", TINY, "--dry-run", "--nodes", "1", "--gpus-per-node", "1"]) == 0
    assert "# trainer" in capsys.readouterr().out


# -- slurm/train.sbatch ---------------------------------------------------------------------------


def test_every_shell_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    root = SBATCH.parents[1]
    scripts = [SBATCH, *sorted((root / "scripts").glob("*.sh")), root / ".ci" / "run"]
    proc = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_sbatch_header_and_requeue_code():
    text = SBATCH.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@" in text
    assert f"readonly REQUEUE_EXIT_CODE={REQUEUE_EXIT_CODE}\n" in text


# Stub srun: runs the step's command after its options, except the two roles, which it fakes: the
# trainer records its argv and exits 1 on USR1 (what torchrun reports for a rank that stopped),
# else after FAKE_TRAIN_S seconds with FAKE_TRAIN_EXIT; the rollout waits for SIGTERM.
STUB_SRUN = r"""#!/bin/bash
out=""
while [[ $1 == --* ]]; do
    case $1 in --output=*) out=${1#--output=} ;; esac
    shift
done
if [[ -n $out ]]; then exec >"${out//%N/stub}" 2>&1; fi
case " $* " in
*" --rdzv-backend "*)
    printf '%s\n' "$@" >"$STUB_DIR/trainer.argv"
    trap 'echo usr1 >>"$STUB_DIR/signals"; exit 1' USR1
    for ((i = 0; i < FAKE_TRAIN_S * 20; i++)); do sleep 0.05; done
    exit "$FAKE_TRAIN_EXIT" ;;
*" --role rollout "*)
    trap 'echo term >>"$STUB_DIR/signals"; exit 0' TERM
    while :; do sleep 0.05; done ;;
*) exec "$@" ;;
esac
"""
STUB_SCONTROL = r"""#!/bin/bash
if [[ $1 == requeue ]]; then echo "requeue $2" >>"$STUB_DIR/signals"; exit 0; fi
echo "NodeName=n1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=box"
echo "NodeName=n2 Arch=x86_64 NodeAddr=127.0.0.2 NodeHostName=box"
"""


# Stands in for the dry-run once a real one has rendered the scripts: copies them to --write-scripts.
STUB_PYTHON = r"""#!/bin/bash
while [[ $# -gt 0 && $1 != --write-scripts ]]; do shift; done
mkdir -p "$2" && cp "$RENDERED"/*.sh "$2"/
echo "record: $2"
"""


def _start_sbatch(tmp_path: Path, name: str, **env_vars: str) -> tuple[subprocess.Popen, Path]:
    stub = tmp_path / name
    (stub / "bin").mkdir(parents=True)
    for tool, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("python", STUB_PYTHON)):
        (stub / "bin" / tool).write_text(text)
        (stub / "bin" / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stub / 'bin'}:{os.environ['PATH']}",
        "STUB_DIR": str(stub),
        "PYTHON": sys.executable,
        "LOG_ROOT": str(stub / "logs"),
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
        **env_vars,
    }
    proc = subprocess.Popen(
        ["bash", str(SBATCH), TINY, *TINY_SGLANG],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, stub


@pytest.mark.skipif(sys.platform != "linux", reason="bash job control and signals")
def test_sbatch_forwards_usr1_and_requeues(tmp_path):
    """A real dry-run renders the steps; USR1 reaches the trainer, the rollout is stopped, and
    the job requeues itself."""
    proc, stub = _start_sbatch(tmp_path, "preempted", FAKE_TRAIN_S="60", FAKE_TRAIN_EXIT="0")
    deadline = time.monotonic() + 60
    while not (stub / "trainer.argv").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the trainer step never started"
        time.sleep(0.05)
    time.sleep(0.3)  # the rollout stub sets its SIGTERM trap
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (stub / "signals").read_text().splitlines() == ["usr1", "term", "requeue 77"]
    assert "requeueing job 77" in err
    argv = (stub / "trainer.argv").read_text().splitlines()
    assert argv[argv.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")  # NodeAddr, not n1
    run_dir = stub / "logs" / "77" / "restart-0"
    names = {p.name for p in run_dir.iterdir()}
    assert {"commands.txt", "nodes.txt", "trainer.sh", "rollout-1.sh", "trainer-stub.log"} <= names

    # The same scripts again, a trainer that fails on its own: no requeue, the job fails with
    # the trainer's status and says where its log is.
    proc, stub = _start_sbatch(
        tmp_path, "failed", PYTHON="python", RENDERED=str(run_dir), FAKE_TRAIN_S="0",
        FAKE_TRAIN_EXIT="7",
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert "the trainer step failed (exit 7" in err and "requeue" not in err


def test_the_largest_job_plans_in_seconds(capsys):
    # Issue 44 #2: placement and the trainer's overrides (every engine URL) are linear; the
    # duplicate-node check was quadratic. 4096 nodes x 8 GPUs, colocated engines on every GPU.
    import time

    t0 = time.perf_counter()
    line = refused(
        capsys, TINY, *TINY_SGLANG, "rollout.placement=colocated", "rollout.sglang.transport=tensor",
        "rollout.sglang.num_engines=0", "--nodes", "4096", "--gpus-per-node", "8",
    )  # fmt: skip
    assert "32768 ranks" in line  # got past placement to the batch-split check
    assert time.perf_counter() - t0 < 60
