"""``model.attention_backend: sdpa`` on a GPU (marked ``gpu``; skipped without CUDA), where it is
the local spec's default: bf16 models with SDPA and with Megatron's unfused attention agree (bf16
rounding apart), and SDPA runs a fused kernel: at 1024 tokens the unfused model's peak memory
holds the [b, heads, s, s] scores (6 bytes each per layer: bf16 probabilities and fp32 softmax)
and the SDPA model's does not. (Exact agreement is checked on the CPU in fp32 and float64:
tests/distributed/test_sdpa_attention.py.)"""

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpu

SEQ, ROWS, HEADS, LAYERS = 1024, 2, 8, 2


def _body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config

    parallel.initialize(parallel.ParallelConfig(), seed=5)
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(SEQ, device="cuda")[None].expand(ROWS, -1)
    out = {}
    for backend in ("unfused", "sdpa"):
        mc = ModelConfig(
            arch="qwen3",
            num_layers=LAYERS,
            hidden_size=512,
            ffn_hidden_size=1024,
            num_attention_heads=HEADS,
            num_query_groups=4,
            vocab_size=256,
            max_position_embeddings=SEQ,
            attention_backend=backend,
        )
        torch.manual_seed(5)
        model = build_gpt_model(mc, transformer_config(mc, on_cpu=False)).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logits = model(ids, pos, None)
        logits.float().square().mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        out[backend] = (logits.detach().float().cpu(), grads.cpu(), peak)
        del model, logits
        torch.cuda.empty_cache()
    parallel.destroy()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: pytest -m gpu)")
def test_sdpa_attention_on_the_gpu_agrees_and_keeps_no_scores():
    got = run_distributed(_body, world_size=1)[0]
    (lu, gu, peak_u), (ls, gs, peak_s) = got["unfused"], got["sdpa"]
    assert (lu - ls).abs().max() / lu.abs().max() < 3e-2
    cosine = torch.nn.functional.cosine_similarity(gu, gs, dim=0).item()
    assert cosine > 0.999, cosine
    scores = LAYERS * ROWS * HEADS * SEQ * SEQ * 6
    assert peak_u - peak_s > 0.8 * scores, (peak_u, peak_s, scores)
    print(f"sdpa: peak {peak_s / 2**20:.0f} MiB vs unfused {peak_u / 2**20:.0f} MiB")
