"""``megatron-rl-fp8 launch CONFIG [section.key=value ...] --dry-run [--nodes N] [--gpus-per-node G]
[--nodelist 'n[1-4]'] [--train-nodes T]``: check a Slurm layout and print the command of every
node role (slurm/README.md).

The job is read from the Slurm environment (SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE, SLURM_JOB_ID
...) when there is one; each flag overrides its variable, so a layout can be checked from a login
node before submitting. Exit 0 with the layout and the commands; exit 2 with one line when the run
cannot start there.

Without --dry-run, ``--role rollout --node-index K`` runs node K's engine servers and router in the
foreground (the engine's launcher: ``rollout/sglang/role.py`` for SGLang; the command the dry-run
renders for that node). The trainer's role is the rendered ``torchrun`` command itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.launch.layout import check_run, node_role, plan_layout
from megatron_rl_fp8.launch.render import RenderOptions, render, trainer_overrides
from megatron_rl_fp8.launch.slurm import read_env, read_node_addrs
from megatron_rl_fp8.rollout.registry import engine_spec


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False)
    p.add_argument("config", help="YAML config of the run.")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides.")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Check the layout and print the commands; start nothing.",
    )
    job = p.add_argument_group("the job (default: the Slurm environment)")
    job.add_argument("--nodes", type=int, help="Nodes (alone: simulates node[1-N]).")
    job.add_argument("--nodelist", help="Node list as Slurm prints it, e.g. 'n[1-4]'.")
    job.add_argument("--gpus-per-node", type=int, help="GPUs per node (CPU cluster: ranks).")
    job.add_argument(
        "--job-id", type=int, help="Job id (seeds the ports; default 0 outside a job)."
    )
    job.add_argument(
        "--train-nodes",
        type=int,
        help="Trainer nodes with rollout.placement=dedicated (default: $TRAIN_NODES, else every "
        "node the engines do not need).",
    )
    job.add_argument(
        "--node-addrs",
        default="",
        help="Node addresses: n1=10.0.0.1,n2=..., scontrol (ask `scontrol show node`), or @FILE "
        "(its saved `-o` output); default: the node names.",
    )
    check = p.add_argument_group("checks")
    check.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="Memory of one GPU (default 80)."
    )
    check.add_argument(
        "--spec", choices=["te", "local"], default="te", help="Layer spec the planner assumes."
    )
    out = p.add_argument_group("commands")
    out.add_argument("--role", choices=["trainer", "rollout"], help="Print this role only.")
    out.add_argument(
        "--node-index",
        type=int,
        help="With --role rollout: the node (0-based; default: SLURMD_NODENAME's place in the "
        "node list, else SLURM_NODEID).",
    )
    out.add_argument(
        "--log-dir",
        help="Without --dry-run: the rollout role's logs, pid files and config-only model "
        "(default: a node<K> folder of the engine's working directory, under train.output_dir).",
    )
    out.add_argument("--python", help="Python on the compute nodes (default: this one).")
    out.add_argument("--container-image", help="pyxis/enroot image for every srun step.")
    out.add_argument("--container-mounts", help="pyxis --container-mounts (include this dir).")
    out.add_argument(
        "--write-scripts",
        metavar="DIR",
        help="Also write DIR/<role>.sh (one srun each), DIR/commands.txt, and send each step's "
        "output to DIR/<role>-<node>.log.",
    )
    out.add_argument(
        "--write-record",
        action="store_true",
        help="As --write-scripts, into the run's own directory: <train.output_dir>/slurm/<job "
        "id>/restart-<n>. Either prints 'record: DIR' last.",
    )
    return p


def _plan(args: argparse.Namespace, environ: Mapping[str, str]):
    """(the run's config, the job's layout): the same for the dry-run and every role."""
    env = read_env(
        environ,
        nodelist=args.nodelist,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        job_id=args.job_id,
    )
    cfg = load_config(args.config, args.overrides)
    addrs = read_node_addrs(args.node_addrs, env.nodes)
    return cfg, plan_layout(cfg, env, addrs=addrs, train_nodes=_train_nodes(args, environ))


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    _, layout = _plan(args, environ)
    # Check the config exactly as the trainer will load it: with the engines' URLs.
    trainer_cfg = load_config(args.config, [*args.overrides, *trainer_overrides(layout)])
    name = " ".join([args.config, *args.overrides])
    est = check_run(
        trainer_cfg, layout, config_name=name, gpu_memory_gb=args.gpu_memory_gb, spec=args.spec
    )
    if args.write_record and args.write_scripts:
        raise ConfigError(
            "--write-record and --write-scripts both name the record's place; pick one"
        )
    record = record_dir(trainer_cfg, layout) if args.write_record else args.write_scripts
    commands = _selected(args, layout, _render_options(args, record))
    text = "\n".join(
        [*summary(layout, trainer_cfg, est, args.gpu_memory_gb), "", *_listing(commands)]
    )
    print(text)
    if record:
        _write_scripts(Path(record), commands, text, node_addrs=args.node_addrs)
        print(f"record: {record}")
    return 0


def record_dir(cfg, layout) -> str:
    """Where a job's record goes inside the run's directory, one folder per (re)start of the job:
    ``<train.output_dir>/slurm/<job id>/restart-<n>`` (absolute: every step reads it)."""
    env = layout.env
    out = Path(cfg.train.output_dir).expanduser().absolute()
    return str(out / "slurm" / str(env.job_id) / f"restart-{env.restart_count}")


def run_rollout(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Node K's rollout role, in the foreground (the engine's launcher: ``serve_node``)."""
    cfg, layout = _plan(args, environ)
    role = node_role(layout, node_index(args.node_index, layout.env.nodes, environ))
    return (
        engine_spec(cfg.rollout.engine)
        .launcher()
        .serve_node(
            cfg,
            role,
            colocated=layout.placement == "colocated",
            restart_count=layout.env.restart_count,
            log_dir=Path(args.log_dir) if args.log_dir else None,
        )
    )


