"""Starting from a Hugging Face folder: the actor loaded at TP=1 and TP=2 computes the logprobs
transformers computes on the same tokens (chat-templated prompts of the task + continuations).

Both sides run fp32 from identical weights; only GEMM / softmax summation orders differ, so they
agree to ~1e-6 at this size on any CPU. We assert 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.data.tiny_hf import make_hf_model, write_chat_task
from tests.dist_utils import run_distributed


def _config_file(tmp, hf_dir):
    train = write_chat_task(tmp / "train.jsonl", 16)
    val = write_chat_task(tmp / "val.jsonl", 8, seed=1)
    path = tmp / "run.yaml"
    path.write_text(
        f"""model:
  hf_checkpoint: {hf_dir}
task:
  name: gsm8k
  train_path: {train}
  val_path: {val}
  answer_field: reward_model.ground_truth
  max_prompt_len: 40
  max_response_len: 8
rollout:
  n_samples_per_prompt: 2
  max_new_tokens: 8
train:
  steps: 2
  prompts_per_step: 4
  micro_batch_size: 4
  updates_per_step: 2
  eval_prompts: 4
  save_interval: 0
  output_dir: {tmp / "run"}
  cache_dir: {tmp / "cache"}
reward:
  num_workers: 0
"""
    )
    return path


def _logprobs_body(rank, world, config_path, tp, rows, extra=(), hf_dir=None):
    import transformers

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.trainer import startup
    from megatron_rl_fp8.trainer.loop import Trainer

    cfg = load_config(config_path, [f"parallel.tensor_model_parallel_size={tp}", *extra])
    trainer = Trainer(cfg)
    try:
        startup.load_start_weights(trainer.cfg, trainer.actor, trainer.groups)
        ids = torch.tensor(rows)
        labels = torch.roll(ids, -1, dims=1)
        out = trainer.actor.compute_logprobs({"input_ids": ids, "labels": labels}, len(rows))
        prompt = trainer.val_data[0]["prompt_ids"]
    finally:
        trainer.close()
        parallel.destroy()
    if out is None:  # not the last pipeline stage
        return None
    if cfg.parallel.tensor_model_parallel_size > 1 and trainer.groups.tp_rank != 0:
        return None
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir or cfg.model.hf_checkpoint)
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    valid = slice(0, ids.shape[1] - 1)  # the last label wraps around
    err = (out["logprobs"][:, valid] - ref[:, valid]).abs().max().item()
    return err, prompt, cfg.model.vocab_size, cfg.model.padded_vocab_size(tp)


@pytest.fixture
def hf_model(tiny_hf_model):
    return tiny_hf_model


@pytest.mark.parametrize("tp", [1, 2])
def test_actor_from_hf_checkpoint_matches_transformers(hf_model, tmp_path, tp):
    from transformers import AutoTokenizer

    config = _config_file(tmp_path, hf_model["dir"])
    tok = AutoTokenizer.from_pretrained(str(hf_model["dir"]))
    messages = [{"role": "user", "content": "what is 3 + 4?"}]
    chat = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    chat = list(chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat)
    gen = torch.Generator().manual_seed(0)
    tail = torch.randint(0, hf_model["tokenizer_len"], (2, 12), generator=gen).tolist()
    rows = [chat + tail[0], chat + tail[1]]
    err, prompt, vocab, padded = run_distributed(
        _logprobs_body, world_size=tp, args=(config, tp, rows)
    )[0]
    assert err < 1e-4, err
    assert vocab == hf_model["vocab_size"] and padded == 128 * tp * -(-vocab // (128 * tp))
    # The trainer's first val prompt is the task's message list through the same template.
    import json

    first = json.loads((tmp_path / "val.jsonl").read_text().splitlines()[0])
    want = tok.apply_chat_template(first["prompt"], tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert prompt == want


def _bf16_step_body(rank, world, config_path):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.sync.gather import iter_full_params
    from megatron_rl_fp8.trainer import startup
    from megatron_rl_fp8.trainer.loop import Trainer

    # A learning rate so small that one step cannot move a bf16 weight: whatever changes after
    # the step came from the optimizer's own (fp32 main) copy of the weights.
    cfg = load_config(config_path, ["model.params_dtype=bfloat16", "optim.lr=1e-30"])
    trainer = Trainer(cfg)
    try:
        startup.load_start_weights(trainer.cfg, trainer.actor, trainer.groups)
        before = {n: t.float().clone() for n, t in iter_full_params(trainer.actor.model)}
        ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}

        def loss_fn(mb, logprobs):
            loss = -logprobs.sum() / logprobs.numel()
            return loss, {}

        trainer.actor.train_step(batch, 4, loss_fn)
        after = {n: t.float() for n, t in iter_full_params(trainer.actor.model)}
    finally:
        trainer.close()
        parallel.destroy()
    return max((after[n] - before[n]).abs().max().item() for n in before)


def test_bf16_optimizer_keeps_the_loaded_weights(hf_model, tmp_path):
    """Megatron's bf16 optimizer copies its fp32 main weights when it is built (before the
    checkpoint is loaded); they must be refreshed from the loaded weights, else the first step
    writes the random init back (a GPU-only failure, reproduced here with bf16 on the CPU)."""
    config = _config_file(tmp_path, hf_model["dir"])
    assert run_distributed(_bf16_step_body, world_size=1, args=(config,))[0] == 0.0


def _rows(hf_model):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, hf_model["tokenizer_len"], (2, 20), generator=gen).tolist()


def test_model_load_starts_from_a_converted_checkpoint(hf_model, tmp_path, tp=2):
    """`model.load` = an hf-to-mcore output (converted with the run's TP, so its vocab padding
    fits): the same weights as the HF folder, read with dist_checkpointing at TP=2 (the
    HF-folder tests above cover TP=1)."""
    from megatron_rl_fp8.convert.hf_to_mcore import hf_to_mcore

    converted = tmp_path / "mcore"
    hf_to_mcore(hf_model["dir"], converted, tensor_model_parallel_size=tp, progress=False)
    config = _config_file(tmp_path, hf_model["dir"])
    # The tokenizer stays the HF folder's (tokenizer.path); the weights come from model.load.
    extra = (
        "model.hf_checkpoint=null",
        f"model.load={converted}",
        f"tokenizer.path={hf_model['dir']}",
    )
    err, *_ = run_distributed(
        _logprobs_body,
        world_size=tp,
        args=(config, tp, _rows(hf_model), extra, str(hf_model["dir"])),
    )[0]
    assert err < 1e-4, err


def test_pipeline_parallel_start_with_tied_embeddings(tmp_path):
    """PP=2 with tied embeddings (as Qwen3 up to 4B ties them): each stage loads its own layers,
    and the last stage's output layer is the embedding from the checkpoint."""
    tied = make_hf_model(tmp_path / "tied", tie=True, seed=2)
    config = _config_file(tmp_path, tied["dir"])
    results = run_distributed(
        _logprobs_body,
        world_size=2,
        args=(config, 1, _rows(tied), ("parallel.pipeline_model_parallel_size=2",)),
    )
    err = next(r for r in results if r is not None)[0]
    assert err < 1e-4, err
