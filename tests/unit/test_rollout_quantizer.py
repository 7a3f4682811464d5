"""rollout.fp8.quantizer: NVIDIA Model Optimizer's ``FP8QTensor`` against the builtin quantizers.

modelopt's ``FP8QTensor.quantize`` computes ``scale = amax / 448`` and ``codes = e4m3(x / scale)``,
which is the builtin rule operation for operation: a max is exact in any order, and a float32
division is correctly rounded in any kernel. So on a float32 input the two agree bit for bit,
codes *and* scales (stricter than the one-ulp scale tolerance one might expect), ragged edges and
round-half ties included. (The fake-quant path of tests/unit/test_fp8_modelopt.py multiplies by
448 / amax instead, which can move a value off a tie; this path divides, as ours does.) The sync
path casts a bf16 weight to float32 before modelopt, so bf16-origin weights agree bit for bit too.

* Blockwise and per-tensor codes, scales, shapes, dtypes and devices equal the builtin's; so do
  their dequantized weights; exact round-half ties go to the even code in both.
* Non-default blocks, ``pow2_scale``, all-zero blocks (modelopt alone would give NaN codes) and
  weights quantized in bands.
* The config names the bad quantizer; a missing modelopt says what to install or set.
* ``quantize_for_rollout`` and the whole ``export_for_rollout`` give identical streams and buckets
  with either quantizer, on a tiny model whose every linear shape is ragged (not a multiple of 128).
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.fp8.quantize import quantize_blockwise, quantize_per_tensor
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.sync import quantize as sync_quantize
from megatron_rl_fp8.sync.buckets import export_for_rollout
from megatron_rl_fp8.sync.quantize import (
    MODELOPT_MISSING,
    dequantize_weight,
    modelopt_quantize,
    quantize_for_rollout,
)

needs_modelopt = pytest.mark.skipif(
    importlib.util.find_spec("modelopt") is None, reason="needs nvidia-modelopt"
)
E4M3 = torch.float8_e4m3fn
BLOCKWISE = RolloutFP8Config(weight_quant="blockwise")
PER_TENSOR = RolloutFP8Config(weight_quant="per_tensor")


def _weight(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Columns spanning 4 decades, so block scales genuinely differ.
    return (torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(got: tuple, ref: tuple) -> None:
    (codes, scale_inv), (ref_codes, ref_scale_inv) = got, ref
    assert codes.dtype == E4M3 and codes.shape == ref_codes.shape and codes.is_contiguous()
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == ref_scale_inv.shape
    assert codes.device == ref_codes.device and scale_inv.device == ref_scale_inv.device
    assert torch.equal(_bits(codes), _bits(ref_codes))
    assert torch.equal(scale_inv, ref_scale_inv)


@needs_modelopt
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(200, 300), (256, 384), (1, 5), (129, 1)])
def test_blockwise_equals_builtin(shape, dtype):
    w = _weight(shape, seed=shape[0] + shape[1], dtype=dtype)
    got = modelopt_quantize(w, BLOCKWISE)
    _assert_same(got, quantize_blockwise(w))
    assert got[1].shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = dequantize_weight(*got, block=(128, 128), dtype=torch.float32)
    ref = dequantize_weight(*quantize_blockwise(w), block=(128, 128), dtype=torch.float32)
    assert torch.equal(deq, ref)
    # and it is a quantization of w: within half an e4m3 ulp (3-bit mantissa) or the subnormal step
    scale = got[1].repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert ((deq - w.float()).abs() <= w.float().abs() / 16 + scale * 2.0**-10).all()


@needs_modelopt
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_equals_builtin(dtype):
    w = _weight((200, 300), seed=7, dtype=dtype)
    got = modelopt_quantize(w, PER_TENSOR)
    _assert_same(got, quantize_per_tensor(w))
    assert got[1].dim() == 0


def _e4m3_midpoints() -> torch.Tensor:
    """Every exact midpoint between two neighbouring positive finite e4m3 values (float32)."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448, ascending
    return (values[:-1] + values[1:]) / 2


