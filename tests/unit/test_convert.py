"""Checkpoint conversion (megatron_rl_fp8.convert): HF <-> Megatron dist checkpoints, FP8 export.

Tiny random-weight transformers models of each family are written as sharded safetensors; the
round trip HF -> dist checkpoint -> HF must be bit-exact, and broken inputs must fail with an
error naming the problem while leaving no output behind. (That Megatron itself loads the
converted checkpoint and reproduces transformers' logits is tests/distributed/test_convert_megatron.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl_fp8.convert import ConvertError, export_fp8, hf_to_mcore, mcore_to_hf
from megatron_rl_fp8.convert.assembly import assemble_pieces, hf_to_mcore_plan
from megatron_rl_fp8.fp8.quantize import dequantize_blockwise
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import (
    MappingError,
    expected_hf_shapes,
    hf_config,
    hf_state_to_mcore,
    model_config_from_hf,
)

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
TOKENIZER = Path(__file__).resolve().parents[2] / "megatron_rl_fp8/data/assets/tokenizer"


def arch_fields(arch: str) -> dict:
    """ModelConfig fields of a test family: ``qwen3_moe`` is Qwen3 with 4 experts, top-2, each
    expert 24 wide (so that no expert tensor is square: a transposed mapping would not fit)."""
    if arch == "qwen3_moe":
        return {"arch": "qwen3", "num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 24}
    return {"arch": arch}


def tiny_model_config(arch: str, *, hidden: int = 64, layers: int = 2) -> ModelConfig:
    # llama tied, the Qwens untied: both embedding layouts are exercised.
    return ModelConfig(
        **arch_fields(arch),
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=2 * hidden,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=53,
        tie_word_embeddings=arch == "llama",
    )


def make_hf_model(
    path: Path,
    arch: str,
    *,
    hidden: int = 64,
    dtype=torch.float32,
    seed: int = 0,
    max_shard_size: str = "40KB",
) -> Path:
    """A random-weight transformers model saved as several safetensors shards + tokenizer."""
    import transformers

    mc = tiny_model_config(arch, hidden=hidden)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(mc), dtype=dtype)
    with torch.no_grad():  # norms and biases away from their init, so their mapping is visible
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    for f in TOKENIZER.iterdir():
        shutil.copyfile(f, path / f.name)
    return path


def read_hf(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module", params=ARCHS)
def hf_dir(request, tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp(request.param) / "hf", request.param)


def _no_leftovers(out: Path) -> bool:
    return not out.exists() and not any(
        p.name.startswith(f".{out.name}.") for p in out.parent.iterdir()
    )


# -- the mapping additions -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_plan_pieces_rebuild_hf_state_to_mcore(arch):
    """The row-block plan the writer uses gives exactly hf_state_to_mcore's fused tensors."""
    mc = ModelConfig(
        **arch_fields(arch),
        num_layers=2,
        hidden_size=48,
        ffn_hidden_size=40,
        num_attention_heads=6,
        num_query_groups=2,
        head_dim=8,
        vocab_size=30,
    )
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen) for n, s in expected_hf_shapes(mc).items()}
    full = hf_state_to_mcore(hf, mc)
    plan = hf_to_mcore_plan(mc)
    assert [n for n, _ in plan] == sorted(full, key=[n for n, _ in plan].index)
    assert set(n for n, _ in plan) == set(full)
    for name, pieces in plan:
        assert torch.equal(assemble_pieces(pieces, hf.__getitem__), full[name]), name
        rows = {p.rows[1] - p.rows[0] if p.rows else hf[p.hf_name].shape[0] for p in pieces}
        assert len(rows) == 1, f"{name}: pieces must be equal-sized for a regular shard grid"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_model_config_from_hf_inverts_hf_config(arch, tied):
    mc = ModelConfig(
        **arch_fields(arch),
        num_layers=3,
        hidden_size=96,
        ffn_hidden_size=200,
        num_attention_heads=6,
        num_query_groups=3,
        head_dim=24,
        vocab_size=77,
        max_position_embeddings=512,
        rope_theta=1e6,
        norm_eps=1e-5,
        tie_word_embeddings=tied,
        params_dtype="float32",
    )
    back, notes = model_config_from_hf(hf_config(mc).to_dict(), params_dtype="float32")
    assert back == mc and notes == []


