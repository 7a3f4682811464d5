"""What a Slurm job tells its processes: the node list, this node's index, GPUs per node, the job
id, how often it was requeued, and where each node can be reached.

Slurm prints node lists compressed (``n[1-3,7],gpu-a[01-02],x``); :func:`expand_nodelist` expands
them as ``scontrol show hostnames`` does, in the same order, so every process derives the same
roles from the same string without asking the controller. Node *names* are not always DNS names
(a test cluster on loopback, sites that route by ``NodeAddr``), so addresses come from
``scontrol show node`` (:func:`read_node_addrs`) or from a mapping given on the command line.

Pure functions of strings and a mapping of environment variables, except ``scontrol`` itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.utils.cluster import MAX_GPUS_PER_NODE, MAX_NODES

# One bracket group: "[1-3,7]"; what is between groups is literal text.
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_nodelist(text: str) -> list[str]:
    """``n[1-3,7],gpu-a[01-02],x`` -> ``[n1, n2, n3, n7, gpu-a01, gpu-a02, x]``.

    Zero padding follows the range's lower bound (``[08-10]`` -> 08 09 10, ``[9-10]`` -> 9 10), as
    in Slurm; several groups in one name expand as a product, the first group outermost
    (``r[1-2]-n[1-2]`` -> r1-n1 r1-n2 r2-n1 r2-n2)."""
    names = []
    for item in _split_top(text):
        names += _expand_name(item, MAX_NODES - len(names))
    if not names:
        raise ConfigError(f"node list {text!r} names no node; pass --nodelist such as 'n[1-4]'")
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets; empty items (``a,,b``) are dropped, as Slurm does."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"node list {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"node list {text!r}: a '[' is never closed")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_name(item: str, room: int) -> list[str]:
    """``item``'s names; ConfigError where they would pass ``room`` (what MAX_NODES leaves)."""
    literals = _GROUP.split(item)[::2]  # text around the groups
    if any("[" in s or "]" in s for s in literals):
        raise ConfigError(f"node list item {item!r}: a ']' without its '['")
    choices = [_expand_ranges(body, item) for body in _GROUP.findall(item)]
    if math.prod(map(len, choices)) > room:
        raise ConfigError(
            f"node list item {item!r}: a job of more than {MAX_NODES} nodes; check the ranges"
        )
    out = []
    for combo in itertools.product(*choices):
        parts = [literals[0]]
        for value, after in zip(combo, literals[1:]):
            parts += [value, after]
        out.append("".join(parts))
    return out


def _expand_ranges(body: str, item: str) -> list[str]:
    """``1-3,7`` -> ``[1, 2, 3, 7]`` as strings, padded to the width of each lower bound."""
    values = []
    for part in body.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise ConfigError(f"node list item {item!r}: {part!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"node list item {item!r}: range {part!r} runs backwards")
        if int(hi) - int(lo) >= MAX_NODES:
            raise ConfigError(
                f"node list item {item!r}: range {part!r} names more than {MAX_NODES} nodes"
            )
        values += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return values


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmEnv:
    """The job as the launcher sees it (from the environment, or flags that stand in for it)."""

    nodes: tuple[str, ...]
    """Every node of the allocation, in Slurm's order (node index = position)."""
    gpus_per_node: int
    """GPUs (on a CPU cluster: ranks) per node; every node has the same."""
    job_id: int
    """SLURM_JOB_ID (0 outside a job): seeds the ports and names the rendezvous."""
    restart_count: int = 0
    """SLURM_RESTART_COUNT: how often this job was requeued (0 on the first run)."""
    node_id: int | None = None
    """SLURM_NODEID of the process that reads it (None outside a job step)."""
    cpus_per_node: int | None = None
    """SLURM_CPUS_ON_NODE: each role's srun step asks for all of them (None = srun's default)."""
    in_job: bool = False
    """Read from a real Slurm job's environment (False: simulated by flags)."""

    def describe(self) -> str:
        where = f"Slurm job {self.job_id}" if self.in_job else "simulated (not in a Slurm job)"
        restart = f", requeued {self.restart_count}x" if self.restart_count else ""
        return (
            f"{where}{restart}: {len(self.nodes)} node(s) x {self.gpus_per_node} GPU(s): "
            f"{','.join(self.nodes)}"
        )


def gpus_from_env(env: Mapping[str, str]) -> int | None:
    """GPUs per node: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (``8``, ``h100:8``), else the
    count of SLURM_JOB_GPUS (``0,1,2,3``); None when the job asked for no GPUs."""
    if env.get("SLURM_GPUS_ON_NODE"):
        return _int(env, "SLURM_GPUS_ON_NODE")
    per_node = env.get("SLURM_GPUS_PER_NODE", "")
    if per_node:
        count = per_node.rsplit(":", 1)[-1]
        if not count.isdigit():
            raise ConfigError(
                f"SLURM_GPUS_PER_NODE={per_node!r} is not a count; pass --gpus-per-node"
            )
        return int(count)
    if env.get("SLURM_JOB_GPUS"):
        return len([g for g in env["SLURM_JOB_GPUS"].split(",") if g.strip()])
    return None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name].split("(")[0])  # SLURM_CPUS_ON_NODE may read "8(x2)" on old Slurm
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if env.get(name) else None


