"""fp8.backend: which backend runs the FP8 GEMMs, its errors, and the torch backend's numerics.

The torch backend's GEMMs are ``torch._scaled_mm``, which CPU torch runs (slowly, so shapes here
are tiny) for per-tensor and per-row scales. Its blockwise GEMM (``torch.nn.functional.scaled_mm``
with block scaling) is CUDA-only: here a stand-in checks the operand and scale layouts the H200
accepted (docs: PLATFORM_NOTES) and multiplies the dequantized operands; the real kernel runs in
``tests/gpu/test_fp8_torch_backend.py``.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8 import backend as backend_mod
from megatron_rl_fp8.fp8 import torch_backend as tb
from megatron_rl_fp8.fp8.backend import (
    backend_problem,
    cuda_capability,
    holds_step_scales,
    moving_scales_note,
    resolve_backend,
    should_emulate,
)
from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator, quantize_operand
from megatron_rl_fp8.fp8.recipes import BACKEND_RECIPES
from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch, quantize_gemm_operand
from megatron_rl_fp8.models.fp8 import (
    emulated_linears,
    fp8_weight_cache,
    full_precision,
    install_fp8_linears,
    weight_quantization_errors,
)
from tests.aten_scaled_mm import block_scaled_mm

FP8_RECIPES = ["tensorwise_delayed", "tensorwise_current", "rowwise", "blockwise", "mxfp8"]


# -- config: the backend field, the emulate alias, the recipe x backend matrix ------------------
def test_backend_default_and_emulate_alias():
    assert FP8Config().backend == "auto" and not FP8Config().emulate
    assert FP8Config(emulate=True).backend == "emulate"
    assert FP8Config(backend="emulate").emulate  # kept in step: YAML written back reads the same
    cfg = FP8Config(recipe="rowwise", backend="torch")
    assert FP8Config(**dataclasses.asdict(cfg)) == cfg
    with pytest.raises(ValueError, match="FP8Config.emulate=True contradicts backend='torch'"):
        FP8Config(recipe="blockwise", emulate=True, backend="torch")
    with pytest.raises(ValueError, match=r"FP8Config.backend='cuda' is not valid"):
        FP8Config(backend="cuda")


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("backend", ["te", "torch", "torchao", "emulate"])
def test_recipe_backend_matrix_is_checked_at_config(recipe, backend):
    runs = recipe in BACKEND_RECIPES[backend]
    expected = {
        "te": recipe != "rowwise",
        "torch": recipe != "mxfp8",
        "torchao": recipe in ("tensorwise_current", "rowwise"),
        "emulate": True,
    }[backend]
    assert runs == expected
    if runs:
        FP8Config(recipe=recipe, backend=backend)
        return
    with pytest.raises(ValueError) as e:
        FP8Config(recipe=recipe, backend=backend)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"FP8Config.backend={backend!r}")
    assert "'emulate'" in msg and f"recipe={recipe!r}" in msg
    backends = ("te", "torch", "torchao", "emulate")
    can = " or ".join(repr(b) for b in backends if recipe in BACKEND_RECIPES[b])
    assert msg.endswith(f"use backend {can} (or 'auto')")  # names the backends that can


def test_bf16_recipe_accepts_any_backend_and_resolves_to_none():
    for backend in ("te", "torch", "emulate", "auto"):
        assert resolve_backend(FP8Config(backend=backend), capability=None) is None


def test_te_backend_needs_the_lm_head_in_bf16():
    with pytest.raises(ValueError, match="keep_lm_head_bf16=False cannot run on backend='te'"):
        FP8Config(recipe="blockwise", backend="te", keep_lm_head_bf16=False)


def test_scales_per_step_needs_a_delayed_recipe():
    with pytest.raises(
        ValueError, match="scales_per_step=true has no effect with recipe='blockwise'"
    ):
        FP8Config(recipe="blockwise", scales_per_step=True)
    # TE holds them too (one autocast region around the step, docs/gpu_contracts.md TE-7).
    assert FP8Config(recipe="tensorwise_delayed", backend="te", scales_per_step=True)
    with pytest.raises(ValueError, match="scales_per_step='yes' is not valid"):
        FP8Config(recipe="tensorwise_delayed", scales_per_step="yes")
    assert FP8Config(scales_per_step=True).scales_per_step  # BF16: nothing to pin, no refusal
    # 'auto' (the default) refuses nothing: it holds the scales only where they can be held.
    assert FP8Config(recipe="tensorwise_delayed", backend="te").scales_per_step == "auto"
    assert FP8Config(recipe="blockwise").scales_per_step == "auto"


# -- resolving for this machine --------------------------------------------------------------------
@pytest.fixture
def machine(monkeypatch):
    """Set what the probe sees: TE importable or not, block-scaled scaled_mm or not."""

    def set_(*, te: bool, block_mm: bool = True):
        monkeypatch.setattr(backend_mod, "have_te", lambda: te)
        monkeypatch.setattr(backend_mod, "have_blockwise_scaled_mm", lambda: block_mm)
        # A CUDA build's own toolkit version must not decide the table (cuBLASLt >= 12.9 holds).
        monkeypatch.setattr(backend_mod, "cuda_toolkit_version", lambda: (12, 9))

    return set_


H200, A100, B200 = (9, 0), (8, 0), (10, 0)


@pytest.mark.parametrize(
    "capability, te, block_mm, expected",
    [
        # no GPU: everything emulated, TE or not
        (None, True, True, dict.fromkeys(FP8_RECIPES, "emulate")),
        # Hopper with TE: TE where it has the recipe; rowwise on torch; mxfp8 needs Blackwell
        (H200, True, True, {"tensorwise_delayed": "te", "tensorwise_current": "te",
                            "rowwise": "torch", "blockwise": "te", "mxfp8": "emulate"}),
        # Hopper without TE (this project's H200): real FP8 through torch
        (H200, False, True, {"tensorwise_delayed": "torch", "tensorwise_current": "torch",
                             "rowwise": "torch", "blockwise": "torch", "mxfp8": "emulate"}),
        # ... with a torch lacking block-scaled scaled_mm: blockwise falls back to emulation
        (H200, False, False, {"tensorwise_delayed": "torch", "tensorwise_current": "torch",
                              "rowwise": "torch", "blockwise": "emulate", "mxfp8": "emulate"}),
        # Blackwell with TE: TE's MXFP8
        (B200, True, True, {"tensorwise_delayed": "te", "tensorwise_current": "te",
                            "rowwise": "torch", "blockwise": "te", "mxfp8": "te"}),
        # an A100 has no FP8 tensor cores
        (A100, True, True, dict.fromkeys(FP8_RECIPES, "emulate")),
    ],
)  # fmt: skip
def test_auto_picks_te_then_torch_then_emulate(machine, capability, te, block_mm, expected):
    machine(te=te, block_mm=block_mm)
    got = {r: resolve_backend(FP8Config(recipe=r), capability=capability) for r in FP8_RECIPES}
    assert got == expected


def test_auto_skips_te_for_an_fp8_lm_head(machine):
    machine(te=True)
    cfg = FP8Config(recipe="tensorwise_current", keep_lm_head_bf16=False)
    assert resolve_backend(cfg, capability=H200) == "torch"


def test_scales_per_step_keeps_te(machine):
    machine(te=True)
    for setting in ("auto", True, False):
        cfg = FP8Config(recipe="tensorwise_delayed", scales_per_step=setting)
        assert resolve_backend(cfg, capability=H200) == "te"


@pytest.mark.parametrize(
    "recipe, setting, backend, held",
    [
        ("tensorwise_delayed", "auto", "emulate", True),
        ("tensorwise_delayed", "auto", "torch", True),
        ("tensorwise_delayed", "auto", "te", True),  # one TE region around the step
        ("tensorwise_delayed", False, "te", False),
        ("tensorwise_delayed", False, "emulate", False),
        ("tensorwise_delayed", True, "torch", True),
        ("blockwise", "auto", "emulate", False),  # no history to hold
        ("tensorwise_current", "auto", "torch", False),
        ("bf16", "auto", None, False),
    ],
)
def test_whether_a_step_holds_its_delayed_scales(recipe, setting, backend, held):
    cfg = FP8Config(recipe=recipe, scales_per_step=setting)
    assert holds_step_scales(cfg, backend) is held
    # The run log says so where delayed scales move within a step, and only there.
    note = moving_scales_note(cfg, backend)
    assert (note is not None) == (cfg.enabled and cfg.spec.delayed and not held)
    if note is not None:
        assert "\n" not in note and "docs/reproduction.md" in note
        assert "fp8.scales_per_step=false" in note  # the only way to get moving scales
        assert "loss.calib.mode=oracle" in note  # what met the bar with moving scales


@pytest.mark.parametrize(
    "backend, recipe, capability, te, block_mm, needle",
    [
        ("torch", "tensorwise_current", None, False, True, "no CUDA GPU is visible"),
        ("te", "blockwise", None, True, True, "no CUDA GPU is visible"),
        ("torch", "rowwise", A100, False, True, "compute capability 8.0"),
        ("te", "mxfp8", H200, True, True, "needs >= 10.0"),
        ("te", "blockwise", H200, False, True, r"`pip install megatron-rl-fp8\[gpu\]`"),
        ("torch", "blockwise", H200, False, False, "block-scaled torch.nn.functional.scaled_mm"),
    ],
)
def test_explicit_backend_that_cannot_run_is_one_line(
    machine, backend, recipe, capability, te, block_mm, needle
):
    machine(te=te, block_mm=block_mm)
    with pytest.raises(ValueError, match=needle) as e:
        resolve_backend(FP8Config(recipe=recipe, backend=backend), capability=capability)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"FP8Config.backend={backend!r} cannot run recipe={recipe!r} here")
    assert "use backend 'emulate'" in msg


def test_explicit_backend_that_can_run(machine):
    machine(te=False)
    cfg = FP8Config(recipe="rowwise", backend="torch")
    assert resolve_backend(cfg, capability=H200) == "torch"
    assert backend_problem("emulate", "mxfp8", None) is None
    assert resolve_backend(FP8Config(recipe="mxfp8", backend="emulate"), capability=B200) == (
        "emulate"
    )


def test_this_machine_is_cpu_in_the_default_suite():
    # tests/conftest.py hides CUDA from the CPU suite: the probe must see no GPU.
    if torch.cuda.is_available():
        pytest.skip("CUDA visible (MRF8_TEST_KEEP_CUDA=1)")
    assert cuda_capability() is None
    assert resolve_backend(FP8Config(recipe="blockwise")) == "emulate"
    assert should_emulate(FP8Config(recipe="blockwise")) and not should_emulate(FP8Config())


def test_run_config_rejects_a_backend_this_machine_lacks():
    if torch.cuda.is_available():
        pytest.skip("CUDA visible (MRF8_TEST_KEEP_CUDA=1)")
    cfg = load_config(None, ["fp8.recipe=tensorwise_current", "fp8.backend=torch"])
    with pytest.raises(ConfigError, match=r"^fp8\.backend='torch' cannot run .*no CUDA GPU"):
        cfg.validate(world_size=1)
    cfg.validate(world_size=1, this_machine=False)  # the rest of the config is fine
    load_config(None, ["fp8.recipe=rowwise", "fp8.backend=emulate"]).validate(world_size=1)


# -- the torch backend's numerics against the emulation ----------------------------------------
def _run(linear, x, w, b, g, calls=1):
    """Forward + backward ``calls`` times (delayed scaling's history moves); last outputs."""
    for _ in range(calls):
        xx, ww, bb = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = linear(xx, ww, bb)
        y.backward(g)
    return y.detach().float(), xx.grad.float(), ww.grad.float(), bb.grad.float()


def _within(name, got, want, tol):
    excess = (got - want).abs() - tol
    worst = excess.argmax()
    assert (excess <= 0).all(), (
        f"{name}: error {excess.flatten()[worst] + tol.flatten()[worst]:.3g} > tolerance "
        f"{tol.flatten()[worst]:.3g}"
    )


def _check_against_emulation(
    recipe, fmt, dtype, *, tokens=(2, 15), k=40, n=24, calls=2, make=FP8LinearTorch
):
    """Both sides multiply the same FP8 codes (same scales, same rounding; the blockwise test
    asserts the codes directly), so they differ only by rounding after the product p:

    * the emulation rounds p + bias once to ``dtype``;
    * the torch backend (``make``; torchao's tensorwise too) rounds p to bfloat16 (the GEMM's
      output; torchao's is the input's dtype), adds the bias in that dtype and rounds again
      when ``dtype`` is float32 -> bfloat16 -> float32 is exact.

    With u = 2^-8 (bfloat16's unit roundoff) each rounding moves a value by at most u times its
    magnitude, so |y_torch - y_emu| <= u (|p| + 2 |y|) <= u (3 |y| + |bias|). Gradients have no
    bias: <= 2 u |dx|. Float32 summation order adds at most K 2^-24 sum|a||b|, far below
    1e-4 max|y| at these sizes: that is the absolute slack.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*tokens, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(*tokens, n, generator=gen).to(dtype)
    cfg = FP8Config(recipe=recipe, format=fmt)
    emu = _run(FP8LinearEmulator(cfg), x, w, b, g, calls)
    got = _run(make(cfg), x, w, b, g, calls)
    u = 2.0**-8
    y, dx, dw, db = emu
    _within("y", got[0], y, u * (3 * y.abs() + b.float().abs()) + 1e-4 * y.abs().max())
    _within("dx", got[1], dx, 2 * u * dx.abs() + 1e-4 * dx.abs().max())
    _within("dw", got[2], dw, 2 * u * dw.abs() + 1e-4 * dw.abs().max())
    assert torch.equal(got[3], db)
    # And FP8 really happened: the result is not the unquantized product.
    exact = x.float() @ w.float().t() + b.float()
    assert (got[0] - exact).abs().max() > 1e-3


def _layout_checked(real):
    """``torch._scaled_mm`` after the checks CUDA makes and CPU torch skips: row-major a,
    column-major b, float32 scales that are 0-d or [M, 1] / [1, N] and contiguous."""

    def scaled_mm(a, b, *, scale_a, scale_b, **kwargs):
        assert a.is_contiguous() and b.t().is_contiguous(), "a row-major, b column-major"
        assert all(d % 16 == 0 for d in (*a.shape, *b.shape)), (a.shape, b.shape)
        assert scale_a.dtype == scale_b.dtype == torch.float32
        if scale_a.dim():
            assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
            assert scale_a.is_contiguous() and scale_b.is_contiguous()
        else:
            assert scale_b.dim() == 0
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("recipe", ["tensorwise_current", "tensorwise_delayed", "rowwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scaled_mm_backend_matches_emulation(monkeypatch, recipe, fmt, dtype):
    monkeypatch.setattr(torch, "_scaled_mm", _layout_checked(torch._scaled_mm))
    _check_against_emulation(recipe, fmt, dtype)


def test_blockwise_layouts_and_numerics_against_emulation(monkeypatch):
    """e4m3 only: ATen's block-scaled GEMM takes no e5m2 operand (tests/aten_scaled_mm.py)."""
    monkeypatch.setattr(F, "scaled_mm", block_scaled_mm)
    # Ragged sizes: every dim is padded (K and N to 128, tokens to 16) and sliced back.
    _check_against_emulation(
        "blockwise", "e4m3", torch.float32, tokens=(3, 50), k=200, n=136, calls=1
    )


@pytest.mark.parametrize(
    "recipe, role", [("tensorwise_current", "input"), ("rowwise", "weight"),
                     ("blockwise", "input"), ("blockwise", "weight")],
)  # fmt: skip
def test_codes_are_the_emulations(recipe, role):
    t = torch.randn(40, 300, generator=torch.Generator().manual_seed(3)) * 5
    op = quantize_gemm_operand(t, recipe, role, "e4m3")
    gran = op.granularity
    if gran == "tensor":
        scale = op.scale_inv
    elif gran == "row":
        scale = op.scale_inv.expand_as(op.codes)
    elif gran == "group":
        scale = op.scale_inv.repeat_interleave(128, 1)
    else:
        scale = op.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    deq = (op.codes.float() * scale)[:40, :300]
    assert torch.equal(deq, quantize_operand(t, recipe, role, dim=-1))
    assert op.codes.is_contiguous()  # cuBLAS reads row-major codes (CPU torch does not care)
    assert quantize_gemm_operand(t.t(), recipe, role).codes.is_contiguous()
    assert (
        op.codes.shape[0] % 16 == 0
        and op.codes.shape[1] % (128 if recipe == "blockwise" else 16) == 0
    )


def test_unsupported_recipe_fails_at_construction():
    with pytest.raises(ValueError, match="recipe='mxfp8' has no torch-backend GEMM"):
        FP8LinearTorch(FP8Config(recipe="mxfp8"))


# -- weight cache ----------------------------------------------------------------------------------
def test_weight_cache_quantizes_once_per_scope_and_notices_changes(monkeypatch):
    calls = []
    real = tb.quantize_gemm_operand

    def counting(t, recipe, role, *args, **kwargs):
        calls.append(role)
        return real(t, recipe, role, *args, **kwargs)

    monkeypatch.setattr(tb, "quantize_gemm_operand", counting)
    linear = FP8LinearTorch(FP8Config(recipe="rowwise"))
    w = torch.randn(16, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)

    def step():
        linear(x, w).sum().backward()

    with linear.weight_cache():
        for _ in range(3):
            step()
        assert calls.count("weight") == 2  # fprop [N, K] and dgrad [K, N] copies, once each
        with torch.no_grad():
            w.add_(1.0)  # an in-place update bumps the version: re-quantized
        step()
        assert calls.count("weight") == 4
    calls.clear()
    step()
    step()
    assert calls.count("weight") == 4  # no scope: every call quantizes


def test_delayed_scaling_never_caches():
    linear = FP8LinearTorch(FP8Config(recipe="tensorwise_delayed"))
    w = torch.randn(16, 32)
    with linear.weight_cache():
        linear(torch.randn(16, 32), w)
        assert linear.weights.get(w, "fprop") is None


# -- installed into a model ------------------------------------------------------------------------
class _Linear(torch.nn.Module):
    """Megatron's linear surface as the FP8 installer sees it: weight and ``_forward_impl``."""

    def __init__(self, n, k, seed):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
        )

    def _forward_impl(self, input, weight, bias=None, **_):
        return F.linear(input, weight, bias)

    def forward(self, x):
        return self._forward_impl(x, self.weight)


