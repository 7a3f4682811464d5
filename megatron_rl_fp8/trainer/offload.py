"""Moving the trainer's GPU state to the host while colocated engines generate.

With ``rollout.placement=colocated`` the engines and the trainer share each GPU. The trainer
needs its memory only outside the rollout, so during it that memory goes to the host:

* the model chunks' weights, and Megatron DDP's contiguous buffers under them (``param_data``
  under the distributed optimizer; ``grad_data``, the fp32 gradients, always);
* the optimizer's fp32 main weights (Megatron's mixed-precision copies of bf16 weights:
  ``fp32_from_float16_groups``, or the distributed optimizer's DP shards of them,
  ``shard_fp32_from_float16_groups``) and its Adam state (``exp_avg``, ``exp_avg_sq``);
* the frozen KL reference model's weights, when there is one (``trainer/reference.py``).

That is 18 bytes per parameter with bf16 weights (``plan/memory.py``), less what the distributed
optimizer shards away.

**Method: whole storages, resized in place.** Megatron's tensors are views: under the distributed
optimizer every weight is a slice of one ``param_data`` buffer, every ``main_grad`` a slice of
``grad_data``, a tied embedding is one tensor in two modules, and fp32 weights are their own main
weights. So the unit moved is the *storage* a tensor views, each once: its bytes are copied to a
host buffer (pinned when the storage is on the GPU, so the copies run at full PCIe speed), then
``storage.resize_(0)`` frees the device memory while every tensor, view, ``main_grad`` and
optimizer reference keeps pointing at the same storage object; ``reload`` grows each storage back
(new device memory) and copies the bytes in. Nothing in Megatron's or torch's bookkeeping needs
rewiring, and the round trip is bit-exact. Only storages on the trainer's device move (on CPU,
the tests' device, that is every one; on GPU the Adam ``step`` counters, host tensors, stay).

**Between ``offload()`` and ``reload()`` nothing may touch these tensors**: their storages are
empty while their shapes say otherwise, so a read is out of bounds, not an exception (a
segfault on the CPU; on the GPU an illegal memory access, which poisons the CUDA context).
Both calls are idempotent (a second ``offload`` or a ``reload`` with nothing offloaded does
nothing), and neither is collective.

**How the loop calls it**: ``EngineLink.generation`` (``trainer/engine_link.py``), around the rollout and
every evaluation, on every rank, with ``rollout.offload_trainer``. The window is the engines'
generation and nothing else: the weight push, the reference's copy of the actor, the stability
guard and checkpoints all read the trainer's state, so they stay outside it. In order: every rank
``offload()``, a barrier, the driver resumes the engines' KV cache (the weights were resumed for
the sync: the push needs both on the GPU); the generation; the driver releases the engines'
memory, a barrier, every rank ``reload()``. The barriers keep a rank from reloading before the
engines gave their memory back, and the engines from taking their KV cache before every rank's
state is off. When the generation raises, the rank reloads at once (nothing may read an empty
storage, and the error path may). With ``parallel.overlap_param_gather`` the weights must be
gathered before the offload (``Actor.finish_param_gather``, which the weight push has run): no
communication may be in flight on a storage while it moves.

``keep_grads=False`` frees the gradient buffers without copying them (4 bytes per parameter of
PCIe traffic and pinned host memory saved each way) and gives them back zeroed: every
``Actor.train_step`` zeroes them before its backward, and nothing reads them between steps.
(Megatron's own ``DistributedDataParallel.offload_grad_buffers`` does this for the gradient
buffers alone; its ``_ParamAndGradBuffer.offload_to_cpu`` adds ``param_data``, which exists only
under the distributed optimizer. Neither reaches the main weights or the Adam state.)

Host buffers are kept between cycles (``cache_host_buffers``): pinning memory is slow (it is
page-locked by the driver), the sizes repeat every step, and reusing them takes the allocation off
every rollout. They hold the copied bytes in host memory for the whole run, per rank.

What stays on the GPU (Megatron / TE caveats):

* The CUDA context, NCCL communicators and their buffers, cuBLAS / TE workspaces, and whatever
  the caching allocator keeps in partly used blocks (``torch.cuda.empty_cache`` returns only
  whole free segments; Megatron's buffers are single allocations and go back whole).
* Module attributes that are neither parameters nor buffers: TE's FP8 metadata (``fp8_meta``
  amax histories and scales) and its cached FP8 weight copies and transposes; small, or rebuilt
  at the next forward.
* Tensors whose memory the caching allocator does not own: a storage that cannot be resized
  (``from_numpy``, DLPack, NCCL user buffers from ``nccl_ub``) is left in place and counted in
  ``skipped_bytes``; wrapper tensors without a storage of their own (TE's ``Float8Tensor``) are
  reached through their inner tensors (``__tensor_flatten__``) where they expose them.
* CUDA graphs (not used here) would keep the old addresses: a reloaded storage lives elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.reference import Reference

GB = 1e9  # 10^9 bytes, as plan/memory.py

# The mixed-precision optimizers' main weights (Megatron-Core 0.16): fp32 copies of bf16 weights,
# or the distributed optimizer's DP shards of them; the fp32 lists hold the fp32 weights
# themselves (or views of them). They are also the torch optimizer's params; listed so the main
# weights move even where an inner optimizer keeps other params (HybridDeviceOptimizer).
_MAIN_PARAM_GROUPS = (
    "fp32_from_float16_groups",
    "fp32_from_fp32_groups",
    "shard_fp32_from_float16_groups",
    "shard_fp32_groups",
)


@dataclasses.dataclass
class _Entry:
    """One storage moved off the device, and where its bytes wait."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 [nbytes]; None: a gradient freed without a copy


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (made after every resize: it caches a size)."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """A wrapper subclass's own tensors (``__tensor_flatten__``), or None for a plain tensor."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return None
    try:
        names, _ = t.__tensor_flatten__()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    return [getattr(t, n) for n in names]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage, or None when it has none (meta tensors, storage-less wrappers)."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()  # a wrapper subclass's null storage raises here
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage


