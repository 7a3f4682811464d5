"""The CPU compatibility layer is confined: inert unless enabled, fully undone by disable()."""

import torch

from megatron_rl_fp8.parallel import cpu_compat


def test_inert_when_cuda_is_available(monkeypatch):
    was_active = cpu_compat.is_active()
    cpu_compat.disable()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device
    assert cpu_compat.enable() is False
    assert not cpu_compat.is_active()
    assert torch.cuda.current_device is before
    assert torch.empty(1, device="cpu").type() == "torch.FloatTensor"
    monkeypatch.undo()
    if was_active:
        cpu_compat.enable()


def test_enable_redirects_cuda_and_disable_restores():
    was_active = cpu_compat.is_active()  # an in-process run earlier in the session enables it
    cpu_compat.disable()
    originals = {
        name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "Stream")
    }
    try:
        assert cpu_compat.enable(force=True)
        x = torch.zeros(2, device="cuda")
        assert x.device.type == "cpu"
        assert x.cuda() is x
        assert torch.ones(1, device=torch.cuda.current_device()).device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
        torch.cuda.synchronize()
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), a)
    finally:
        cpu_compat.disable()
    for name, fn in originals.items():
        assert getattr(torch.cuda, name) is fn
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if was_active:
        cpu_compat.enable()


def test_the_cpu_suite_runs_on_the_cpu_even_where_a_gpu_is_visible():
    # tests/conftest.py hides CUDA from the default (non-gpu) run and everything it spawns, so a
    # GPU box gives CI's verdict; `pytest -m gpu` keeps the GPU for the GPU tests.
    import os

    if os.environ.get("MRF8_TEST_KEEP_CUDA") == "1":
        return
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()