def read_env(
    env: Mapping[str, str],
    *,
    nodelist: str | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    job_id: int | None = None,
) -> SlurmEnv:
    """The job from ``env`` (``os.environ`` in a job), each flag that is not None overriding its
    variable. Without a node list, ``nodes`` alone simulates ``node[1-N]``."""
    in_job = "SLURM_JOB_ID" in env
    text = nodelist or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodes is not None and not 1 <= nodes <= MAX_NODES:
        raise ConfigError(f"--nodes {nodes}: give a count from 1 to {MAX_NODES}")
    if text is None and nodes is not None:
        text = f"node[1-{nodes}]"
    if text is None:
        raise ConfigError(
            "no node list: run inside a Slurm job (SLURM_JOB_NODELIST) or pass --nodelist "
            "'n[1-4]' or --nodes N"
        )
    names = expand_nodelist(text)
    _check_names(names, text, nodes if nodes is not None else _opt_int(env, "SLURM_JOB_NUM_NODES"))
    if gpus_per_node is not None and not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE:
        raise ConfigError(
            f"--gpus-per-node {gpus_per_node}: give a count from 1 to {MAX_GPUS_PER_NODE} (on "
            "a CPU cluster: ranks per node)"
        )
    gpus = gpus_per_node if gpus_per_node is not None else gpus_from_env(env)
    if gpus is not None and gpus > MAX_GPUS_PER_NODE:
        raise ConfigError(
            f"the job has {gpus} GPUs per node (SLURM_GPUS_*), more than {MAX_GPUS_PER_NODE}; "
            "pass --gpus-per-node G"
        )
    if gpus is None or gpus < 1:
        raise ConfigError(
            "GPUs per node unknown: the job sets none of SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, "
            "SLURM_JOB_GPUS; pass --gpus-per-node G (on a CPU cluster: ranks per node)"
        )
    return SlurmEnv(
        nodes=tuple(names),
        gpus_per_node=gpus,
        job_id=job_id if job_id is not None else (_opt_int(env, "SLURM_JOB_ID") or 0),
        restart_count=_opt_int(env, "SLURM_RESTART_COUNT") or 0,
        node_id=_opt_int(env, "SLURM_NODEID"),
        cpus_per_node=_opt_int(env, "SLURM_CPUS_ON_NODE"),
        in_job=in_job,
    )


def _check_names(names: list[str], text: str, expected: int | None) -> None:
    seen: set[str] = set()
    dup = next((n for n in names if n in seen or seen.add(n)), None)
    if dup is not None:
        raise ConfigError(f"node list {text!r} names {dup!r} twice; list each node once")
    if expected is not None and expected != len(names):
        raise ConfigError(
            f"node list {text!r} has {len(names)} node(s) but {expected} are expected "
            "(--nodes / SLURM_JOB_NUM_NODES); make them agree"
        )


def parse_scontrol_nodes(text: str) -> dict[str, str]:
    """``scontrol show node -o`` output (one node per line) -> ``{NodeName: NodeAddr}``."""
    out = {}
    for line in text.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
        if name and addr:
            out[name.group(1)] = addr.group(1)
    return out


def read_node_addrs(spec: str, nodes: tuple[str, ...]) -> dict[str, str]:
    """Each node's address from ``spec``: empty = the names themselves (they resolve);
    ``scontrol`` = ask it now; ``@FILE`` = ``scontrol show node -o`` output saved earlier (the
    sbatch saves it on the batch host, where scontrol is, for a dry-run inside a container);
    ``n1=10.0.0.1,n2=10.0.0.2`` = given. Every node must get one."""
    if not spec:
        return {n: n for n in nodes}
    if spec == "scontrol":
        addrs = parse_scontrol_nodes(_run_scontrol(nodes))
    elif spec.startswith("@"):
        try:
            addrs = parse_scontrol_nodes(Path(spec[1:]).read_text())
        except OSError as e:
            raise ConfigError(f"--node-addrs {spec}: cannot read it ({e.strerror})") from None
    else:
        addrs = _parse_pairs(spec)
    missing = [n for n in nodes if n not in addrs]
    if missing:
        raise ConfigError(
            f"--node-addrs {spec}: no address for node {missing[0]!r}; give one per node "
            "(name=addr,...) or leave it out to use the names"
        )
    return {n: addrs[n] for n in nodes}


def _parse_pairs(spec: str) -> dict[str, str]:
    pairs = [p.strip() for p in spec.split(",") if p.strip()]
    bad = next((p for p in pairs if p.count("=") != 1 or not all(p.split("="))), None)
    if bad is not None:
        raise ConfigError(
            f"--node-addrs: {bad!r} is not name=address; give n1=10.0.0.1,n2=10.0.0.2, "
            "@FILE or scontrol"
        )
    return dict(p.split("=") for p in pairs)


def _run_scontrol(nodes: tuple[str, ...]) -> str:
    if shutil.which("scontrol") is None:
        raise ConfigError(
            "--node-addrs scontrol: scontrol is not on PATH here; run on a Slurm node, or give "
            "the addresses as n1=10.0.0.1,..."
        )
    proc = subprocess.run(
        ["scontrol", "show", "node", "-o", ",".join(nodes)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode:
        first = (proc.stderr.strip().splitlines() or ["no output"])[0]
        raise ConfigError(f"--node-addrs scontrol: `scontrol show node` failed: {first}")
    return proc.stdout
