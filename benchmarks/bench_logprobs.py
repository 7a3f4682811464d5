"""Benchmark: chunked vocab-parallel log-probabilities vs the full-fp32-copy implementation.

Two passes of an RL step, on one rank's [tokens, V] logits (default 8192 x 32768, bf16):

* ``train``: token_logprobs forward + backward (the policy-loss micro-batch);
* ``old-logprob pass``: log-probabilities and entropy, no gradient (``Actor.compute_logprobs``).

``old`` is the implementation models/logprobs.py had before (fp32 upcast, padded-vocab mask,
temperature and transpose copies, then Megatron's ``vocab_parallel_cross_entropy``, which keeps
the fp32 softmax for its backward; entropy from the fp32 copy again). ``new`` is the chunked one.

Peak memory is what a pass allocates above its inputs (the bf16 logits and labels; the bf16
gradient the backward must produce counts): on CUDA ``torch.cuda.max_memory_allocated``; on CPU
the process's peak resident set above the resident set before the pass (Linux: the high-water
mark ``VmHWM`` is reset through ``/proc/self/clear_refs`` before each pass, so one process measures
every variant). Variants run in interleaved rounds after a warm-up on a tiny problem; each call
is both timed and measured.

Usage::

    python benchmarks/bench_logprobs.py [--tokens 8192] [--vocab 32768] [--chunk 4096] \\
        [--temperature 1.0] [--padding 0] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from megatron_rl_fp8.models.logprobs import (
    mask_padded_vocab,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)

VARIANTS = ["train/old", "train/new", "nograd/old", "nograd/new_separate", "nograd/new_fused"]


# -- the implementation before chunking (kept here as the baseline) ------------------------------
def old_token_logprobs(logits, labels, *, temperature, vocab_size, tp_rank=0):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    if temperature != 1.0:
        logits = logits / temperature
    nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.t().contiguous())
    return -nll.t()


@torch.no_grad()
def old_token_entropy(logits, *, temperature, vocab_size, tp_rank=0):
    logits = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    if temperature != 1.0:
        logits = logits / temperature
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    return sum_exp.log() - (exp * shifted).sum(-1) / sum_exp


# -- setup ----------------------------------------------------------------------------------------
def init_megatron() -> None:
    """One-rank gloo group + Megatron parallel_state: the old path reads its TP group there."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl_fp8.parallel import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def make_inputs(tokens: int, vocab: int, device, rows: int = 4, seed: int = 0):
    """bf16 logits [rows, tokens/rows, vocab], filled slice by slice so that no fp32 temporary
    of full size raises the peak before the measurement starts."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(rows, tokens // rows, vocab, dtype=torch.bfloat16, device=device)
    for i in range(rows):
        logits[i] = 3 * torch.randn(tokens // rows, vocab, generator=g, device=device)
    labels = torch.randint(0, vocab, logits.shape[:2], generator=g, device=device)
    return logits, labels


def make_step(variant: str, logits, labels, args):
    kw = {"temperature": args.temperature, "vocab_size": args.vocab - args.padding}
    new_kw = {**kw, "chunk_tokens": args.chunk}

    def train(fn, **k):
        x = logits.detach().requires_grad_(True)
        fn(x, labels, **k).sum().backward()

    steps = {
        "train/old": lambda: train(old_token_logprobs, **kw),
        "train/new": lambda: train(token_logprobs, **new_kw),
        "nograd/old": lambda: (
            old_token_logprobs(logits, labels, **kw),
            old_token_entropy(logits, **kw),
        ),
        "nograd/new_separate": lambda: (
            token_logprobs(logits, labels, **new_kw),
            token_entropy(logits, **new_kw),
        ),
        "nograd/new_fused": lambda: token_logprobs_and_entropy(logits, labels, **new_kw),
    }
    step = steps[variant]
    if variant.startswith("train"):
        return step

    def no_grad_step():
        with torch.no_grad():
            step()

    return no_grad_step


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(step, device) -> tuple[int, float]:
    """One call of ``step``: (bytes allocated above what was live before it, at the peak;
    seconds)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, time.perf_counter() - start
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set (VmHWM) to the current one
    except OSError as e:
        raise SystemExit(f"peak memory on CPU needs Linux's /proc/self/clear_refs ({e})") from e
    base = _proc_status_bytes("VmRSS")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return _proc_status_bytes("VmHWM") - base, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768, help="columns of this rank's logits")
    parser.add_argument("--chunk", type=int, default=4096, help="chunk_tokens of the new path")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--padding", type=int, default=0, help="padded columns (masked)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved rounds of all variants; times are the median over rounds, memory is "
        "each variant's peak over rounds",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    init_megatron()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # First-call costs (thread pools, kernel selection) on a tiny problem, outside any peak.
    small = argparse.Namespace(**{**vars(args), "vocab": 256, "padding": 0, "chunk": 16})
    tiny = make_inputs(64, 256, device)
    for variant in VARIANTS:
        make_step(variant, *tiny, small)()
    logits, labels = make_inputs(args.tokens, args.vocab, device)
    steps = dict(zip(VARIANTS, (make_step(v, logits, labels, args) for v in VARIANTS)))
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # interleaved, so machine noise hits all variants alike
        for variant, step in steps.items():
            runs[variant].append(measure(step, device))
    peaks = {v: max(p for p, _ in r) for v, r in runs.items()}
    times = {v: statistics.median(t for _, t in r) for v, r in runs.items()}

    gib, mib = 2**30, 2**20
    input_bytes = logits.numel() * logits.element_size()
    print(
        f"{args.tokens} tokens x {args.vocab} columns bf16 ({input_bytes / gib:.2f} GiB), "
        f"chunk_tokens={args.chunk}, T={args.temperature}, padding={args.padding}, "
        f"device={device.type}, threads={args.threads}, median of {args.rounds} rounds"
    )
    print("| pass | variant | peak above inputs MiB | vs old | ms | vs old |")
    print("|---|---|---:|---:|---:|---:|")
    for variant in VARIANTS:
        kind, name = variant.split("/")
        old = f"{kind}/old"
        p, p_old = peaks[variant], peaks[old]
        t, t_old = times[variant], times[old]
        print(
            f"| {kind} | {name} | {p / mib:.0f} | {p / p_old:.2f} | {t * 1e3:.0f} | "
            f"{t / t_old:.2f} |"
        )


if __name__ == "__main__":
    main()
