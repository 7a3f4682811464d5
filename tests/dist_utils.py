"""The one helper for real multi-process tests: spawn N gloo ranks and run a function on each.

Usage::

    def _body(rank, world_size, x):
        ...  # torch.distributed is initialised (gloo) here
        return something_picklable

    results = run_distributed(_body, world_size=2, args=(x,))  # list indexed by rank

The body must be a module-level function (it is pickled into the spawned processes). An exception
on any rank fails the test with that rank's traceback.

Ranks start from a forkserver that has imported torch, Megatron-Core and the trainer once per
test session: a spawned rank would import them again (~8 s of CPU per rank, most of a small
test's time on 2 cores). Each rank still gets the parent's environment as it is at the call, as a
spawned one would; only what the preloaded modules read at import time comes from the session's
start.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

import torch.multiprocessing as mp

from megatron_rl_fp8.parallel import free_port

PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron_rl_fp8.trainer.loop"]
"""Imported once by the forkserver; every rank forks from it with these already loaded."""

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _worker(rank, world_size, port, fn, args, queue, environ):
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # By value (plain pickle): a multiprocessing queue would pass tensors as shared-memory
        # file descriptors that the parent fetches from this process *after* it may have exited
        # (EOFError in the parent, at random, depending on which side is faster).
        out = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _save_coverage()


def _save_coverage():
    """A rank ends in ``os._exit`` (multiprocessing's), which skips coverage's exit hook: under
    ``make coverage`` its measurement is saved here, or the ranks' lines would count as unrun."""
    coverage = sys.modules.get("coverage")
    cov = coverage.Coverage.current() if coverage is not None else None
    if cov is not None:
        cov.stop()
        cov.save()


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout: float = 300.0) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, environ))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
