"""Megatron loads converted checkpoints: same logits as transformers, at TP=1, TP=2 and PP=2.

The HF -> dist checkpoint conversion runs *inside* the gloo group, so with 2 ranks each rank
writes its share (the torchrun path). The model is built by the project's providers and loaded
with the trainer's ``checkpoint.load`` (PP=2: through ``Actor.sharded_state_dict``), which
reshards the stored global tensors into this rank's TP/PP slice.

Tolerance: both sides compute in float32 from identical weights; the only differences are
summation orders in GEMMs / softmax (and, at TP=2, the split reductions), ~1e-6 at these sizes.
We assert 1e-4 (as tests/distributed/test_megatron_vs_hf.py does).
"""

import json
import re
from pathlib import Path

import torch

from tests.dist_utils import run_distributed
from tests.unit.test_convert import ARCHS, make_hf_model, read_hf

TOL = 1e-4


def _hf_logits(hf_dir, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def _logits_body(rank, world, root, tp):
    import torch.distributed as dist

    from megatron_rl_fp8 import checkpoint, parallel
    from megatron_rl_fp8.convert import hf_to_mcore
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=tp), seed=0)
    ids = torch.randint(0, 53, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None].expand(2, -1)
    errors = {}
    for arch in ARCHS:
        hf, out = Path(root) / arch / "hf", Path(root) / arch / f"mcore_tp{tp}"
        hf_to_mcore(hf, out, tensor_model_parallel_size=tp, progress=False)
        state = json.loads((out / "iter_0000000/trainer_state.json").read_text())
        mc = ModelConfig(**state["model"])
        model = build_gpt_model(mc, transformer_config(mc, tensor_model_parallel_size=tp))
        loaded, _ = checkpoint.load(checkpoint.latest(out), {"model": model.sharded_state_dict()})
        model.load_state_dict(loaded["model"])
        model.eval()  # Megatron refuses MoE + TP without sequence parallelism in training mode
        with torch.no_grad():
            local = model(ids, pos, None)  # [batch, seq, padded vocab / tp]
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=g.tp)
        logits = torch.cat(parts, dim=-1)
        if rank == 0:
            ref = _hf_logits(hf, ids)
            errors[arch] = (logits[..., : mc.vocab_size] - ref).abs().max().item()
            # Padding rows are zero, so padded logits are exactly 0 (masked downstream).
            assert torch.count_nonzero(logits[..., mc.vocab_size :]) == 0
    parallel.destroy()
    return errors


def _make_models(root: Path) -> None:
    for arch in ARCHS:
        make_hf_model(root / arch / "hf", arch)


def test_logits_match_transformers_tp1(tmp_path):
    _make_models(tmp_path)
    errors = run_distributed(_logits_body, world_size=1, args=(str(tmp_path), 1))[0]
    assert set(errors) == set(ARCHS) and max(errors.values()) < TOL, errors


def test_logits_match_transformers_tp2_two_rank_conversion(tmp_path):
    _make_models(tmp_path)
    errors = run_distributed(_logits_body, world_size=2, args=(str(tmp_path), 2))[0]
    assert set(errors) == set(ARCHS) and max(errors.values()) < TOL, errors


def _pp_body(rank, world, hf, out):
    from megatron_rl_fp8 import checkpoint, parallel
    from megatron_rl_fp8.convert import hf_to_mcore
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(pipeline_model_parallel_size=2), seed=0)
    hf_to_mcore(hf, out, pipeline_model_parallel_size=2, progress=False)
    state = json.loads((Path(out) / "iter_0000000/trainer_state.json").read_text())
    actor = Actor(ModelConfig(**state["model"]), OptimConfig(), g)
    loaded, trainer_state = checkpoint.load(
        checkpoint.latest(out), actor.sharded_state_dict(with_optimizer=False)
    )
    actor.load_sharded(loaded)
    ids = torch.randint(0, 53, (4, 10), generator=torch.Generator().manual_seed(2))
    res = actor.compute_logprobs({"input_ids": ids, "labels": ids}, micro_batch_size=2)
    parallel.destroy()
    if res is None:  # first stage
        return None
    return ids, res["logprobs"], res["entropy"], trainer_state["pipeline_model_parallel_size"]


def test_pp2_actor_loads_converted_checkpoint_and_roundtrip_is_bit_exact(tmp_path):
    from megatron_rl_fp8.convert import mcore_to_hf

    hf = make_hf_model(tmp_path / "hf", "qwen2")
    out = tmp_path / "mcore"
    first, last = run_distributed(_pp_body, world_size=2, args=(str(hf), str(out)))
    assert first is None
    ids, lp, ent, pp = last
    ref = torch.log_softmax(_hf_logits(hf, ids).float(), -1)
    ref_lp = ref.gather(-1, ids[..., None])[..., 0]
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert pp == 2
    assert (lp - ref_lp).abs().max() < TOL and (ent - ref_ent).abs().max() < TOL
    # The checkpoint written by two ranks converts back to the original tensors bit for bit.
    mcore_to_hf(out, tmp_path / "back", hf_config_dir=hf, progress=False)
    src, back = read_hf(hf), read_hf(tmp_path / "back")
    assert sorted(src) == sorted(back) and all(torch.equal(src[n], back[n]) for n in src)


def _ep_body(rank, world, hf, out):
    from megatron_rl_fp8 import checkpoint, parallel
    from megatron_rl_fp8.convert import hf_to_mcore
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    cfg = parallel.ParallelConfig(expert_model_parallel_size=2)
    g = parallel.initialize(cfg, seed=0)
    hf_to_mcore(hf, out, progress=False)
    state = json.loads((Path(out) / "iter_0000000/trainer_state.json").read_text())
    actor = Actor(ModelConfig(**state["model"]), OptimConfig(), g, parallel=cfg)
    loaded, _ = checkpoint.load(
        checkpoint.latest(out), actor.sharded_state_dict(with_optimizer=False)
    )
    actor.load_sharded(loaded)
    names = [n for n, _ in actor.module.named_parameters()]
    experts = {m.group(1) for n in names for m in [re.search(r"local_experts\.(\d+)\.", n)] if m}
    ids = torch.randint(0, 53, (4, 10), generator=torch.Generator().manual_seed(2))
    res = actor.compute_logprobs({"input_ids": ids, "labels": ids}, micro_batch_size=2)
    parallel.destroy()
    return ids, res["logprobs"], len(experts)


def test_ep2_actor_loads_converted_moe_checkpoint(tmp_path):
    """Expert parallelism 2: each rank loads its half of the experts from the converted
    checkpoint (global expert offsets), and the log-probs are transformers' Qwen3-MoE's."""
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe")
    results = run_distributed(_ep_body, world_size=2, args=(str(hf), str(tmp_path / "mcore")))
    ref = torch.log_softmax(_hf_logits(hf, results[0][0]).float(), -1)
    ref_lp = ref.gather(-1, results[0][0][..., None])[..., 0]
    for _ids, lp, local_experts in results:
        assert local_experts == 2  # 4 experts over EP 2
        assert (lp - ref_lp).abs().max() < TOL