def test_model_config_from_hf_reads_v4_style_llama31():
    """A transformers-4 style Llama 3.1 config (rope_theta + rope_scaling at top level)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    mc, notes = model_config_from_hf(cfg)
    assert (mc.arch, mc.kv_channels, mc.rope_theta, mc.params_dtype) == (
        "llama",
        128,
        5e5,
        "bfloat16",
    )
    assert mc.padded_vocab_size(1) == 128256 and mc.padded_vocab_size(8) == 129024
    assert mc.rope_scaling_factor == 8.0 and notes == []
    assert model_config_from_hf({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})[1]


def test_model_config_from_hf_rejects_unknown_architecture():
    with pytest.raises(MappingError, match=r"MixtralForCausalLM.*supported"):
        model_config_from_hf({"architectures": ["MixtralForCausalLM"]})
    with pytest.raises(MappingError, match="hidden_act"):
        model_config_from_hf({"architectures": ["Qwen2ForCausalLM"], "hidden_act": "gelu"})


# -- round trips ---------------------------------------------------------------------------------
def test_roundtrip_is_bit_exact(hf_dir, tmp_path):
    mcore = tmp_path / "mcore"
    stats = hf_to_mcore(
        hf_dir, mcore, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, progress=False
    )
    assert (mcore / "latest").read_text().strip() == "iter_0000000"
    state = json.loads((mcore / "iter_0000000/trainer_state.json").read_text())
    assert state["padded_vocab_size"] == 256 and state["model"]["vocab_size"] == 53
    assert stats["tensors"] > 0 and stats["bytes"] > 0 and "GB/s" in stats["summary"]

    back = tmp_path / "back"
    mcore_to_hf(mcore, back, hf_config_dir=hf_dir, max_shard_size="30KB", progress=False)
    src, out = read_hf(hf_dir), read_hf(back)
    assert sorted(src) == sorted(out)
    for name in src:
        assert src[name].dtype == out[name].dtype and torch.equal(src[name], out[name]), name
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(src) and len(set(index["weight_map"].values())) > 1
    assert all((back / f).is_file() for f in index["weight_map"].values())
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    for f in TOKENIZER.iterdir():
        assert (back / f.name).read_bytes() == f.read_bytes()
    assert _no_leftovers(tmp_path / "never") and not list(tmp_path.glob(".*partial"))


def test_roundtrip_bf16_single_shard(tmp_path):
    hf = make_hf_model(tmp_path / "hf", "qwen2", dtype=torch.bfloat16, max_shard_size="10MB")
    assert (hf / "model.safetensors").is_file()
    hf_to_mcore(hf, tmp_path / "m", progress=False)
    mcore_to_hf(tmp_path / "m/iter_0000000", tmp_path / "back", hf_config_dir=hf, progress=False)
    src, out = read_hf(hf), read_hf(tmp_path / "back")
    assert all(out[n].dtype == torch.bfloat16 and torch.equal(src[n], out[n]) for n in src)
    assert (tmp_path / "back/model.safetensors").is_file()
    assert not (tmp_path / "back/model.safetensors.index.json").exists()


# -- broken inputs -------------------------------------------------------------------------------
def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(hf: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    tensors = load_file(hf / shard)
    fn(tensors, index)
    save_file(tensors, hf / shard, metadata={"format": "pt"})
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named_and_nothing_written(tmp_path):
    hf = _broken_copy(make_hf_model(tmp_path / "src", "qwen3"), tmp_path / "hf")

    def drop(tensors, index):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]

    _rewrite_shard(hf, drop)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        hf_to_mcore(hf, out, progress=False)
    with pytest.raises(ConvertError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        export_fp8(out, hf_dir=hf, progress=False)
    assert _no_leftovers(out)


def test_wrong_shape_is_named_and_nothing_written(tmp_path):
    hf = _broken_copy(make_hf_model(tmp_path / "src", "qwen3"), tmp_path / "hf")

    def shrink(tensors, index):
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][
            :-1
        ]

    _rewrite_shard(hf, shrink)
    out = tmp_path / "out"
    with pytest.raises(
        ConvertError, match=r"wrong shape.*up_proj.weight \(127, 64\) \(expected \(128, 64\)\)"
    ):
        hf_to_mcore(hf, out, progress=False)
    assert _no_leftovers(out)


def test_unexpected_tensor_is_named(tmp_path):
    hf = _broken_copy(make_hf_model(tmp_path / "src", "llama"), tmp_path / "hf")

    def add(tensors, index):
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
        index["weight_map"]["model.layers.0.mlp.extra.weight"] = index["weight_map"][
            "model.layers.1.mlp.up_proj.weight"
        ]

    _rewrite_shard(hf, add)
    with pytest.raises(ConvertError, match=r"unexpected \['model.layers.0.mlp.extra.weight'\]"):
        hf_to_mcore(hf, tmp_path / "out", progress=False)


def test_truncated_shard_is_named_and_nothing_written(tmp_path):
    hf = _broken_copy(make_hf_model(tmp_path / "src", "qwen2"), tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=rf"cannot read shard .*{shard.name}.*truncated"):
        hf_to_mcore(hf, out, progress=False)
    assert _no_leftovers(out)


def test_missing_shard_file_is_named(tmp_path):
    hf = _broken_copy(make_hf_model(tmp_path / "src", "qwen2"), tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ConvertError, match=rf"names shard {shard.name}, which does not exist"):
        hf_to_mcore(hf, tmp_path / "out", progress=False)


def test_mcore_to_hf_rejects_mismatched_config_and_keeps_existing_out(tmp_path):
    a = make_hf_model(tmp_path / "a", "qwen3")
    b = make_hf_model(tmp_path / "b", "qwen2")  # qwen2 has biases, qwen3 has QK-norm
    hf_to_mcore(a, tmp_path / "m", progress=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ConvertError, match="not empty; pass --overwrite"):
        mcore_to_hf(tmp_path / "m", out, hf_config_dir=a, progress=False)
    with pytest.raises(
        ConvertError, match=r"missing \[.*linear_qkv.bias.*unexpected \[.*q_layernorm"
    ):
        mcore_to_hf(tmp_path / "m", out, hf_config_dir=b, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    mcore_to_hf(tmp_path / "m", out, hf_config_dir=a, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".out.*"))


def test_unsupported_architecture_writes_nothing(tmp_path):
    hf = _broken_copy(make_hf_model(tmp_path / "src", "qwen2"), tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=r"config.json: .*GPTNeoXForCausalLM.*not supported"):
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert _no_leftovers(tmp_path / "out")


# -- FP8 export ----------------------------------------------------------------------------------
E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative, in the normal range
E4M3_SUB = 2.0**-10  # half the subnormal spacing (2^-9), in units of the block scale


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    hf = make_hf_model(root / "hf", "qwen2", hidden=128)  # 128-multiples: real block grid
    export_fp8(root / "fp8", hf_dir=hf, keep_last_layers=1, max_shard_size="200KB", progress=False)
    return hf, root / "fp8"


def test_fp8_export_format(fp8_export):
    hf, out = fp8_export
    cfg = json.loads((out / "config.json").read_text())
    skip = ["lm_head"] + [
        f"model.layers.1.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    assert cfg["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": skip,
    }
    src, q = read_hf(hf), read_hf(out)
    fp8_names = {n for n, t in q.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_names == {
        f"model.layers.0.{m}.weight"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    for name in fp8_names:  # every weight within the E4M3 rounding bound of its block scale
        scale = q[name + "_scale_inv"]
        assert scale.dtype == torch.float32
        assert scale.shape == (-(-src[name].shape[0] // 128), -(-src[name].shape[1] // 128))
        w = src[name].float()
        deq = dequantize_blockwise(q[name], scale, dtype=torch.float32)
        s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        assert ((deq - w).abs() <= E4M3_REL * w.abs() + E4M3_SUB * s + 1e-12).all(), name
    others = set(src) - fp8_names
    assert all(
        q[n].dtype == torch.bfloat16 and torch.equal(q[n], src[n].bfloat16()) for n in others
    )
    assert set(q) == set(src) | {n + "_scale_inv" for n in fp8_names}


def _logits(model_dir_or_state, ids, cfg_dir):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(cfg_dir)
    cfg.quantization_config = None
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(model_dir_or_state)
    with torch.no_grad():
        return model(ids).logits


def test_fp8_export_logits_within_fp8_error(fp8_export):
    """Dequantized FP8 weights vs the BF16 weights, both run in float32 by transformers.

    Bound: E4M3 keeps ~4 significant bits (relative rounding error <= 2^-4, RMS ~2^-4/sqrt(3) ~
    3.6% per weight); through two layers of random weights that gives logit errors of a few
    percent of the logit scale. We require max |dlogit| < 15% of max |logit| and RMS error < 6%
    of the logit RMS, and check the error is real quantization error (far above BF16 rounding).
    """
    hf, out = fp8_export
    src, q = read_hf(hf), read_hf(out)
    deq = {}
    for n, t in q.items():
        if n.endswith("_scale_inv"):
            continue
        deq[n] = (
            dequantize_blockwise(t, q[n + "_scale_inv"], dtype=torch.float32)
            if t.dtype == torch.float8_e4m3fn
            else t.float()
        )
    ids = torch.randint(0, 53, (3, 16), generator=torch.Generator().manual_seed(0))
    ref = _logits({n: t.bfloat16().float() for n, t in src.items()}, ids, hf)
    got = _logits(deq, ids, hf)
    err = got - ref
    assert err.abs().max() < 0.15 * ref.abs().max(), (err.abs().max(), ref.abs().max())
    assert err.pow(2).mean().sqrt() < 0.06 * ref.pow(2).mean().sqrt()
    assert err.abs().max() > 1e-4  # not accidentally comparing BF16 with BF16


def _load_dequantized_with_transformers(out: Path) -> dict[str, torch.Tensor]:
    """The state dict transformers' FP8 loader makes of the export ``out``, dequantized, with
    the export's own ``modules_to_not_convert`` (the override replaces the checkpoint's)."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loader requires accelerate")
    import transformers

    skip = json.loads((out / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    qc = transformers.FineGrainedFP8Config(dequantize=True, modules_to_not_convert=skip)
    return transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=qc
    ).state_dict()


def test_fp8_export_loads_with_transformers_finegrained_fp8(fp8_export):
    """transformers' own FP8 reader (FineGrainedFP8) must dequantize our export to exactly our
    dequantization. It needs ``accelerate``. Dequantizing is asked for explicitly: left to itself
    the loader dequantizes only where no FP8-capable GPU is visible, and elsewhere keeps float8
    weights (which cannot be compared with bf16). The override also replaces the checkpoint's
    ``modules_to_not_convert``, so the export's own list is passed along."""
    hf, out = fp8_export
    state = _load_dequantized_with_transformers(out)
    q = read_hf(out)
    for n, t in q.items():
        if t.dtype == torch.float8_e4m3fn:
            ours = dequantize_blockwise(t, q[n + "_scale_inv"], dtype=torch.bfloat16)
            assert torch.equal(state[n], ours), n


@pytest.fixture(scope="module")
def fp8_moe_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_moe")
    hf = make_hf_model(root / "hf", "qwen3_moe", hidden=128)
    export_fp8(root / "fp8", hf_dir=hf, keep_last_layers=1, progress=False)
    return hf, root / "fp8"


def test_fp8_export_quantizes_each_expert_and_keeps_the_router(fp8_moe_export):
    """Qwen3-MoE: every expert linear of a converted layer is FP8 with its own block scales, the
    router stays BF16, and a kept layer's experts are skipped by their module prefix."""
    hf, out = fp8_moe_export
    skip = json.loads((out / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert "model.layers.1.mlp.experts" in skip and not any(".mlp.gate" in m for m in skip)
    src, q = read_hf(hf), read_hf(out)
    fp8_names = {n for n, t in q.items() if t.dtype == torch.float8_e4m3fn}
    experts = {
        f"model.layers.0.mlp.experts.{e}.{x}_proj.weight"
        for e in range(4)
        for x in ("gate", "up", "down")
    }
    attention = {f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkvo"}
    assert fp8_names == experts | attention
    assert q["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    for name in experts:
        assert q[name + "_scale_inv"].shape == (-(-src[name].shape[0] // 128), 1)
        deq = dequantize_blockwise(q[name], q[name + "_scale_inv"], dtype=torch.float32)
        assert (deq - src[name]).abs().max() <= 2**-4 * src[name].abs().max(), name


def test_fp8_moe_export_loads_with_transformers_finegrained_fp8(fp8_moe_export):
    """transformers' FP8 reader fuses our per-expert FP8 tensors into its in-memory experts
    (``gate_up_proj`` [experts, 2 x width, hidden], ``down_proj``): each expert dequantizes to
    exactly our dequantization, and the kept layer's experts are the BF16 weights."""
    hf, out = fp8_moe_export
    state = _load_dequantized_with_transformers(out)
    src, q = read_hf(hf), read_hf(out)

    def ours(layer, e, x):
        n = f"model.layers.{layer}.mlp.experts.{e}.{x}_proj.weight"
        if layer == 1:
            return src[n].bfloat16()
        return dequantize_blockwise(q[n], q[n + "_scale_inv"], dtype=torch.bfloat16)

    for layer in (0, 1):
        fused = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(4):
            assert torch.equal(fused[e], torch.cat([ours(layer, e, "gate"), ours(layer, e, "up")]))
            assert torch.equal(down[e], ours(layer, e, "down"))


# -- command line --------------------------------------------------------------------------------
def test_cli_convert_subcommand_runs_all_three(tmp_path, capsys):
    from megatron_rl_fp8.cli import main

    hf = make_hf_model(tmp_path / "hf", "qwen3", hidden=128)
    assert (
        main(
            [
                "convert",
                "hf-to-mcore",
                "--hf",
                str(hf),
                "--out",
                str(tmp_path / "m"),
                "--tp",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "convert",
                "mcore-to-hf",
                "--ckpt",
                str(tmp_path / "m"),
                "--hf-config",
                str(hf),
                "--out",
                str(tmp_path / "back"),
                "--dtype",
                "bfloat16",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "convert",
                "export-fp8",
                "--ckpt",
                str(tmp_path / "m"),
                "--hf-config",
                str(hf),
                "--out",
                str(tmp_path / "fp8"),
                "--keep-first-layers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["hf-to-mcore", "mcore-to-hf", "export-fp8"]
    assert all(" tensors, " in ln and "GB/s) -> " in ln for ln in lines)
    src, back = read_hf(hf), read_hf(tmp_path / "back")
    assert all(
        back[n].dtype == torch.bfloat16 and torch.equal(back[n], src[n].bfloat16()) for n in src
    )
    assert json.loads((tmp_path / "back/config.json").read_text())["torch_dtype"] == "bfloat16"
    fp8 = read_hf(tmp_path / "fp8")  # from the dist checkpoint: layer 0 kept, layer 1 quantized
    assert fp8["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    from megatron_rl_fp8.cli import main

    (tmp_path / "empty").mkdir()  # --out beside the input: one inside it is refused first
    argv = ["convert", "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "config.json not found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--keep-first-layers", "100"], "keep all 2 layers in BF16: nothing would be FP8"),
        (["--keep-first-layers", "1", "--keep-last-layers", "1"], "keep all 2 layers"),
        (["--max-shard-size", "0"], "--max-shard-size '0': give a positive size"),
        (["--max-shard-size=-5GB"], "give a positive size"),
        (["--max-shard-size", "infGB"], "use e.g. 5GB, 500MB or a byte count"),
    ],
)
def test_export_refuses_settings_that_make_no_fp8_checkpoint(tmp_path, capsys, args, message):
    # Issue 44 #11: a checkpoint saying quant_method fp8 with no FP8 tensor in it, exit 0; or a
    # shard per tensor.
    from megatron_rl_fp8.cli import main

    hf = make_hf_model(tmp_path / "hf", "qwen3")
    capsys.readouterr()  # transformers' own progress bars
    argv = ["convert", "export-fp8", "--hf", str(hf), "--out", str(tmp_path / "fp8"), *args]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "fp8").exists()


# -- --out overlapping an input ------------------------------------------------------------------
@pytest.fixture(scope="module")
def convert_inputs(tmp_path_factory):
    """A real HF model and its dist checkpoint (root with ``latest``), copied into each test."""
    root = tmp_path_factory.mktemp("overlap")
    hf = make_hf_model(root / "hf", "qwen3")
    hf_to_mcore(hf, root / "ckpt", progress=False)
    return root


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under ``root``: file bytes, symlink target, or None for a directory."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            key = str(p.relative_to(root))
            out[key] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
    return out


# (argv, the flag the error names, how --out relates to it); {d} holds the checkpoint and a note.
OVERLAPS = {
    "out-is-hf": ("hf-to-mcore --hf {hf} --out {hf} --overwrite", "--hf", "is"),
    "out-is-ckpt": (
        "mcore-to-hf --ckpt {d}/ckpt --hf-config {hf} --out {d}/ckpt --overwrite",
        "--ckpt",
        "is",
    ),
    "out-holds-ckpt": (
        "mcore-to-hf --ckpt {d}/ckpt --hf-config {hf} --out {d} --overwrite",
        "--ckpt",
        "contains",
    ),
    "out-holds-ckpt-no-overwrite": (
        "mcore-to-hf --ckpt {d}/ckpt --hf-config {hf} --out {d}",
        "--ckpt",
        "contains",
    ),
    "out-is-hf-config": (
        "mcore-to-hf --ckpt {d}/ckpt --hf-config {hf} --out {hf} --overwrite",
        "--hf-config",
        "is",
    ),
    "out-inside-hf": ("export-fp8 --hf {hf} --out {hf}/fp8", "--hf", "is inside"),
    "out-inside-hf-config": (
        "export-fp8 --ckpt {d}/ckpt --hf-config {hf} --out {hf}/fp8 --overwrite",
        "--hf-config",
        "is inside",
    ),
    "out-inside-ckpt": (
        "export-fp8 --ckpt {d}/ckpt --hf-config {hf} --out {d}/ckpt/iter_0000000/fp8",
        "--ckpt",
        "is inside",
    ),
    "symlinked-input": ("hf-to-mcore --hf {link} --out {hf} --overwrite", "--hf", "is"),
    "symlinked-out": ("export-fp8 --hf {hf} --out {link}/fp8", "--hf", "is inside"),
    "input-is-staging-dir": (
        "hf-to-mcore --hf {root}/.m.partial --out {root}/m",
        "--hf",
        "is staged in {root}/.m.partial, which is or holds",
    ),
}


@pytest.mark.parametrize("case", OVERLAPS)
def test_cli_refuses_out_overlapping_an_input(case, convert_inputs, tmp_path, capsys):
    from megatron_rl_fp8.cli import main

    shutil.copytree(convert_inputs / "hf", tmp_path / "hf")
    shutil.copytree(convert_inputs / "ckpt", tmp_path / "d/ckpt")
    (tmp_path / "d/notes.txt").write_text("unrelated")
    shutil.copytree(convert_inputs / "hf", tmp_path / ".m.partial")
    (tmp_path / "link").symlink_to(tmp_path / "hf")
    paths = {
        "root": tmp_path,
        "hf": tmp_path / "hf",
        "d": tmp_path / "d",
        "link": tmp_path / "link",
    }
    template, flag, relation = (x.format(**paths) for x in OVERLAPS[case])
    argv = template.split()
    out, given = argv[argv.index("--out") + 1], argv[argv.index(flag) + 1]
    before = _tree(tmp_path)

    assert main(["convert", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"convert error: --out {out} {relation} {flag} {given}; "), err
    assert err.count("\n") == 1 and "outside every input" in err
    assert _tree(tmp_path) == before  # inputs intact, nothing written or deleted


def test_a_storage_refusal_while_writing_the_output_is_one_line(tmp_path):
    """Issue 31.3 for conversion: a full disk mid-write is a ConvertError naming --out, the
    staging directory is gone and an existing --out is untouched."""
    import errno
    import os

    from megatron_rl_fp8.convert.errors import ConvertError
    from megatron_rl_fp8.convert.staging import staged_output

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    with pytest.raises(ConvertError, match=r"cannot write --out .*out: no space left on the dev"):
        with staged_output(out, overwrite=True) as tmp:
            (tmp / "part").write_text("half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "model.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "old.txt").read_text() == "kept"