def node_index(flag: int | None, nodes: tuple[str, ...], environ: Mapping[str, str]) -> int:
    """This node's index in the job: ``--node-index``, else where SLURMD_NODENAME is in the node
    list, else SLURM_NODEID (which Slurm may number within the step, not the job: the rendered
    commands always pass --node-index)."""
    if flag is not None:
        return flag
    name = environ.get("SLURMD_NODENAME", "")
    if name in nodes:
        return nodes.index(name)
    raw = environ.get("SLURM_NODEID", "")
    if raw.isdigit():
        return int(raw)
    raise ConfigError("--role rollout needs --node-index K (the node's 0-based index in the job)")


def _train_nodes(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    if args.train_nodes is not None:
        return args.train_nodes
    raw = environ.get("TRAIN_NODES", "")
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"TRAIN_NODES={raw!r} is not a node count; set it to an integer >= 1")
    return int(raw)


def _render_options(args: argparse.Namespace, log_dir: str | None):
    python = args.python or ("python" if args.container_image else sys.executable)
    sibling = Path(python).with_name("torchrun")
    torchrun = str(sibling) if os.sep in python and sibling.exists() else "torchrun"
    return RenderOptions(
        config=args.config,
        overrides=tuple(args.overrides),
        python=python,
        torchrun=torchrun,
        log_dir=log_dir,
        container_image=args.container_image,
        container_mounts=args.container_mounts,
        workdir=os.getcwd() if args.container_image else None,
    )


