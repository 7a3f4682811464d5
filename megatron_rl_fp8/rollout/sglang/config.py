"""``rollout.sglang.*``: how the SGLang engines launch, sync and recover."""

from __future__ import annotations

import dataclasses
from typing import Literal
from urllib.parse import urlparse

from megatron_rl_fp8.config_utils import check_literals, field


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    """The SGLang engines this run launches and owns, or attaches to (``rollout.engine: sglang``)."""

    python: str = field(
        ".venv-sglang/bin/python",
        help="Python that runs `sglang.launch_server` (relative paths: from the repository root). "
        "The default is the venv made by scripts/install_sglang_cpu.sh; empty = the trainer's "
        "own interpreter (SGLang installed next to the trainer, e.g. on GPU clusters).",
    )
    transport: Literal["distributed", "tensor"] = field(
        "distributed",
        help="How synced weights reach the engines: distributed = each bucket broadcast once "
        "over a private NCCL/gloo group joining each pipeline stage's sending rank and every "
        "engine's TP ranks (update_weights_from_distributed; engines anywhere, on GPUs other "
        "than the senders'); tensor = shared memory on CPU, CUDA IPC on GPU, handles over HTTP "
        "(update_weights_from_tensor; engines on the senders' node, may share their GPUs).",
    )
    bucket_mb: float = field(512.0, help="Largest weight message to the server, in MiB.")
    tp_size: int = field(1, help="Tensor-parallel size of each SGLang server (GPUs per engine).")
    num_engines: int = field(
        1,
        help="SGLang servers this run launches, each on placeholder weights that the first sync "
        "replaces; more than one run behind one sglang-router. No weight copy is written to "
        "disk: a relaunched engine is re-synced from the trainer. 0 = one on every TP group "
        "(tp_size GPUs) of every node, nodes x (GPUs per node / tp_size), with "
        "rollout.placement=colocated (rollout/sglang/placement.py).",
    )
    engine_urls: list[str] = field(
        default_factory=list,
        help="Attach to SGLang servers that already run (e.g. started by the Slurm launcher) "
        "instead of launching any: their base URLs. The run syncs them by broadcast and cannot "
        "relaunch them; one that dies is dropped.",
    )
    engine_nodes: list[str] = field(
        default_factory=list,
        help="The node each of engine_urls runs on (Slurm node names; the launcher sets it). "
        "With transport=tensor and engines on several nodes, each node's engines get the "
        "weights from a trainer rank of their own node (a per-node sync). Empty = every engine "
        "on the nodes its senders reach.",
    )
    router_url: str = field(
        "",
        help="An sglang-router that already runs in front of engine_urls; empty = launch one "
        "(fleets of more than one engine) or none (a single engine is called directly).",
    )
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = field(
        "round_robin",
        help="The launched router's --policy. Every request is one prompt with all of its "
        "samples, so a prompt's prefix is computed once whatever the policy.",
    )
    base_gpu_id: int | None = field(
        None,
        help="GPU of the first engine (SGLang --base-gpu-id; engine i uses base_gpu_id + "
        "i * tp_size onwards). None = after the trainer's GPUs on this node with "
        "rollout.placement=dedicated, the node's last GPUs with colocated. With transport "
        "distributed never a sending rank's GPU (each pipeline stage's sender joins the "
        "engines' NCCL group, which cannot hold two processes on one GPU).",
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        "auto",
        help="Server device; auto = cuda when this process sees a GPU, else SGLang's CPU "
        "engine (torch-native attention).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        "auto",
        help="Server activation/weight dtype; auto = float32 on CPU (matches the local "
        "engine), bfloat16 on GPU.",
    )
    mem_fraction_static: float | None = field(
        None,
        help="SGLang --mem-fraction-static (weights + KV pool share of memory); None = "
        "0.05 on CPU (host RAM), SGLang's own default on GPU.",
    )
    max_total_tokens: int | None = field(None, help="SGLang --max-total-tokens (KV pool cap).")
    host: str = field("127.0.0.1", help="Address the server listens on and the trainer calls.")
    port: int = field(0, help="Server port; 0 = pick a free one at every launch.")
    work_dir: str = field(
        "",
        help="Where the engines' logs, pid files and config-only model directory go; empty = "
        "<train.output_dir>/sglang when the trainer passes it, else a temporary directory.",
    )
    parse_answers: Literal["process", "thread"] = field(
        "process",
        help="Where the rollout's /generate answers are sent and decoded: process = a helper "
        "process, so decoding their JSON does not hold the trainer's GIL while the pipelined "
        "driver launches an update (docs/benchmarks.md); thread = threads of the trainer's "
        "process.",
    )
    startup_timeout_s: float = field(300.0, help="Seconds to wait for /health after a launch.")
    request_timeout_s: float = field(
        600.0,
        help="Seconds one HTTP call (a whole rollout batch, one weight bucket) may take "
        "before the engine is declared hung and relaunched.",
    )
    max_restarts: int = field(
        2,
        help="Relaunches of one engine since its last good sync (counting ones that die in "
        "startup) before the run fails with its log; also how often the trainer runs a failed "
        "sync again, or re-syncs engines that lost their weights in a rollout.",
    )
    random_seed: int = field(0, help="SGLang --random-seed.")
    env: dict[str, str] = field(
        default_factory=dict, help="Extra environment variables for the server process."
    )
    extra_args: list[str] = field(
        default_factory=list, help="Extra `sglang.launch_server` arguments, appended verbatim."
    )

    def __post_init__(self):
        check_literals(self, "rollout.sglang")
        if not self.bucket_mb > 0:
            raise ValueError(f"rollout.sglang.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.tp_size < 1:
            raise ValueError(f"rollout.sglang.tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                "rollout.sglang.mem_fraction_static must be in (0, 1) or None, got "
                f"{self.mem_fraction_static}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(
                f"rollout.sglang.max_total_tokens must be >= 1, got {self.max_total_tokens}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(
                f"rollout.sglang.port must be in [0, 65535] (0 = free port), got {self.port}"
            )
        for name in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.sglang.{name} must be > 0, got {getattr(self, name)}")
        if self.num_engines < 0:
            raise ValueError(
                f"rollout.sglang.num_engines must be >= 1, or 0 (one engine on every TP group of "
                f"every node), got {self.num_engines}"
            )
        if self.router_url and not self.engine_urls:
            raise ValueError(
                "rollout.sglang.router_url is set but rollout.sglang.engine_urls is empty: the "
                "trainer syncs weights into each engine, so list the engines behind the router"
            )
        bad = [u for u in [self.router_url, *self.engine_urls] if u and not _is_http_url(u)]
        if bad:
            raise ValueError(
                f"rollout.sglang.engine_urls / router_url: {bad[0]!r} is not an http://host:port URL"
            )
        if self.engine_nodes and len(self.engine_nodes) != len(self.engine_urls):
            raise ValueError(
                f"rollout.sglang.engine_nodes names {len(self.engine_nodes)} node(s) for "
                f"{len(self.engine_urls)} engine_urls: give one node per engine URL, in order, "
                "or none"
            )
        if self.engine_urls and self.num_engines not in (1, len(self.engine_urls)):
            raise ValueError(
                f"rollout.sglang.num_engines={self.num_engines} but {len(self.engine_urls)} "
                "engine_urls are given: attached engines are not launched; leave num_engines at 1"
            )
        if self.base_gpu_id is not None and self.base_gpu_id < 0:
            raise ValueError(f"rollout.sglang.base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.sglang.max_restarts must be >= 0, got {self.max_restarts}")
        owned = {
            "--model-path",
            "--host",
            "--port",
            "--tp-size",
            "--dtype",
            "--weight-version",
            "--skip-tokenizer-init",
            "--device",
            "--load-format",
            "--base-gpu-id",
            "--enable-metrics",
        }
        clash = sorted(a.split("=")[0] for a in self.extra_args if a.split("=")[0] in owned)
        if clash:
            raise ValueError(
                f"rollout.sglang.extra_args sets {clash}, which the engine sets "
                "itself; use the matching rollout.sglang fields instead"
            )


def _is_http_url(url: str) -> bool:
    parsed = urlparse(url)
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and parsed.port is not None


def block_quant_shape_problem(model, tp: int, block: tuple[int, int]) -> str | None:
    """Why SGLang would refuse, before loading anything, to serve ``model`` (a ``ModelConfig``)
    with block-quantized FP8 weights of tile ``block`` = (block_n, block_k) on ``tp`` GPUs, or
    None. SGLang 0.5.23, ``layers/quantization/fp8.py: Fp8LinearMethod.validate_block_quant_shapes``:
    every output partition of a merged linear (q/k/v, gate/up: checked even at TP 1) and of a
    column-parallel linear split over TP must be a multiple of block_n; the input partition of a
    row-parallel linear split over TP (o_proj, down_proj) a multiple of block_k. KV heads are
    replicated, one per rank, when TP exceeds their count (``QKVParallelLinear``). A MoE model's
    experts, ``Fp8MoEMethod.create_weights``: the same two rules on each expert's width over TP
    (``FusedMoE``'s ``intermediate_size_per_partition``; the engines run no expert parallelism)."""
    block_n, block_k = block
    d = model.kv_channels
    kv_per_rank = max(1, model.num_query_groups // tp)
    attention = model.num_attention_heads * d // tp
    mlp, which = model.ffn_hidden_size // tp, "gate_proj / up_proj"
    if model.num_experts is not None:
        mlp, which = model.expert_ffn_hidden_size // tp, "experts' gate_proj / up_proj"
    # (linear, which side, width per rank, the block's size on that side, its name)
    checks = [
        ("q_proj", "output", attention, block_n, "rows"),
        ("k_proj / v_proj", "output", kv_per_rank * d, block_n, "rows"),
        (which, "output", mlp, block_n, "rows"),
    ]
    if tp > 1:  # a row-parallel linear's input is split only over TP > 1
        checks += [
            ("o_proj", "input", attention, block_k, "columns"),
            (which.replace("gate_proj / up_proj", "down_proj"), "input", mlp, block_k, "columns"),
        ]
    for name, side, width, size, dim in checks:
        if width % size:
            return (
                f"the {name} {side} per tensor-parallel rank is {width}, not a multiple of the "
                f"weight block's {dim} ({size})"
            )
    return None
