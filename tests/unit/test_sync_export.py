"""The weight-sync export path (sync/buckets.py): bucketing, FP8 round trip, and layout invariance.

* Buckets respect the size bound and keep an FP8 weight with its scale.
* Round trip: exporting a full Megatron state dict and dequantizing gives the HF state dict of the
  same weights within the e4m3 rounding bound (|error| <= |w| / 16 + scale * 2^-10 per element: half
  an ulp of a 3-bit mantissa, plus the subnormal step); with weight_quant=bf16 it is bit-exact.
* Layouts: the stream exported on the driver from a TP=2 or a PP=2 actor (real gloo ranks, real
  Megatron GPTModel, TP all-gather + PP send) is bit-identical to the TP=1 stream, so any engine fed
  from a sharded trainer sees exactly the weights of the unsharded one.
"""

import io
import zlib

import pytest
import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_state_to_mcore
from megatron_rl_fp8.sync.buckets import (
    ExportStats,
    export_for_rollout,
    iter_buckets,
    rollout_stream,
    tensor_bytes,
)
from megatron_rl_fp8.sync.quantize import SCALE_SUFFIX, dequantize_stream, is_fp8_weight
from tests.dist_utils import run_distributed

MODEL = dict(
    arch="qwen3",
    num_layers=2,
    hidden_size=256,
    ffn_hidden_size=384,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=53,
    max_position_embeddings=32,
)


def _hf_state(mc: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    import transformers

    from megatron_rl_fp8.models.hf_mapping import hf_config

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(mc), dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for k, v in sd.items():  # non-trivial norms, so their mapping is exercised too
        if "norm" in k:
            v.add_(0.1 * torch.randn(v.shape, generator=gen))
    return sd


def test_buckets_respect_the_bound_and_keep_order():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 20, 5, 100, 1, 1, 30])]
    buckets = list(iter_buckets(named, bucket_bytes=25 * 4))
    assert [n for b in buckets for n in b.names] == [n for n, _ in named]
    for b in buckets:
        assert b.nbytes <= 100 or len(b.tensors) == 1  # only a single oversized tensor may exceed
    assert [b.names for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4", "t5"], ["t6"]]
    assert [b.index for b in buckets] == list(range(5))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named, 0))


def test_scale_travels_with_its_weight():
    w = "model.layers.0.mlp.up_proj.weight"
    named = [
        ("a", torch.zeros(24)),
        (w, torch.zeros(20, dtype=torch.float8_e4m3fn)),
        (w + SCALE_SUFFIX, torch.zeros(4)),
        ("b", torch.zeros(1)),
    ]
    buckets = list(iter_buckets(named, bucket_bytes=100))
    owner = {n: b.index for b in buckets for n in b.names}
    assert owner[w] == owner[w + SCALE_SUFFIX]


@pytest.mark.parametrize("quant", ["blockwise", "per_tensor"])
def test_fp8_round_trip_within_e4m3_bound(quant):
    mc = ModelConfig(**MODEL)
    hf = _hf_state(mc)
    mcore = hf_state_to_mcore(hf, mc, padded_vocab_size=128)
    fp8 = RolloutFP8Config(weight_quant=quant)
    stats = ExportStats()
    exported = [
        (n, t)
        for b in export_for_rollout(mcore.items(), mc, fp8, bucket_mb=0.25, stats=stats)
        for n, t in b.tensors
    ]
    names = [n for n, _ in exported]
    assert stats.buckets > 1 and stats.tensors == len(exported)
    assert stats.bytes_out == sum(tensor_bytes(t) for _, t in exported)
    scales = dict((n[: -len(SCALE_SUFFIX)], t) for n, t in exported if n.endswith(SCALE_SUFFIX))
    fp8_names = [n for n in hf if is_fp8_weight(n)]
    assert fp8_names and set(scales) == set(fp8_names)
    assert all(dict(exported)[n].dtype == torch.float8_e4m3fn for n in fp8_names)
    back = dict(dequantize_stream(exported, block=fp8.weight_block))
    assert set(back) == set(hf) and len(names) == len(hf) + len(fp8_names)
    for name, ref in hf.items():
        got = back[name]
        if name not in scales:
            assert torch.equal(got, ref), name
            continue
        scale = scales[name]
        if scale.dim() == 2:  # per-block scale broadcast to elements
            scale = scale.repeat_interleave(128, 0)[: ref.shape[0]].repeat_interleave(128, 1)[
                :, : ref.shape[1]
            ]
        bound = ref.abs() / 16 + scale * 2.0**-10 + 1e-12
        assert ((got - ref).abs() <= bound).all(), name
        assert (got - ref).abs().max() > 0  # really quantized


