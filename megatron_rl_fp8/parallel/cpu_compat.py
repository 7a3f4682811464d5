"""CPU compatibility layer for Megatron-Core: the only place this project bends Megatron to CPU.

Megatron-Core is written for CUDA. On a CPU-only box (CI, laptops) it works with the gloo backend
once a handful of CUDA entry points have CPU meanings (docs/platform.md lists them):

* device placement: ``device="cuda"`` / ``torch.cuda.current_device()`` tensors and ``.cuda()``
  calls are redirected to the CPU by a ``TorchFunctionMode`` that rewrites CUDA devices;
* the CUDA RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``)
  runs on the CPU default generator, so dropout forks and seeded init still work;
* streams/events/synchronize become no-ops (there is one CPU "stream"; everything is ordered);
* the optimizers compare ``param.type()`` with ``torch.cuda.*Tensor`` names, so ``Tensor.type()``
  reports CPU tensors under the CUDA names;
* the MoE all-to-all token dispatcher passes its split sizes to ``all_to_all_single`` as tensors,
  which it turns into numpy arrays on a GPU only (``moe_utils.maybe_move_tensor_to_cpu`` acts on
  CUDA tensors): here they become lists, which gloo's binding takes.

``enable()`` is idempotent and does nothing when CUDA is available (or when ``force=False`` and
``enabled=False``); ``disable()`` undoes every patch. Nothing here is imported by the GPU path.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

_STATE = threading.local()
_PATCHES: list[tuple[object, str, object]] = []  # (owner, attr, original) for disable()
_MODE: _CudaToCpuMode | None = None
_ACTIVE = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Bare ints mean "cuda:<int>" in torch's device parsing.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every CUDA device argument (and ``Tensor.cuda()``) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # x.cuda(...) -> x (already on CPU); keep non_blocking/memory_format semantics trivial.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers assert param.type() == "torch.cuda.FloatTensor"; report CPU
            # tensors under the CUDA type names, since the CPU plays the device here.
            name = func(*args)
            return (
                name.replace("torch.", "torch.cuda.", 1)
                if not name.startswith("torch.cuda.")
                else name
            )
        if func is torch.Tensor.to or func is torch.Tensor.new_empty or "device" in kwargs:
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to:
                args = tuple(
                    "cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args)
                )
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream / current_stream(): CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        """Nothing to set up."""

    def wait_stream(self, other):
        """CPU work is already ordered."""

    def wait_event(self, event):
        """CPU work is already ordered."""

    def synchronize(self):
        """CPU work is already done when this is called."""

    def record_event(self, event=None):
        return event or _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        """Nothing to set up."""

    def record(self, stream=None):
        """Nothing to record: CPU work is already ordered."""

    def wait(self, stream=None):
        """CPU work is already ordered."""

    def synchronize(self):
        """CPU work is already done when this is called."""

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_get_rng_state(device=None, clone=True, graph_safe=False):
    # The CUDA RNG "state" of a CPU-only box is the CPU default generator's state.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which would recurse here.
    torch.default_generator.manual_seed(int(seed))


@functools.lru_cache
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """Megatron's ``get_default_causal_mask`` on the CPU (True above the diagonal = masked)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _patch(owner, attr, value) -> None:
    _PATCHES.append((owner, attr, getattr(owner, attr, None)))
    setattr(owner, attr, value)


def is_active() -> bool:
    return _ACTIVE


def _all_to_all_single(original):
    @functools.wraps(original)
    def call(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        def as_list(sizes):
            return sizes.tolist() if torch.is_tensor(sizes) else sizes

        return original(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), *a, **k
        )

    return call


def enable(*, force: bool = False) -> bool:
    """Activate the CPU layer when CUDA is absent. Returns whether it is active.

    ``force=True`` activates it even if CUDA exists (used only by tests of the layer itself).
    """
    global _ACTIVE, _MODE
    if _ACTIVE:
        return True
    if torch.cuda.is_available() and not force:
        return False

    # lazy: Megatron-Core (~6 s) only once the layer is switched on: convert's mcore_io imports
    # this module, and reading a checkpoint there needs no Megatron
    import megatron.core.tensor_parallel.random as mrandom

    cuda = torch.cuda
    # The CPU device itself, not index 0 (which means cuda:0): code that the mode does not see
    # (backward functions run inside the mode's own handler for torch.autograd.backward, where
    # it is off) allocates with device=torch.cuda.current_device(), e.g. sequence parallelism's
    # reduce-scatter buffers.
    _patch(cuda, "current_device", lambda: torch.device("cpu"))
    _patch(cuda, "device_count", lambda: 0)
    _patch(cuda, "set_device", lambda *a, **k: None)
    _patch(cuda, "synchronize", lambda *a, **k: None)
    _patch(cuda, "empty_cache", lambda *a, **k: None)
    _patch(cuda, "current_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "default_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "Stream", _NullStream)
    _patch(cuda, "Event", _NullEvent)
    _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _patch(cuda, "get_rng_state", _cpu_get_rng_state)
    _patch(cuda, "set_rng_state", _cpu_set_rng_state)
    _patch(cuda, "manual_seed", _cpu_manual_seed)
    _patch(cuda, "memory_allocated", lambda *a, **k: 0)
    _patch(cuda, "max_memory_allocated", lambda *a, **k: 0)
    _patch(cuda, "memory_reserved", lambda *a, **k: 0)
    _patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    # The mode is off inside its own handler, and Megatron's schedule calls
    # torch.autograd.backward through it: code that activation recomputation re-runs in the
    # backward pass sees no redirect. The one CUDA allocation on that path is the local spec's
    # causal mask (fused_softmax imported it by name).
    import megatron.core.fusions.fused_softmax as fused_softmax  # lazy: as mrandom above

    _patch(fused_softmax, "get_default_causal_mask", _cpu_causal_mask)

    dist = torch.distributed
    _patch(dist, "all_to_all_single", _all_to_all_single(dist.all_to_all_single))
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ACTIVE = True
    return True


def disable() -> None:
    """Undo every patch (tests; a process that later gets CUDA does not use this layer)."""
    global _ACTIVE, _MODE
    if not _ACTIVE:
        return
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
        _MODE = None
    while _PATCHES:
        owner, attr, original = _PATCHES.pop()
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _ACTIVE = False