class _Layer(torch.nn.Module):
    def __init__(self, number):
        super().__init__()
        self.layer_number = number
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = _Linear(32, 32, number)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(1), _Layer(2)])
        self.output_layer = _Linear(48, 32, 9)


def test_install_torch_backend_and_full_precision_switch():
    model = _Model()
    fp8 = FP8Config(recipe="tensorwise_current", bf16_first_layers=1, keep_lm_head_bf16=False)
    assert install_fp8_linears(model, fp8, num_layers=2, backend="torch") == 2
    names = sorted(n for n, _, _ in emulated_linears(model))
    assert names == ["decoder.layers.1.mlp.linear_fc1", "output_layer"]
    assert all(isinstance(g.emulator, FP8LinearTorch) for _, _, g in emulated_linears(model))
    fc1 = model.decoder.layers[1].mlp.linear_fc1
    x = torch.randn(16, 32)
    y8 = fc1(x)
    with full_precision(model):
        y16 = fc1(x)
    assert torch.equal(y16, x @ fc1.weight.t())
    assert 0 < (y8 - y16).abs().max() < 0.1 * y16.abs().max()
    with fp8_weight_cache(model):
        assert fc1._forward_impl.emulator.weights.entries == {}
        assert torch.equal(fc1(x), y8)
    assert fc1._forward_impl.emulator.weights.entries is None
    assert set(weight_quantization_errors(model, fp8)) == {"L2.linear_fc1", "lm_head"}
    with pytest.raises(ValueError, match="backend='te' has no FP8 linears to install"):
        install_fp8_linears(_Model(), fp8, num_layers=2, backend="te")


