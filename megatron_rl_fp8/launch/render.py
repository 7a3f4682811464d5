"""The exact command line of every node role in a :class:`~megatron_rl_fp8.launch.layout.Layout`.

One ``srun`` step per role, started by ``slurm/train.sbatch`` from the batch host:

* trainer: one task per trainer node running ``torchrun`` (c10d rendezvous on the first trainer
  node, one rank per GPU, SIGUSR1 forwarded to the ranks so the trainer can checkpoint before a
  preemption) and ``megatron_rl_fp8 train`` with the engines' and the router's URLs appended as
  overrides, so the trainer attaches to them rather than launching its own;
* rollout: one step per node that serves engines (or the router), running ``megatron_rl_fp8
  launch CONFIG --role rollout --node-index K`` with the job's layout spelled out as flags, so
  the role derives the same layout whatever its step's environment says.

Pure: strings in, argv tuples out; nothing here reads the environment or the filesystem.
"""

from __future__ import annotations

import dataclasses
import shlex

from megatron_rl_fp8.launch.layout import Layout

TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun's default set plus SIGUSR1, which it would otherwise die of instead of passing it on
to the ranks (``#SBATCH --signal=B:USR1@...``, forwarded by the sbatch script to the trainer)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RenderOptions:
    """What the commands run besides the layout: the run's config and how to reach Python."""

    config: str
    overrides: tuple[str, ...] = ()
    python: str = "python"
    """Interpreter on the compute nodes (the dry-run's own, or ``python`` in a container)."""
    torchrun: str = "torchrun"
    log_dir: str | None = None
    """Each step's output goes to ``<log_dir>/<role>-<node>.log`` (None: the job's log)."""
    container_image: str | None = None
    """pyxis/enroot image for every step (``srun --container-image``)."""
    container_mounts: str | None = None
    workdir: str | None = None
    """The container's working directory (the submit directory, mounted)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """One role's srun step."""

    name: str
    """``trainer`` or ``rollout-<node index>``."""
    role: str
    nodes: tuple[str, ...]
    argv: tuple[str, ...]

    def shell(self) -> str:
        return shlex.join(self.argv)


def render(layout: Layout, opts: RenderOptions) -> list[Command]:
    """The trainer's step, then one rollout step per node that serves an engine or the router."""
    serving = [n for n in layout.rollout_nodes if _serves(layout, n)]
    return [trainer_command(layout, opts), *(rollout_command(layout, opts, n) for n in serving)]


def _serves(layout: Layout, node: str) -> bool:
    return node == layout.router_node or any(e.node == node for e in layout.engines)


def trainer_overrides(layout: Layout) -> list[str]:
    """The overrides that attach the trainer to the launcher's engines and router (the engine's
    launcher words them: ``Layout.attach``)."""
    return list(layout.attach)


def trainer_command(layout: Layout, opts: RenderOptions) -> Command:
    nodes = layout.train_nodes
    torchrun = [
        opts.torchrun,
        "--nnodes",
        str(len(nodes)),
        "--nproc-per-node",
        str(layout.env.gpus_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        layout.rdzv_endpoint,
        "--rdzv-id",
        str(layout.env.job_id),
        "--signals-to-handle",
        TORCHRUN_SIGNALS,
        "-m",
        "megatron_rl_fp8",
        "train",
        opts.config,
        *opts.overrides,
        *trainer_overrides(layout),
    ]
    argv = [*_srun(layout, opts, nodes, "trainer"), *torchrun]
    return Command(name="trainer", role="trainer", nodes=nodes, argv=tuple(argv))


def rollout_command(layout: Layout, opts: RenderOptions, node: str) -> Command:
    k = layout.node_index(node)
    name = f"rollout-{k}"
    launch = [
        opts.python,
        "-m",
        "megatron_rl_fp8",
        "launch",
        opts.config,
        *opts.overrides,
        "--role",
        "rollout",
        "--node-index",
        str(k),
        *layout_flags(layout),
    ]
    argv = [*_srun(layout, opts, (node,), name), *launch]
    return Command(name=name, role="rollout", nodes=(node,), argv=tuple(argv))


def layout_flags(layout: Layout) -> list[str]:
    """``launch`` flags that reproduce ``layout`` anywhere (no Slurm variable consulted)."""
    env = layout.env
    flags = [
        "--nodelist",
        ",".join(env.nodes),
        "--gpus-per-node",
        str(env.gpus_per_node),
        "--job-id",
        str(env.job_id),
    ]
    if layout.placement == "dedicated":
        flags += ["--train-nodes", str(len(layout.train_nodes))]
    if any(layout.addrs[n] != n for n in env.nodes):
        flags += ["--node-addrs", ",".join(f"{n}={layout.addrs[n]}" for n in env.nodes)]
    return flags


def _srun(layout: Layout, opts: RenderOptions, nodes: tuple[str, ...], name: str) -> list[str]:
    argv = [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=1",
    ]
    if layout.env.cpus_per_node:
        argv.append(f"--cpus-per-task={layout.env.cpus_per_node}")
    if layout.placement == "colocated":
        argv.append("--overlap")  # the trainer's and the rollout's steps share every node
    if opts.log_dir:
        # srun's %N is the node's short *hostname*, not its Slurm name: Slurm nodes that share
        # a host (NodeHostname aliases, a test cluster on one machine) would share one file. %n
        # is the node's index in the step, which tells a multi-node step's nodes apart.
        node = "%n-%N" if len(nodes) > 1 else "%N"
        argv.append(f"--output={opts.log_dir}/{name}-{node}.log")
    if opts.container_image:
        argv.append(f"--container-image={opts.container_image}")
        if opts.container_mounts:
            argv.append(f"--container-mounts={opts.container_mounts}")
        if opts.workdir:
            argv.append(f"--container-workdir={opts.workdir}")
    return argv