def test_bf16_export_is_exact_and_casts_on_request():
    mc = ModelConfig(**MODEL)
    hf = _hf_state(mc, seed=3)
    mcore = hf_state_to_mcore(hf, mc, padded_vocab_size=128)
    out = dict(
        n_t
        for b in export_for_rollout(mcore.items(), mc, RolloutFP8Config(), bucket_mb=1)
        for n_t in b.tensors
    )
    assert set(out) == set(hf)
    assert all(torch.equal(out[k], hf[k]) for k in hf)
    cast = dict(rollout_stream(hf.items(), RolloutFP8Config(), dequantize_to=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in cast.values())


def test_rollout_stream_quantizes_only_what_is_not_quantized_yet():
    from megatron_rl_fp8.sync.quantize import quantize_for_rollout

    mc = ModelConfig(**MODEL)
    hf = _hf_state(mc, seed=5)
    fp8 = RolloutFP8Config(weight_quant="blockwise")
    once = list(quantize_for_rollout(hf.items(), fp8))
    twice = list(rollout_stream(once, fp8))
    raw = list(rollout_stream(hf.items(), fp8))
    assert [n for n, _ in twice] == [n for n, _ in once] == [n for n, _ in raw]
    assert all(torch.equal(_bits(a), _bits(b)) for (_, a), (_, b) in zip(twice, raw))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# -- layout invariance (real ranks) --------------------------------------------------------------
def _det_full(name: str, shape, vocab_size: int) -> torch.Tensor:
    """A deterministic full tensor for a global Megatron name (padded vocab rows are zero)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    shape = list(shape)
    if "word_embeddings" in name or name == "output_layer.weight":
        t = torch.zeros(shape)
        t[:vocab_size] = 0.05 * torch.randn([vocab_size] + shape[1:], generator=gen)
        return t
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return 0.05 * torch.randn(shape, generator=gen)


def _export_body(rank, world, tp, pp, model_kw):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
    from megatron_rl_fp8.sync.gather import (
        global_names,
        iter_full_params,
        split_tp_shard,
        tp_partition_dim,
        unwrap,
    )

    g = parallel.initialize(
        parallel.ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        seed=1,
    )
    mc = ModelConfig(**model_kw)
    model = build_gpt_model(
        mc, transformer_config(mc, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    )
    names = global_names(unwrap(model))
    with torch.no_grad():
        for local, p in model.named_parameters():
            shape = list(p.shape)
            dim = tp_partition_dim(local)
            if dim is not None:
                shape[dim] *= tp
            full = _det_full(names[local], shape, mc.vocab_size)
            p.copy_(split_tp_shard(local, full, g.tp_rank, tp))
    out = {}
    for quant in ("bf16", "blockwise"):  # two syncs of the same weights
        # The builtin quantizer: bit-identical to modelopt's (test_rollout_quantizer.py), and no
        # modelopt import (seconds) in every spawned rank; what is compared here is the gather.
        fp8 = RolloutFP8Config(weight_quant=quant, quantizer="builtin")
        stream = iter_full_params(model, tp_group=g.tp, pp_group=g.pp, dst_global_rank=0)
        out[quant] = [
            (n, t.clone())
            for b in export_for_rollout(stream, mc, fp8, bucket_mb=0.5)
            for n, t in b.tensors
        ]
    parallel.destroy()
    if rank != 0:
        return None
    buf = io.BytesIO()  # plain bytes: tensors through the result queue would need shared memory
    torch.save(out, buf)
    return buf.getvalue()


def _run_export(world, tp, pp):
    return torch.load(
        io.BytesIO(run_distributed(_export_body, world_size=world, args=(tp, pp, MODEL))[0])
    )


def test_tp2_and_pp2_export_streams_equal_tp1():
    refs = _run_export(1, 1, 1)
    assert len(refs["bf16"]) > 10 and len(refs["blockwise"]) > len(refs["bf16"])
    for tp, pp, quant in ((2, 1, "bf16"), (2, 1, "blockwise"), (1, 2, "bf16"), (1, 2, "blockwise")):
        if quant == "bf16":
            runs = _run_export(2, tp, pp)
        got, ref = runs[quant], refs[quant]
        assert [n for n, _ in got] == [n for n, _ in ref], (tp, pp)
        for (n, a), (_, b) in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape, (tp, pp, n)
            assert torch.equal(_bits(a), _bits(b)), (tp, pp, n)