# -- compiled casts (fp8.compile_casts) -----------------------------------------------------------
def test_compile_casts_is_for_the_torch_and_torchao_backends_only():
    FP8Config(recipe="rowwise", backend="torch", compile_casts=True)
    FP8Config(recipe="rowwise", backend="torchao", compile_casts=True)
    FP8Config(recipe="rowwise", compile_casts=True)  # auto: applies where torch is picked
    for backend in ("te", "emulate"):
        with pytest.raises(ValueError) as e:
            FP8Config(recipe="tensorwise_current", backend=backend, compile_casts=True)
        msg = str(e.value)
        assert msg.startswith(
            "FP8Config.compile_casts=True applies to backends 'torch' and 'torchao' only"
        )
        assert f"(got backend={backend!r})" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="FP8Config.compile_casts='yes' is not valid"):
        FP8Config(compile_casts="yes")


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")),
    reason="torch.compile on the CPU builds C++: no g++ or clang++ here",
)
@pytest.mark.parametrize("recipe", ["tensorwise_current", "tensorwise_delayed", "rowwise"])
def test_compiled_casts_give_the_eager_codes_and_gradients(recipe):
    """Inductor's fused cast (CPU C++ here, Triton on a GPU) against the eager kernels (delayed
    scaling: a given scale instead of the amax, a graph of its own): the same forward output and
    the same dgrad / wgrad, bit for bit, at two ragged token counts (dynamic shapes: the second
    needs no new compile)."""
    cfg = dict(recipe=recipe, format="hybrid")
    eager = FP8LinearTorch(FP8Config(**cfg))
    compiled = FP8LinearTorch(FP8Config(**cfg, compile_casts=True))
    assert compiled.quantize is tb.compiled_quantize() and eager.quantize is quantize_gemm_operand
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(136, 200, generator=gen) * 0.1).to(torch.bfloat16)
    for tokens in (50, 77):
        x = (torch.randn(tokens, 200, generator=gen) * 3).to(torch.bfloat16)
        gy = torch.randn(tokens, 136, generator=gen).to(torch.bfloat16)
        got = []
        for linear in (eager, compiled):
            xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            y = linear(xi, wi)
            y.backward(gy)
            got.append((y.detach(), xi.grad, wi.grad))
        for a, b, what in zip(*got, ("output", "dgrad", "wgrad"), strict=True):
            assert torch.equal(a, b), (tokens, what, (a.float() - b.float()).abs().max().item())
