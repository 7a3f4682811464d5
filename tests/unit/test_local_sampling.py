"""The in-process engine samples from a generator of its own (rollout/local.py): the draws follow
softmax(logits / T) over the top-p nucleus, and neither read nor disturb torch's global generator,
which the trainer's forward passes set while a pipelined rollout generates in another thread."""

import math
import threading

import torch

from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_config
from megatron_rl_fp8.rollout.local import GumbelSampling, LocalEngine

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
DRAWS = 40_000


def _frequencies(temperature: float, top_p: float) -> torch.Tensor:
    sample = GumbelSampling(temperature, top_p, seed=7, device=torch.device("cpu"))
    scores = sample(torch.zeros(DRAWS, 1, dtype=torch.long), LOGITS.repeat(DRAWS, 1))
    return torch.bincount(scores.argmax(-1), minlength=len(LOGITS)).double() / DRAWS


def _within_binomial_noise(freq: torch.Tensor, want: torch.Tensor) -> None:
    # 5 standard errors per token: a false alarm about once in 3 million tests per token.
    for f, p in zip(freq.tolist(), want.tolist()):
        assert abs(f - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / DRAWS), (freq, want)


def test_draws_follow_the_tempered_softmax():
    want = torch.softmax(LOGITS.double() / 0.7, -1)
    _within_binomial_noise(_frequencies(0.7, 1.0), want)


def test_draws_stay_in_the_nucleus_renormalised():
    p = torch.softmax(LOGITS.double(), -1)  # 0.61, 0.22, 0.14, ...: top_p=0.8 keeps two
    want = torch.zeros_like(p)
    want[:2] = p[:2] / p[:2].sum()
    freq = _frequencies(1.0, 0.8)
    assert freq[2:].sum() == 0
    _within_binomial_noise(freq, want)


def _engine() -> LocalEngine:
    tok = dict(pad_token_id=0, eos_token_id=2)
    model = ModelConfig(
        arch="qwen3",
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=2,
        num_query_groups=1,
        vocab_size=53,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LocalEngine(hf_config(model, bos_token_id=1, **tok), **tok)


def _generate(engine: LocalEngine, seed: int):
    out = engine.generate([[1, 5, 6], [1, 7]], n=4, max_new_tokens=6, temperature=1.0, seed=seed)
    return [(c.response_ids, c.response_logprobs) for c in out]


def test_the_global_generator_neither_steers_nor_feels_the_sampling():
    engine = _engine()
    torch.manual_seed(123)
    first = _generate(engine, seed=5)
    state = torch.get_rng_state()
    torch.manual_seed(999)  # another global stream: the same rollout
    assert _generate(engine, seed=5) == first
    torch.set_rng_state(state)
    before = torch.get_rng_state()
    _generate(engine, seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    assert _generate(engine, seed=6) != first


def test_a_rollout_in_another_thread_is_the_same_rollout():
    engine = _engine()
    alone = _generate(engine, seed=11)
    result, stop = [], threading.Event()
    thread = threading.Thread(
        target=lambda: (result.append(_generate(engine, seed=11)), stop.set())
    )
    thread.start()
    while not stop.is_set():  # what Megatron's RNG tracker does in every forward pass
        torch.manual_seed(int(torch.randint(0, 1000, ())))
    thread.join()
    assert result == [alone]


def test_a_limit_per_prompt_cuts_each_row_where_its_own_limit_would():
    """``max_new_tokens`` as one limit per prompt (a multi-turn rollout's later turns): each row
    is the row sampled with the largest limit, cut at its own; a cut row is unfinished."""
    engine = _engine()
    prompts = [[1, 5, 6], [1, 7]]
    full = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, seed=3)
    cut = engine.generate(prompts, n=2, max_new_tokens=[2, 6], temperature=1.0, seed=3)
    for i, (c, f) in enumerate(zip(cut, full)):
        limit = 2 if i < 2 else 6
        assert c.response_ids == f.response_ids[:limit]
        assert c.response_logprobs == f.response_logprobs[:limit]
        assert c.finished == (f.finished and len(f.response_ids) <= limit)
    try:
        engine.generate(prompts, n=1, max_new_tokens=[2], temperature=1.0)
    except ValueError as e:
        assert "1 limits for 2 prompts" in str(e)
    else:
        raise AssertionError("a wrong number of limits must be refused")