@needs_modelopt
def test_round_half_ties_go_to_the_even_code_in_both():
    # Each 128-column block holds 448 * 2^-8, so its scale is 2^-8 exactly and x / scale lands
    # exactly on every e4m3 midpoint (either sign) placed in it.
    scale = 2.0**-8
    mids = _e4m3_midpoints()
    ties = torch.cat([mids, -mids])
    top = torch.tensor([448.0])
    codes_over_scale = torch.cat([top, ties[:127], top, ties[127:]])  # 254 columns: 2 blocks
    w = (codes_over_scale * scale).repeat(3, 1)  # 3 x 254: ragged in both dims
    codes, scale_inv = modelopt_quantize(w, BLOCKWISE)
    assert torch.equal(scale_inv, torch.full((1, 2), scale))
    _assert_same((codes, scale_inv), quantize_blockwise(w))
    on_tie = torch.ones(codes_over_scale.shape, dtype=torch.bool)
    on_tie[[0, 128]] = False
    assert torch.equal(codes_over_scale[on_tie].sort().values, ties.sort().values)
    # round half to even: the even mantissa (last code bit 0) wins every tie
    assert ((_bits(codes)[:, on_tie] & 1) == 0).all()


@needs_modelopt
@pytest.mark.parametrize("pow2_scale", [False, True])
def test_other_blocks_and_pow2_scales_equal_builtin(pow2_scale):
    w = _weight((300, 200), seed=3)
    cfg = RolloutFP8Config(weight_quant="blockwise", weight_block=(64, 32), pow2_scale=pow2_scale)
    got = modelopt_quantize(w, cfg)
    _assert_same(got, quantize_blockwise(w, (64, 32), pow2_scale=pow2_scale))
    assert got[1].shape == (5, 7)
    if pow2_scale:
        mant, _ = torch.frexp(got[1])
        assert (mant == 0.5).all()


@needs_modelopt
def test_all_zero_blocks_get_scale_one_and_zero_codes():
    # modelopt alone gives amax 0 -> scale 0 -> codes e4m3(0 / 0) = NaN; the sync path must not.
    w = _weight((200, 300), seed=5)
    w[:128, :128] = 0.0
    w[3, 4] = -0.0  # the builtin keeps the sign of zero (code 0x80); so must modelopt's path
    got = modelopt_quantize(w, BLOCKWISE)
    _assert_same(got, quantize_blockwise(w))
    assert got[1][0, 0] == 1.0 and not got[0].float().isnan().any()
    zeros = torch.zeros(4, 5)
    zeros[0, 0] = -0.0
    for cfg, ref in (
        (BLOCKWISE, quantize_blockwise(zeros)),
        (PER_TENSOR, quantize_per_tensor(zeros)),
    ):
        _assert_same(modelopt_quantize(zeros, cfg), ref)


@needs_modelopt
@pytest.mark.parametrize("pow2_scale", [False, True])
def test_a_weight_quantized_in_bands_is_the_same(monkeypatch, pow2_scale):
    monkeypatch.setattr(sync_quantize, "_MODELOPT_BAND_ELEMS", 128 * 300)  # bands of 128 rows
    w = _weight((300, 300), seed=9, dtype=torch.bfloat16)
    w[256:, :128] = 0.0  # an all-zero block in the last (ragged) band
    cfg = RolloutFP8Config(weight_quant="blockwise", pow2_scale=pow2_scale)
    _assert_same(modelopt_quantize(w, cfg), quantize_blockwise(w, pow2_scale=pow2_scale))


def test_config_names_a_bad_quantizer():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "RolloutFP8Config.quantizer='nvidia' is not valid; choose one of 'modelopt', 'builtin'"
        ),
    ):
        RolloutFP8Config(quantizer="nvidia")
    with pytest.raises(ConfigError, match="rollout.fp8.quantizer: 'nvidia' is not one of"):
        load_config(None, ["rollout.fp8.quantizer=nvidia"])
    assert RolloutFP8Config().quantizer == "modelopt"
    assert load_config(None, ["rollout.fp8.quantizer=builtin"]).rollout.fp8.quantizer == "builtin"


