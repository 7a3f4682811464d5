"""The rollout side's contract: what any engine (in-process, SGLang server) must offer the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from megatron_rl_fp8.config_utils import field
from megatron_rl_fp8.fp8.config import RolloutFP8Config

if TYPE_CHECKING:
    from megatron_rl_fp8.sync.buckets import Bucket


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    """The SGLang rollout server this run launches and owns (``rollout.engine: sglang``)."""

    python: str = field(
        ".venv-sglang/bin/python",
        help="Python that runs `sglang.launch_server` (relative paths: from the repository root). "
        "The default is the venv made by tools/install_sglang_cpu.sh; empty = the trainer's "
        "own interpreter (SGLang installed next to the trainer, e.g. on GPU clusters).",
    )
    transport: Literal["tensor", "distributed", "disk"] = field(
        "tensor",
        help="How synced weights reach the server: tensor = shared memory, same node "
        "(update_weights_from_tensor); distributed = a private NCCL/gloo group with the "
        "server's TP ranks (update_weights_from_distributed); disk = safetensors files "
        "(update_weights_from_disk).",
    )
    bucket_mb: float = field(512.0, help="Largest weight message to the server, in MiB.")
    tp_size: int = field(1, help="Tensor-parallel size of the SGLang server.")
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
        help="Where the server's model directory (last synced weights, the restart source) "
        "and logs go; empty = <train.output_dir>/sglang when the trainer passes it, else "
        "a temporary directory.",
    )
    startup_timeout_s: float = field(300.0, help="Seconds to wait for /health after a launch.")
    request_timeout_s: float = field(
        600.0,
        help="Seconds one HTTP call (a whole rollout batch, one weight bucket) may take "
        "before the server is declared hung and restarted.",
    )
    max_restarts: int = field(
        2,
        help="Server relaunches (each from the last complete synced weights) allowed per "
        "engine call -- one rollout or one weight sync, and counting relaunches that die "
        "in startup -- before the run fails with the server log.",
    )
    random_seed: int = field(0, help="SGLang --random-seed.")
    env: dict[str, str] = field(
        default_factory=dict, help="Extra environment variables for the server process."
    )
    extra_args: list[str] = field(
        default_factory=list, help="Extra `sglang.launch_server` arguments, appended verbatim."
    )

    def __post_init__(self):
        if self.transport not in ("tensor", "distributed", "disk"):
            raise ValueError(
                f"rollout.sglang.transport={self.transport!r} is not valid; choose "
                "tensor, distributed or disk"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"rollout.sglang.device={self.device!r} is not valid; choose auto, cpu or cuda"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"rollout.sglang.dtype={self.dtype!r} is not valid; choose auto, "
                "float32, bfloat16 or float16"
            )
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
        }
        clash = sorted(a.split("=")[0] for a in self.extra_args if a.split("=")[0] in owned)
        if clash:
            raise ValueError(
                f"rollout.sglang.extra_args sets {clash}, which the engine sets "
                "itself; use the matching rollout.sglang fields instead"
            )


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """How completions are sampled."""

    engine: Literal["local", "sglang"] = field(
        "local",
        help="local = in-process transformers engine on the driver rank (CPU boxes); "
        "sglang = an SGLang server launched and fed by the driver rank "
        "(rollout.sglang; install: tools/install_sglang_cpu.sh on CPU).",
    )
    sglang: SGLangConfig = field(
        default_factory=SGLangConfig, help="The SGLang server (used when engine is sglang)."
    )
    n_samples_per_prompt: int = field(8, help="Group size: completions sampled per prompt (GRPO).")
    temperature: float = field(1.0, help="Sampling temperature (logprobs use the same).")
    top_p: float = field(1.0, help="Nucleus sampling mass; 1.0 keeps logprobs unbiased.")
    max_new_tokens: int = field(8, help="Longest completion in tokens.")
    seed: int = field(1234, help="Base seed; step s samples with seed + s (resumable).")
    fp8: RolloutFP8Config = field(
        default_factory=RolloutFP8Config,
        help="FP8 rollout numerics: how synced weights are quantized (and activations, in the "
        "in-process engine). weight_quant=bf16 keeps the rollout in full precision.",
    )

    def __post_init__(self):
        if self.engine not in ("local", "sglang"):
            raise ValueError(f"rollout.engine={self.engine!r} is not valid; choose local or sglang")
        if self.n_samples_per_prompt < 1:
            raise ValueError(
                f"rollout.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}"
            )
        if self.temperature <= 0:
            raise ValueError(
                f"rollout.temperature must be > 0, got {self.temperature}; "
                "use a small value such as 1e-3 for near-greedy sampling"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class Completion:
    """One sampled completion (token ids exclude the prompt; eos included when produced)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finished: bool  # ended with eos (False = truncated at max_new_tokens)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        greedy: bool = False,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt, grouped: result[i * n + j] is prompt i, sample j."""

    @property
    def export_options(self) -> dict:
        """How this engine wants its weights exported: ``bucket_mb`` and ``dequantize_to``,
        keyword arguments of ``sync.buckets.export_for_rollout``."""

    def update_weights(self, buckets: Iterable[Bucket], *, version: int) -> None:
        """Load new weights (buckets of HF-named full tensors, as ``export_for_rollout`` makes
        them), then serve only that version."""

    def weight_version(self) -> int: ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...
