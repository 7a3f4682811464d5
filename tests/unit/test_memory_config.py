"""The memory section: Megatron's recompute options, checked before anything starts."""

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.models.memory import MemoryConfig


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["memory.recompute_granularity=full"], "needs memory.recompute_method"),
        (["memory.recompute_granularity=partial"], "recompute_granularity"),
        (
            ["memory.recompute_granularity=selective", "memory.recompute_num_layers=1"],
            "apply to recompute_granularity=full only",
        ),
        (["memory.recompute_modules=[attn]"], "'attn' is not one of"),
    ],
)
def test_bad_recompute_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_recompute_layers_must_fit_a_pipeline_stage():
    full = ["memory.recompute_granularity=full", "memory.recompute_method=block"]
    cfg = load_config(None, [*full, "memory.recompute_num_layers=2"])
    assert cfg.validate(1) is cfg  # 2 layers, one stage
    with pytest.raises(ConfigError, match="exceeds the 1 layers of each pipeline stage"):
        load_config(
            None,
            [*full, "memory.recompute_num_layers=2", "parallel.pipeline_model_parallel_size=2"],
        ).validate(2)


def test_megatron_fields_and_the_te_only_modules():
    assert MemoryConfig().megatron_kwargs() == {}
    full = MemoryConfig(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    assert full.megatron_kwargs() == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    sel = MemoryConfig(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    sel.check_backend(use_te=True)
    with pytest.raises(ValueError, match=r"\['mlp'\] need Transformer Engine"):
        sel.check_backend(use_te=False)


def test_scale_feature_rules():
    from megatron_rl_fp8.config import ConfigError, load_config
    from megatron_rl_fp8.parallel import ParallelConfig, check_context_parallel

    with pytest.raises(ValueError, match="sequence_parallel needs parallel.tensor_model"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="overlap_param_gather needs parallel.use_distributed"):
        ParallelConfig(overlap_param_gather=True)
    assert (
        ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2).model_parallel_size
        == 4
    )
    with pytest.raises(ValueError, match="context_parallel_size=2 needs Transformer Engine"):
        check_context_parallel(2, use_te=False)
    check_context_parallel(2, use_te=True)
    with pytest.raises(ValueError, match="optimizer_cpu_offload needs Transformer Engine"):
        MemoryConfig(optimizer_cpu_offload=True).check_backend(use_te=False)
    with pytest.raises(ValueError, match="optimizer_offload_fraction must be in"):
        MemoryConfig(optimizer_offload_fraction=1.5)
    assert MemoryConfig().optimizer_kwargs() == {}

    cfg = "examples/tiny_cpu.yaml"
    # CP needs TE's attention (none here), and whole rows for per-sequence loss terms.
    with pytest.raises(ConfigError, match="context_parallel_size=2 needs Transformer Engine"):
        load_config(cfg, ["parallel.context_parallel_size=2"]).validate(2)
    load_config(cfg, ["parallel.context_parallel_size=2"]).validate(2, this_machine=False)
    with pytest.raises(ConfigError, match="seq-mean-token-mean divides by each sequence's"):
        cp2 = ["parallel.context_parallel_size=2", "loss.agg=seq-mean-token-mean"]
        load_config(cfg, cp2).validate(2, this_machine=False)
    with pytest.raises(ConfigError, match="world size 2 is not divisible"):
        load_config(cfg, ["parallel.context_parallel_size=4"]).validate(2, this_machine=False)
    with pytest.raises(ConfigError, match="optimizer_cpu_offload needs parallel.use_distributed"):
        load_config(cfg, ["memory.optimizer_cpu_offload=true"]).validate(1)
    load_config(cfg, ["parallel.use_distributed_optimizer=true"]).validate(2)