def test_missing_modelopt_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization.qtensor", None)  # import fails
    assert MODELOPT_MISSING == (
        "rollout.fp8.quantizer=modelopt needs NVIDIA Model Optimizer: pip install nvidia-modelopt "
        "(or set rollout.fp8.quantizer=builtin)"
    )
    named = [("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2))]
    with pytest.raises(ImportError, match=re.escape(MODELOPT_MISSING)):
        list(quantize_for_rollout(named, BLOCKWISE))
    builtin = RolloutFP8Config(weight_quant="blockwise", quantizer="builtin")
    assert len(list(quantize_for_rollout(named, builtin))) == 2  # codes + scale, no modelopt


def _both(cfg: RolloutFP8Config) -> tuple[RolloutFP8Config, RolloutFP8Config]:
    fields = dict(weight_quant=cfg.weight_quant, weight_block=cfg.weight_block)
    return (
        RolloutFP8Config(**fields, quantizer="modelopt"),
        RolloutFP8Config(**fields, quantizer="builtin"),
    )


def _assert_same_stream(got: list, ref: list) -> None:
    assert [n for n, _ in got] == [n for n, _ in ref]
    for (name, a), (_, b) in zip(got, ref):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), name
        assert torch.equal(_bits(a.reshape(-1)), _bits(b.reshape(-1))), name


@needs_modelopt
@pytest.mark.parametrize("cfg", [BLOCKWISE, PER_TENSOR], ids=["blockwise", "per_tensor"])
def test_quantize_for_rollout_streams_are_identical(cfg):
    named = [
        ("model.embed_tokens.weight", _weight((53, 160), seed=0)),
        ("model.layers.0.self_attn.q_proj.weight", _weight((160, 160), seed=1)),
        ("model.layers.0.input_layernorm.weight", torch.ones(160)),
        ("model.layers.0.mlp.down_proj.weight", _weight((160, 200), seed=2, dtype=torch.bfloat16)),
    ]
    modelopt, builtin = _both(cfg)
    got = list(quantize_for_rollout(named, modelopt))
    _assert_same_stream(got, list(quantize_for_rollout(named, builtin)))
    # embed | q codes, q scale | norm | down codes, down scale
    assert [t.dtype for _, t in got] == [torch.float32, E4M3, torch.float32] * 2


# Every linear is ragged: q/o 160x160, k/v 80x160, gate/up 200x160, down 160x200.
RAGGED_MODEL = dict(
    arch="qwen3",
    num_layers=1,
    hidden_size=160,
    ffn_hidden_size=200,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=53,
    max_position_embeddings=32,
)


@needs_modelopt
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [BLOCKWISE, PER_TENSOR], ids=["blockwise", "per_tensor"])
def test_export_for_rollout_buckets_are_identical(cfg, dtype):
    import transformers

    from megatron_rl_fp8.models.hf_mapping import hf_config, hf_state_to_mcore

    mc = ModelConfig(**RAGGED_MODEL)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config(mc), dtype=torch.float32)
    hf = {k: v.detach().to(dtype) for k, v in hf_model.state_dict().items()}
    mcore = hf_state_to_mcore(hf, mc, padded_vocab_size=64)
    modelopt, builtin = _both(cfg)
    got, ref = (
        list(export_for_rollout(mcore.items(), mc, fp8, bucket_mb=0.1))
        for fp8 in (modelopt, builtin)
    )
    assert len(got) == len(ref) > 1
    for a, b in zip(got, ref):
        assert a.index == b.index
        _assert_same_stream(a.tensors, b.tensors)
    assert sum(t.dtype == E4M3 for b in got for _, t in b.tensors) == 7 * mc.num_layers
