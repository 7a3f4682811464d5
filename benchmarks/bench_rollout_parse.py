"""Does the pipelined rollout's answer parsing slow the trainer's update (issue 43 #6)?

Under ``train.pipeline=one_step_off`` the driver's background thread receives and parses up to 64
SGLang ``/generate`` answers at a time (JSON with one ``[logprob, id, null]`` triple per token:
``rollout/sglang/http.py: Http.call`` then ``parse_completion``) while the driver's main thread
launches the update's kernels. Both need the GIL; ``json.loads`` holds it for the whole of one
answer. This times a launch-bound update (a small MLP's forward, backward and Adam step, many
small kernels: what a GPU update looks like to Python) alone, with a thread parsing canned
answers of ``--tokens`` tokens back to back, and with those answers parsed the way
``rollout.sglang.parse_answers: process`` (the default) does it: in a spawned helper process
that sends back each completion as two packed arrays, which a thread here turns into lists
(``rollout/sglang/answers.py``). In one run, alternating, best of ``--reps``:

    python benchmarks/bench_rollout_parse.py [--tokens 8192] [--answers 64] [--device cuda]

The ratio "with parse / alone" above 1 is the update's slowdown; the parsers' own rates are
printed too. On a CPU both threads also compete for cores (``--threads`` pins torch's), so the
CPU number bounds the GIL's effect from above; the GPU's (``make gpu-check``) is the one to read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import threading
import time

import torch

from megatron_rl_fp8.rollout.sglang.answers import pack, unpack
from megatron_rl_fp8.rollout.sglang.http import parse_completion


def canned_answer(tokens: int) -> str:
    """One ``/generate`` answer body of ``tokens`` tokens, as SGLang 0.5.23 sends it."""
    ids = [(7 * i) % 50000 + 3 for i in range(tokens)]
    meta = {
        "weight_version": "1",
        "output_token_logprobs": [[-0.123456789 - 1e-6 * i, t, None] for i, t in enumerate(ids)],
        "finish_reason": {"type": "length", "length": tokens},
        "completion_tokens": tokens,
    }
    return json.dumps({"text": "", "output_ids": ids, "meta_info": meta})


def parse_all(body: str, answers: int) -> None:
    for _ in range(answers):
        parse_completion([1, 2, 3], json.loads(body), eos_token_id=2, expected_version="1")


def packed_round(body: str, answers: int) -> list:
    """In the helper process: parse ``answers`` answers, packed as the answer process packs them."""
    return [
        pack(parse_completion([], json.loads(body), eos_token_id=2, expected_version="1"))
        for _ in range(answers)
    ]


def unpack_all(packed: list) -> None:
    """In the trainer's process: what ``AnswerProcess.result`` does with a round."""
    for p in packed:
        unpack([1, 2, 3], p)


def in_background(work) -> tuple[threading.Event, threading.Thread, list[int]]:
    """Run ``work()`` in a thread until the event is set; the list counts its rounds."""
    stop, rounds = threading.Event(), [0]

    def loop():
        while not stop.is_set():
            work()
            rounds[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return stop, thread, rounds


def update_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()


def timed_updates(model, opt, x, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        update_step(model, opt, x)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per canned answer")
    parser.add_argument("--answers", type=int, default=64, help="answers parsed per round")
    parser.add_argument("--steps", type=int, default=50, help="update steps per timing")
    parser.add_argument("--layers", type=int, default=24, help="MLP layers (kernels per step)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = parser.parse_args()
    for name in ("tokens", "answers", "steps", "layers", "reps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(16, 256, device=device)
    body = canned_answer(args.tokens)
    t0 = time.perf_counter()
    parse_all(body, 1)
    one_parse = time.perf_counter() - t0
    timed_updates(model, opt, x, 3)  # warm-up
    helper = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    helper.submit(packed_round, body, 1).result()  # started and warm
    alone, together, offloaded, parsed, shipped = [], [], [], 0, 0
    for _ in range(args.reps):
        alone.append(timed_updates(model, opt, x, args.steps))
        stop, thread, rounds = in_background(lambda: parse_all(body, args.answers))
        together.append(timed_updates(model, opt, x, args.steps))
        stop.set()
        thread.join()
        parsed += rounds[0]
        work = lambda: unpack_all(helper.submit(packed_round, body, args.answers).result())  # noqa: E731
        stop, thread, rounds = in_background(work)
        offloaded.append(timed_updates(model, opt, x, args.steps))
        stop.set()
        thread.join()
        shipped += rounds[0]
    helper.shutdown()
    best_alone, best_together, best_offloaded = min(alone), min(together), min(offloaded)
    mb, ms = len(body) / 1e6, one_parse * 1e3
    print(
        f"device {device}, {args.layers}-layer MLP, {args.steps} update steps; answers of "
        f"{args.tokens} tokens ({mb:.2f} MB of JSON, {ms:.1f} ms to parse one)"
    )
    print(f"| update | s (best of {args.reps}) | ratio |")
    print("|---|---:|---:|")
    print(f"| alone | {best_alone:.3f} | 1.00 |")
    print(
        f"| with a thread parsing answers | {best_together:.3f} | {best_together / best_alone:.2f} |"
    )
    print(
        f"| with a helper process parsing them (parse_answers: process) | {best_offloaded:.3f} | "
        f"{best_offloaded / best_alone:.2f} |"
    )
    print(
        f"rounds of {args.answers} answers parsed while the updates ran: {parsed} by the thread, "
        f"{shipped} by the helper process"
    )


if __name__ == "__main__":
    main()
