"""The SGLang engines as the registry describes them (``rollout/registry.py``): how the fleet is
built, its placements and restart policy, the settings SGLang cannot run with, and how the
planner sizes it (``sizing.py``). Importing it
imports no torch and no SGLang (the servers run in their own interpreter)."""

from __future__ import annotations

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.registry import EngineSpec, register_engine
from megatron_rl_fp8.rollout.sglang import sizing
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig, block_quant_shape_problem


def _build(
    cfg, hf_cfg, *, pad_token_id, eos_token_id, output_dir=None, pipeline_model_parallel_size=1, **_
):
    # lazy: torch (loading a config must not load the engines' code)
    from megatron_rl_fp8.rollout.sglang.fleet import SGLangFleet
    from megatron_rl_fp8.rollout.sglang.sender import Senders

    return SGLangFleet(
        cfg,
        hf_cfg,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        output_dir=output_dir,
        senders=Senders.from_env(pipeline_model_parallel_size),
    )


def _launcher():
    # lazy: torch (the role and the weight sync's sending ranks)
    from megatron_rl_fp8.rollout.sglang.launcher import LAUNCHER

    return LAUNCHER


def _check(cfg) -> None:
    if cfg.fp8.weight_quant == "per_tensor":
        # SGLang 0.5.23 (layers/quantization/fp8.py, Fp8LinearMethod.
        # process_weights_after_loading), run at start-up on the placeholder weights: a
        # per-tensor FP8 linear's weight becomes a transposed Parameter without weight_loader
        # (its scale a per-channel one on SM89+), so no hot update can land in it: fused
        # qkv / gate_up loads fail and a square o_proj would take its codes untransposed.
        # Block-quantized layers keep their loadable parameters. Checked against SGLang's
        # code in tests/unit/test_sglang_contracts.py.
        raise ValueError(
            "rollout.fp8.weight_quant=per_tensor is not supported with rollout.engine=sglang: "
            "SGLang's per-tensor FP8 layers replace their weight by a transposed Parameter "
            "without a weight_loader at start-up, so synced weights cannot be loaded into "
            "them; use rollout.fp8.weight_quant=blockwise (or rollout.engine=local for "
            "per-tensor numerics)"
        )


def _on_cpu(r, this_machine: bool) -> bool:
    """Whether the engines serve on CPUs: ``rollout.sglang.device`` says so, or ``auto`` on this
    machine without a GPU (a run planned for another machine counts as a GPU one)."""
    if r.sglang.device != "auto":
        return r.sglang.device == "cpu"
    if not this_machine:
        return False
    import torch  # lazy: loading a config imports no torch unless a GPU question is asked

    return not torch.cuda.is_available()


def _check_run(run, this_machine: bool) -> None:
    """SGLang engines that load FP8 checkpoints (on GPUs: on this machine when it has one, else
    wherever the run is planned for) refuse weight blocks their shards cannot hold; CPU engines
    cannot return a MoE's routes."""
    r = run.rollout
    on_cpu = _on_cpu(r, this_machine)
    if r.routing_replay != "none" and on_cpu:
        # SGLang 0.5.23, state_capturer/base.py: BaseHostCache pins the routes' host buffer with
        # cudaHostRegister (mem_cache/pool_host/common.py), which asserts CUDA at start-up.
        raise ConfigError(
            f"rollout.routing_replay={r.routing_replay} with SGLang engines on CPUs: SGLang "
            "returns routes only from GPU servers (its route capture pins host memory through "
            "CUDA); use rollout.engine=local on a CPU, or GPU engines"
        )
    if r.fp8.weight_quant != "blockwise" or on_cpu:
        return  # SGLang's CPU engine: the FP8-rounded weights are served unquantized
    tp = r.sglang.tp_size
    problem = block_quant_shape_problem(run.model, tp, r.fp8.weight_block)
    if problem:
        raise ConfigError(
            f"rollout.fp8.weight_block={list(r.fp8.weight_block)} with "
            f"rollout.sglang.tp_size={tp}: {problem}, which SGLang refuses at start-up; "
            "choose a block that divides it, another tp_size, or rollout.fp8.weight_quant=bf16"
        )


SGLANG = register_engine(
    EngineSpec(
        name="sglang",
        help="SGLang engines (one or a fleet behind sglang-router) launched by the driver "
        "(rollout.sglang; install: scripts/install_sglang_cpu.sh on CPU)",
        build=_build,
        placements=("dedicated", "colocated"),
        settings=SGLangConfig,
        settings_help="The SGLang engines (used when engine is sglang).",
        max_restarts=lambda cfg: cfg.sglang.max_restarts,
        error_label="sglang error",
        check=_check,
        check_run=_check_run,
        launcher=_launcher,
        fleet=sizing.fleet,
        trainer_gpu_share=sizing.trainer_gpu_share,
        launched_beside_trainer=sizing.launched_beside_trainer,
    )
)