def _on(device: torch.device, other: torch.device) -> bool:
    return device.type == other.type and (device.index is None or device.index == other.index)


class StorageOffload:
    """Moves the storages under the tensors of ``tensors()`` to the host and back (the module
    docstring: method and contract).

    ``tensors`` is called at each ``offload`` (optimizer state appears at the first step and a
    ``reset_optimizer`` replaces it) and yields ``(tensor, is_grad)``; a storage reached only as a
    gradient is freed without a copy when ``keep_grads`` is False. None entries are skipped.
    Only storages on ``device`` move.
    """

    def __init__(
        self,
        tensors: Callable[[], Iterable[tuple[torch.Tensor | None, bool]]],
        device: torch.device,
        *,
        keep_grads: bool = True,
        cache_host_buffers: bool = True,
    ):
        self._tensors = tensors
        self.device = torch.device(device)
        self.keep_grads = keep_grads
        self.cache_host_buffers = cache_host_buffers
        self._entries: list[_Entry] | None = None  # None: nothing offloaded
        self._pool: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self.offloaded_bytes = 0  # off the device now (on the host, or dropped gradients)
        self.last_offloaded_bytes = 0  # of the last offload, kept after its reload
        self.skipped_bytes = 0  # on the device that could not move (non-resizable storages)
        self.offload_time_s = 0.0
        self.reload_time_s = 0.0

    @property
    def is_offloaded(self) -> bool:
        return self._entries is not None

    def _collect(self) -> tuple[list[tuple[torch.UntypedStorage, bool]], int]:
        """The distinct storages with bytes on ``device``, each with whether it must be copied
        (reached other than as a gradient), and the bytes of those that cannot be resized."""
        found: dict[int, list] = {}  # data_ptr -> [storage, copy]; distinct live storages differ
        skipped: dict[int, int] = {}
        stack = [(t, g) for t, g in self._tensors() if t is not None]
        while stack:
            t, is_grad = stack.pop()
            inner = _inner_tensors(t)
            if inner is not None:
                stack.extend((i, is_grad) for i in inner if isinstance(i, torch.Tensor))
                continue
            storage = _storage(t)
            if storage is None or storage.nbytes() == 0 or not _on(self.device, storage.device):
                continue  # nothing of it on the device (zero-size, or offloaded already)
            key = storage.data_ptr()
            if not storage.resizable():
                skipped[key] = storage.nbytes()
            elif key in found:
                found[key][1] = found[key][1] or not is_grad
            else:
                found[key] = [storage, not is_grad]
        return [(s, copy) for s, copy in found.values()], sum(skipped.values())

    def _host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        free = self._pool.get((nbytes, pinned))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    @torch.no_grad()
    def offload(self) -> int:
        """Move every storage off the device; returns the bytes moved (0 when already off)."""
        if self._entries is not None:
            return 0
        t0 = time.perf_counter()
        storages, self.skipped_bytes = self._collect()
        cuda = self.device.type == "cuda" and bool(storages)
        if cuda:
            # The storages' last writers (the optimizer step, the weight push) may still run.
            torch.cuda.synchronize(self.device)
        entries = []
        for storage, copy in storages:
            host = None
            if copy or self.keep_grads:
                host = self._host_buffer(storage.nbytes(), pinned=cuda)
                # Asynchronous into pinned memory; the synchronize below waits for all of them.
                host.copy_(_as_bytes(storage), non_blocking=cuda)
            entries.append(_Entry(storage, storage.nbytes(), host))
        if cuda:
            torch.cuda.synchronize(self.device)  # host sync: every copy landed before the frees
        for e in entries:
            e.storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # the freed blocks go back to the driver, for the engines
        self._entries = entries
        self.offloaded_bytes = self.last_offloaded_bytes = sum(e.nbytes for e in entries)
        self.offload_time_s = time.perf_counter() - t0
        return self.offloaded_bytes

    @torch.no_grad()
    def reload(self) -> None:
        """Bring every offloaded storage back, bytes as they were (dropped gradients zeroed)."""
        if self._entries is None:
            return
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda" and bool(self._entries)
        for e in self._entries:
            e.storage.resize_(e.nbytes)
            device_bytes = _as_bytes(e.storage)
            if e.host is None:
                device_bytes.zero_()
            else:
                device_bytes.copy_(e.host, non_blocking=cuda)
        if cuda:
            # Host sync: the pinned buffers are reused by the next offload, and the trainer's
            # next kernels may run on another stream.
            torch.cuda.synchronize(self.device)
        if self.cache_host_buffers:
            for e in self._entries:
                if e.host is not None:
                    self._pool.setdefault((e.nbytes, e.host.is_pinned()), []).append(e.host)
        self._entries = None
        self.offloaded_bytes = 0
        self.reload_time_s = time.perf_counter() - t0

    @contextlib.contextmanager
    def offloaded(self) -> Iterator[StorageOffload]:
        """``offload()`` for the body of a ``with``, ``reload()`` after it (also on an error)."""
        self.offload()
        try:
            yield self
        finally:
            self.reload()

    def metrics(self) -> dict[str, float]:
        """The last cycle's device bytes freed and times (``perf/``); call it after ``reload``."""
        return {
            "perf/offloaded_gb": self.last_offloaded_bytes / GB,
            "perf/offload_time_s": self.offload_time_s,
            "perf/reload_time_s": self.reload_time_s,
        }


