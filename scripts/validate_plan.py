"""The memory planner against measured allocations, on the CPU: the real actor, one process.

For each configuration the planner's estimate (``megatron_rl_fp8.plan.estimate`` for a one-"GPU"
CPU world) is put next to what the real actor allocates: ``Actor`` (Megatron GPTModel, local
spec, fp32, Megatron DDP and Adam; single process on gloo) is built, runs two training steps and
one old-logprob pass, and PyTorch's profiler records every tensor allocation and free
(``profile_memory=True``). Measured ``update`` is the peak of live tensor bytes during the second
step (the first allocates Adam's state), counting everything alive then (weights, gradient buffer,
optimizer state, activations, logits); measured ``logprobs`` is the peak during the logprob pass.
The planner's allowance is zero on the CPU, so its total is the whole prediction. A second table
puts the planner's per-layer term (``layer_activation_bytes``) next to the bytes the first layer
really saved for its backward in the first step (every tensor autograd packed while it ran, once
per storage, parameters excluded).

Why the profiler's allocation trace and not the process's peak RSS: it counts exactly the bytes
of live tensors, the CPU counterpart of ``torch.cuda.max_memory_allocated`` (which the GPU
reference point of 82.4 GB is), and nothing else. Peak RSS (``VmHWM`` after a reset through
``/proc/self/clear_refs``) also counts glibc's cached arenas, Python objects, library pages touched
for the first time and thread stacks: tens of MB of noise, more than the tiny model's whole
footprint (a few MB).

    python scripts/validate_plan.py                  # all configurations, ~2 minutes on 2 cores
    python scripts/validate_plan.py --only tiny      # the ones whose name starts with "tiny"
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl_fp8.plan.measure import SHAPE_20M, FirstLayerSaved, peak_bytes

TINY = "examples/tiny_cpu.yaml"
# The ~21M shape (plan/measure.py), 4 rows of 256 tokens per micro-batch.
MODEL_20M = [
    *SHAPE_20M,
    "model.max_position_embeddings=256",
    "task.max_prompt_len=128",
    "rollout.max_new_tokens=128",
    "train.micro_batch_size=4",
]
FULL = [
    "memory.recompute_granularity=full",
    "memory.recompute_method=uniform",
    "memory.recompute_num_layers=1",
]
SELECTIVE = ["memory.recompute_granularity=selective"]
CONFIGS = {
    "tiny, recompute off": [],
    "tiny, full recompute": FULL,
    "20M, recompute off": MODEL_20M,
    "20M, selective (core_attn)": MODEL_20M + SELECTIVE,
    "20M, full recompute": MODEL_20M + FULL,
}
MICRO_BATCHES = 2  # per training step


def measure(cfg) -> dict[str, int]:
    """Peak allocated bytes of the real actor in each phase (see the module docstring), and
    ``layer``: the bytes its first layer saved for the backward (:class:`FirstLayerSaved`), per
    token of a micro-batch."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.trainer.actor import Actor

    rows = cfg.train.micro_batch_size * MICRO_BATCHES
    seq = cfg.task.max_prompt_len + cfg.rollout.max_new_tokens
    ids = torch.randint(
        0, cfg.model.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(rows, seq)}

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / (rows * seq), {}

    # A fresh Megatron parallel state per configuration: its global buffer (the local spec's
    # attention scores) must be allocated inside the profile, as the planner counts it.
    groups = parallel.initialize(cfg.parallel, seed=1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            actor = Actor(cfg.model, cfg.optim, groups, cfg.fp8, memory=cfg.memory)
            saved = FirstLayerSaved(actor.module)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                actor.train_step(batch, cfg.train.micro_batch_size, nll)  # allocates Adam's state
            with record_function("measure/update"):
                actor.train_step(batch, cfg.train.micro_batch_size, nll)
            with record_function("measure/logprobs"):
                actor.compute_logprobs(batch, cfg.train.micro_batch_size)
            del actor
    finally:
        parallel.destroy()
    peaks = peak_bytes(prof, ["measure/update", "measure/logprobs"])
    return {
        "update": peaks["measure/update"],
        "logprobs": peaks["measure/logprobs"],
        "layer": saved.nbytes / (cfg.train.micro_batch_size * seq),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="Run the configurations whose name starts so.")
    args = p.parse_args(argv)
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.plan import World, estimate
    from megatron_rl_fp8.plan.model_bytes import DEFAULT_LOGPROBS

    torch.set_num_threads(2)
    world = World(gpus_per_node=1, gpu_memory_gb=1e6, device="cpu")
    print("| configuration | phase | predicted MB | measured MB | error | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    layers = []
    for name, overrides in CONFIGS.items():
        if not name.startswith(args.only):
            continue
        cfg = load_config(TINY, overrides).validate(1)
        predicted = estimate(cfg, world, logits=DEFAULT_LOGPROBS)
        t0 = time.perf_counter()
        measured = measure(cfg)
        seconds = time.perf_counter() - t0
        for phase in ("update", "logprobs"):
            pred, meas = predicted.total(phase), measured[phase]
            print(
                f"| {name} | {phase} | {pred / 1e6:.2f} | {meas / 1e6:.2f} | "
                f"{(pred - meas) / meas:+.1%} | {seconds:.0f} |",
                flush=True,
            )
        if cfg.memory.recompute_granularity != "full":  # a fully recomputed layer saves nothing
            layers.append((name, _layer_prediction(cfg), measured["layer"]))
    print()
    print("| configuration | layer 0 saved, bytes/token: predicted | measured |")
    print("|---|---:|---:|")
    for name, pred, meas in layers:
        print(f"| {name} | {pred:.0f} | {meas:.0f} |")
    return 0


def _layer_prediction(cfg) -> float:
    from megatron_rl_fp8.plan import layer_activation_bytes

    selective = cfg.memory.recompute_granularity == "selective"
    return layer_activation_bytes(
        cfg.model,
        a=4,  # fp32 on the CPU
        tp=1,
        sequence_parallel=False,
        seq=cfg.task.max_prompt_len + cfg.rollout.max_new_tokens,
        spec="local",
        fused_swiglu=False,
        selective=tuple(cfg.memory.recompute_modules) if selective else (),
    )


if __name__ == "__main__":
    raise SystemExit(main())