def _selected(args: argparse.Namespace, layout, opts) -> list:
    """Every role's command, or the one --role / --node-index ask for."""
    commands = render(layout, opts)
    if args.role is None:
        return commands
    if args.role == "trainer":
        return [c for c in commands if c.role == "trainer"]
    if args.node_index is None:
        raise ConfigError("--role rollout needs --node-index K (the node's 0-based index)")
    picked = [c for c in commands if c.name == f"rollout-{args.node_index}"]
    if not picked:
        serving = [c.name for c in commands if c.role == "rollout"] or ["none"]
        raise ConfigError(
            f"node {args.node_index} runs no rollout role in this layout (rollout steps: "
            f"{', '.join(serving)})"
        )
    return picked


def summary(layout, cfg, est, gpu_memory_gb: float) -> list[str]:
    """The layout in a few lines: who trains, who serves, where they meet, and the memory."""
    env, p = layout.env, cfg.parallel
    dp = layout.trainer_gpus // p.model_parallel_size
    derived = " (TRAIN_NODES unset: every node the engines do not need)"
    lines = [
        f"job: {env.describe()}",
        f"placement: {layout.placement}",
        f"trainer: {len(layout.train_nodes)} node(s) ({','.join(layout.train_nodes)})"
        f"{derived if layout.train_nodes_derived else ''}: {layout.trainer_gpus} ranks = "
        f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x "
        f"CP {p.context_parallel_size} x DP {dp}; c10d rendezvous {layout.rdzv_endpoint} "
        f"(id {env.job_id})",
    ]
    if layout.engines:
        servers = layout.servers
        router = layout.router_url or "none (one engine: the trainer calls it directly)"
        lines.append(
            f"rollout: {len(layout.engines)} engine(s) x TP {servers.tp} on "
            f"{','.join(layout.rollout_nodes)}; router {router}"
        )
        if servers.count_note:
            lines.append(f"  {servers.count_note}")
        for e in layout.engines:
            gpus = ",".join(map(str, e.gpus))
            lines.append(f"  engine {e.index}: {e.node} GPUs {gpus} {e.url}")
        lines += servers.notes
    else:
        lines.append(f"rollout: rollout.engine={cfg.rollout.engine}, inside the trainer")
    lines.append(
        f"memory: fits, {est.margin_gb:.1f} GB to spare on a {gpu_memory_gb:g} GB trainer GPU "
        f"(peak {est.peak / 1e9:.1f} GB; `megatron-rl-fp8 plan` for the table)"
    )
    return lines + [f"note: {n}" for n in est.notes]


def _listing(commands) -> list[str]:
    lines = []
    for c in commands:
        lines += [f"# {c.name} ({','.join(c.nodes)})", c.shell()]
    return lines


def _write_scripts(out: Path, commands, text: str, *, node_addrs: str = "") -> None:
    """One executable ``<name>.sh`` per step (``exec srun ...``: the sbatch's signals reach srun),
    the whole dry-run in commands.txt, and a ``@FILE`` of node addresses as nodes.txt: the run's
    record of what was started."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "commands.txt").write_text(text + "\n")
    if node_addrs.startswith("@"):
        (out / "nodes.txt").write_text(Path(node_addrs[1:]).read_text())
    for c in commands:
        path = out / f"{c.name}.sh"
        path.write_text(f"#!/bin/bash\n# {c.name} on {','.join(c.nodes)}\nexec {c.shell()}\n")
        path.chmod(0o755)


def main(
    argv: list[str] | None = None,
    prog: str = "megatron-rl-fp8 launch",
    environ: Mapping[str, str] | None = None,
) -> int:
    # Intermixed: the overrides may come after the flags.
    args = build_parser(prog).parse_intermixed_args(argv)
    if not args.dry_run and args.role != "rollout":
        print(
            "launch error: without --dry-run, launch runs one node's rollout role (--role rollout "
            "--node-index K); pass --dry-run for the layout and the trainer's command",
            file=sys.stderr,
        )
        return 2
    environ = os.environ if environ is None else environ
    try:
        return run(args, environ) if args.dry_run else run_rollout(args, environ)
    except ConfigError as e:
        print(f"launch error: {e}", file=sys.stderr)
        return 2