def _optimizer_tensors(optimizer) -> Iterator[tuple[torch.Tensor | None, bool]]:
    """A Megatron optimizer's (chained or not) main weights, their gradients and its state."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for name in _MAIN_PARAM_GROUPS:
            for group in getattr(opt, name, None) or []:
                for p in group:
                    if p is not None:
                        yield p, False
                        yield p.grad, True
        inner = getattr(opt, "optimizer", None)  # None: a stub with no parameters on this rank
        if inner is not None:
            yield from _torch_optimizer_tensors(inner)


def _torch_optimizer_tensors(inner) -> Iterator[tuple[torch.Tensor | None, bool]]:
    """A torch optimizer's params and every tensor of its state (exp_avg, exp_avg_sq, step, a
    fused Adam's master_param); a HybridDeviceOptimizer's sub-optimizers as well."""
    for group in inner.param_groups:
        for p in group["params"]:
            yield p, False
            yield p.grad, True
    stack = list(inner.state.values())
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield obj, False
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    for sub in getattr(inner, "sub_optimizers", None) or []:
        yield from _torch_optimizer_tensors(sub)


def _module_tensors(module: torch.nn.Module) -> Iterator[tuple[torch.Tensor | None, bool]]:
    for p in module.parameters():
        yield p, False
        yield p.grad, True
        yield getattr(p, "main_grad", None), True  # Megatron DDP's view into grad_data
    for b in module.buffers():
        yield b, False


def trainer_tensors(
    actor: Actor, reference: Reference | None = None
) -> Iterator[tuple[torch.Tensor | None, bool]]:
    """``(tensor, is_gradient)`` for every tensor the trainer keeps between steps: the actor's
    weights, DDP buffers, main weights and Adam state, and the reference's weights."""
    ddp = actor.model
    yield from _module_tensors(actor.module)
    # DDP's contiguous buffers (Megatron's DDP replaces nn.Module.buffers() with this list).
    for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
        yield buffer.param_data, False  # None without the distributed optimizer
        yield buffer.grad_data, True
    yield from _optimizer_tensors(actor.optimizer)
    if reference is not None:
        yield from _module_tensors(reference.model)


class TrainerOffload(StorageOffload):
    """``StorageOffload`` of the trainer's state (``trainer_tensors``) on the actor's device.

    Reads ``actor.optimizer`` at each ``offload``, so an optimizer rebuilt by
    ``Actor.reset_optimizer`` is followed."""

    def __init__(
        self,
        actor: Actor,
        reference: Reference | None = None,
        *,
        keep_grads: bool = True,
        cache_host_buffers: bool = True,
    ):
        super().__init__(
            lambda: trainer_tensors(actor, reference),
            actor.groups.device,
            keep_grads=keep_grads,
            cache_host_buffers=cache_host_buffers,
        )
