"""Buffers handed to another process over CUDA IPC (the SGLang ``tensor`` transport, the per-node
relay's received buckets): allocated outside expandable segments, which torch cannot share
without ptrace rights over the sender (docs/gpu_contracts.md SG-9)."""

from __future__ import annotations

import contextlib
import os

import torch

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments_on(env: dict[str, str] | None = None) -> bool:
    """Whether the allocator options in ``env`` (default: this process's) turn
    ``expandable_segments`` on."""
    env = os.environ if env is None else env
    for var in ALLOC_CONF_VARS:
        for option in env.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


@contextlib.contextmanager
def ipc_allocations(device: torch.device):
    """CUDA tensors allocated inside come from ordinary ``cudaMalloc`` segments even when this
    process runs with ``expandable_segments:True``. torch shares an expandable segment over CUDA
    IPC as POSIX file descriptors that the receiving process takes with ``pidfd_getfd``
    (``c10/cuda/CUDACachingAllocator.cpp: ExpandableSegment::fromShared``), which needs ptrace
    rights over the sender: denied in most containers and under Yama ``ptrace_scope`` >= 1, where
    an SGLang scheduler may not trace the trainer it descends from. torch's own error suggests
    this switch (``torch.cuda.memory._set_allocator_settings``) for such allocations."""
    if device.type != "cuda" or not expandable_segments_on():
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
