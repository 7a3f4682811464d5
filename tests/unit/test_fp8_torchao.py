"""The ``torchao`` FP8 backend (``fp8/torchao_backend.py``): selection, and its numerics against
the emulation on the CPU, where torchao's float8 matmul runs on CPU ``torch._scaled_mm``.

* tensorwise: torchao's codes are the emulation's (same amax / fp8-max scales), so the torch
  backend's derived bound holds (``test_fp8_backend._check_against_emulation``);
* rowwise: torchao rounds its row scales up to powers of two, so its codes differ; its error
  against the unquantized product is of the emulation's order (within a factor 1.5 either way
  here: measured 0.95-1.10x at these shapes);
* ``enabled=False`` (the BF16 shadow) is ``F.linear`` exactly.
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_fp8.fp8 import backend as backend_mod
from megatron_rl_fp8.fp8.backend import resolve_backend
from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator
from tests.unit.test_fp8_backend import H200, _check_against_emulation, _run

pytest.importorskip("torchao", reason="the torchao backend's tests need torchao (make install)")

from megatron_rl_fp8.fp8 import torchao_backend  # noqa: E402
from megatron_rl_fp8.fp8.torchao_backend import FP8LinearTorchAO  # noqa: E402


def test_explicit_only_and_one_line_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(backend_mod, "have_te", lambda: False)
    cfg = FP8Config(recipe="rowwise", backend="torchao")
    assert resolve_backend(cfg, capability=H200) == "torchao"
    # auto never takes it: the torch backend is the default without TE
    assert resolve_backend(FP8Config(recipe="rowwise"), capability=H200) == "torch"
    with pytest.raises(ValueError, match="no CUDA GPU is visible") as e:
        resolve_backend(cfg, capability=None)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torchao_backend, "have_torchao", lambda: False)
    with pytest.raises(ValueError, match=r"torchao is not installed \(`pip install torchao"):
        resolve_backend(cfg, capability=H200)
    with pytest.raises(ValueError, match="cannot run recipe='blockwise'.*'torch' or 'emulate'"):
        FP8Config(recipe="blockwise", backend="torchao")
    FP8Config(recipe="tensorwise_current", backend="torchao", compile_casts=True)  # allowed


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tensorwise_is_the_emulation_within_the_derived_bound(fmt, dtype):
    _check_against_emulation("tensorwise_current", fmt, dtype, make=FP8LinearTorchAO, calls=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rowwise_error_is_of_the_emulations_order(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 64, generator=gen).to(dtype)
    w = (torch.randn(48, 64, generator=gen) * 0.1).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    g = torch.randn(30, 48, generator=gen).to(dtype)
    cfg = FP8Config(recipe="rowwise")
    emu = _run(FP8LinearEmulator(cfg), x, w, b, g)
    ao = _run(FP8LinearTorchAO(cfg), x, w, b, g)
    xx, ww = x.double().requires_grad_(), w.double().requires_grad_()
    y = xx @ ww.t() + b.double()
    y.backward(g.double())
    exact = (y.detach(), xx.grad, ww.grad)
    for name, a, e, ref in zip(("y", "dx", "dw"), ao, emu, exact):
        err_ao = ((a.double() - ref).norm() / ref.norm()).item()
        err_emu = ((e.double() - ref).norm() / ref.norm()).item()
        assert 0.01 < err_ao and err_emu / 1.5 < err_ao < 1.5 * err_emu, (name, err_ao, err_emu)


def test_every_linear_shares_the_torchao_configs():
    """A compiled call guards on the config objects: distinct ones per linear would compile a
    graph per linear and pass Dynamo's limit within a layer or two."""
    cfg = FP8Config(recipe="rowwise", format="e4m3")
    a, b = FP8LinearTorchAO(cfg), FP8LinearTorchAO(FP8Config(recipe="rowwise", format="e4m3"))
    assert a.ao_config is b.ao_config and a.mm_config is b.mm_config
    assert FP8LinearTorchAO(FP8Config(recipe="rowwise", format="hybrid")).ao_config is not (
        a.ao_config
    )


def test_disabled_is_plain_linear():
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 32, generator=gen), torch.randn(16, 32, generator=gen), None
    linear = FP8LinearTorchAO(FP8Config(recipe="tensorwise_current"), enabled=False)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert repr(linear).startswith("FP8LinearTorchAO(recipe='tensorwise_current'")


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")),
    reason="torch.compile on the CPU builds C++: no g++ or clang++ here",
)
def test_compiled_call_gives_the_eager_results():
    """``fp8.compile_casts`` compiles torchao's whole call (casts and GEMMs, dynamic shapes):
    outputs and both gradients equal eager's bit for bit on the CPU, at two token counts."""
    compiled = FP8LinearTorchAO(
        FP8Config(recipe="tensorwise_current", backend="torchao", compile_casts=True)
    )
    eager = FP8LinearTorchAO(FP8Config(recipe="tensorwise_current", backend="torchao"))
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    for tokens in (32, 48):
        x = torch.randn(tokens, 64, generator=gen)
        g = torch.randn(tokens, 32, generator=gen)
        got, want = _run(compiled, x, w, b, g), _run(eager, x, w, b, g)
        assert all(torch.equal(u, v) for u, v in zip(got, want)), tokens


def _micro_batches(linear, w, batches, *, scope: bool):
    """Forward + backward of each (x, g) with ``w`` shared (its gradient accumulates, as over a
    schedule's micro-batches), inside ``linear.weight_cache()`` or not."""
    w = w.detach().clone().requires_grad_()
    outs = []
    with linear.weight_cache() if scope else contextlib.nullcontext():
        for x, g in batches:
            x = x.detach().clone().requires_grad_()
            y = linear(x, w)
            y.backward(g)
            outs += [y.detach(), x.grad]
    return [*outs, w.grad]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tensorwise_weight_cache_casts_once_and_changes_nothing(monkeypatch, compiled):
    """Inside the actor's scope the weight is cast once for every micro-batch and both GEMMs;
    outputs and gradients (input and the accumulated weight gradient) are the per-call casts'
    bit for bit; an in-place change of the weight is noticed; rowwise never caches."""
    if compiled and not (shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("torch.compile on the CPU builds C++: no g++ or clang++ here")
    casts = []
    real = torchao_backend._cast_weight_t
    monkeypatch.setattr(torchao_backend, "_cast_weight_t", lambda *a: casts.append(1) or real(*a))
    cfg = FP8Config(recipe="tensorwise_current", backend="torchao", compile_casts=compiled)
    linear = FP8LinearTorchAO(cfg)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen).bfloat16()
    batches = [
        (
            torch.randn(32, 64, generator=gen).bfloat16(),
            torch.randn(32, 48, generator=gen).bfloat16(),
        )
        for _ in range(3)
    ]
    cached = _micro_batches(linear, w, batches, scope=True)
    assert len(casts) == 1 and linear.weights.entries is None  # cleared on leaving the scope
    per_call = _micro_batches(linear, w, batches, scope=False)
    assert len(casts) == 1  # outside a scope torchao casts inside its own call
    assert all(torch.equal(a, b) for a, b in zip(cached, per_call))

    wl = w.clone().requires_grad_()
    with linear.weight_cache():
        linear(batches[0][0], wl)
        with torch.no_grad():
            wl.mul_(2.0)  # bumps the version: cast again
        linear(batches[0][0], wl)
    assert len(casts) == 3

    rowwise = FP8LinearTorchAO(FP8Config(recipe="rowwise", backend="torchao"))
    with rowwise.weight_cache():
        rowwise(batches[0][0], w)
        assert rowwise.weights.entries == {}
    assert len(casts) == 3
