"""Emulated FP8 inside the Megatron actor (CPU path of the TE spec): which linears run FP8, that
they compute exactly what the FP8 emulator computes, and that the BF16 shadow switch is exact."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _actor(fp8_kwargs, tp=1, sp=False):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    layout = parallel.ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    g = parallel.initialize(layout, seed=5)
    mc = ModelConfig(
        arch="qwen3",
        num_layers=3,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=53,
        max_position_embeddings=32,
    )
    return Actor(mc, OptimConfig(), g, fp8=FP8Config(**fp8_kwargs), parallel=layout), g


def _placement_body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.fp8 import emulated_linears

    out = {}
    for label, kw in {
        "all": dict(recipe="blockwise"),
        "edges": dict(recipe="blockwise", bf16_first_layers=1, bf16_last_layers=1),
        "lm_head": dict(recipe="tensorwise_current", keep_lm_head_bf16=False),
        "off": dict(recipe="bf16"),
        # auto resolves to the emulation on a CPU: nothing to compile, and the log says so
        "compiled": dict(recipe="blockwise", compile_casts=True),
    }.items():
        actor, _ = _actor(kw)
        out[label] = sorted(n for n, _, _ in emulated_linears(actor.module))
        out[f"{label} describe"] = actor.describe()
        parallel.destroy()
    return out


def test_which_linears_run_fp8():
    got = run_distributed(_placement_body, world_size=1)[0]
    assert len(got["all"]) == 12 and all(".linear_" in n for n in got["all"])
    assert got["edges"] == [n for n in got["all"] if n.startswith("decoder.layers.1.")]
    assert "output_layer" in got["lm_head"] and len(got["lm_head"]) == 13
    assert got["off"] == []
    assert got["all describe"].endswith("FP8 blockwise (emulated)")
    assert got["compiled describe"].endswith("FP8 blockwise (emulated, fp8.compile_casts unused)")


def _exactness_body(rank, world):
    import torch.nn.functional as F

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator

    actor, _ = _actor(dict(recipe="tensorwise_current", format="hybrid"))
    lin = actor.module.decoder.layers[0].mlp.linear_fc1
    x = torch.randn(6, 2, 128, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y, _ = lin(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    dx, dw = x.grad.clone(), lin.weight.main_grad.clone()  # Megatron DDP's grad buffer

    w = lin.weight.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    y_ref = FP8LinearEmulator(FP8Config(recipe="tensorwise_current", format="hybrid"))(x2, w)
    y_ref.backward(gy)
    exact = (torch.equal(y, y_ref), torch.equal(dx, x2.grad), torch.equal(dw, w.grad))

    with actor.full_precision():
        y16, _ = lin(x.detach())
    plain = F.linear(x.detach(), lin.weight.detach())
    shadow = (y16 - plain).abs().max().item()
    fp8_gap = (y.detach() - plain).abs().max().item()
    y_again, _ = lin(x.detach())  # FP8 is back on after the block
    gaps = _torch_backend_gaps(actor)  # in this process: no second spawn and Megatron import
    parallel.destroy()
    return exact, shadow, fp8_gap, torch.equal(y_again, y.detach()), gaps


def test_emulated_linear_is_the_emulator_and_shadow_is_exact():
    exact, shadow, fp8_gap, restored, gaps = run_distributed(_exactness_body, world_size=1)[0]
    assert exact == (True, True, True)  # forward, dgrad and wgrad bit-identical
    assert shadow < 1e-5 < fp8_gap  # the shadow pass is the unquantized GEMM
    assert restored
    torch_emu, emu_bf16, torch_emu_after, moved, ok = gaps
    assert ok
    # The torch backend: same FP8 codes; what differs is its bf16 GEMM outputs in this float32
    # model (2^-9 relative per output, while the operands' FP8 errors average over K): about
    # half of FP8's own distance from BF16 here, and never more than it.
    assert torch_emu < emu_bf16
    # After the step the cached FP8 weights were refreshed: the new weights, not the old ones.
    assert torch_emu_after < emu_bf16 < moved


def _set_full_weights(actor, g):
    """Identical full weights at any TP size: each full tensor is drawn from a generator seeded by
    its name, then this rank keeps its shard (Megatron's init is not TP-invariant)."""
    from megatron_rl_fp8.sync.gather import split_tp_shard, tp_partition_dim

    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(actor.module.named_parameters())):
            shape = list(p.shape)
            dim = tp_partition_dim(name)
            if dim is not None:
                shape[dim] *= g.tp_size
            full = (
                1.0 + 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(i))
                if "layernorm" in name
                else 0.05 * torch.randn(shape, generator=torch.Generator().manual_seed(i))
            )
            p.copy_(split_tp_shard(name, full, g.tp_rank, g.tp_size))


# (recipe, FP8 linears): MXFP8 has no torch-backend GEMM; tensorwise runs real FP8 codes on CPU,
# through this project's _scaled_mm backend and through torchao's float8 matmul.
TP_CASES = {"emulate": "mxfp8", "torch": "tensorwise_current", "torchao": "tensorwise_current"}


def _tp_step(tp, sp, backend):
    """One training step of the 3-layer FP8 actor on fixed full weights: (loss, grad norm, ok)."""
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch
    from megatron_rl_fp8.models.fp8 import emulated_linears

    actor, g = _actor(dict(recipe=TP_CASES[backend]), tp=tp, sp=sp)
    if backend != "emulate":  # torch / torchao need an FP8 GPU: same linears, real FP8 codes
        from megatron_rl_fp8.fp8.torchao_backend import FP8LinearTorchAO

        make = {"torch": FP8LinearTorch, "torchao": FP8LinearTorchAO}[backend]
        for _, _, gemm in emulated_linears(actor.module):
            gemm.emulator = make(actor.fp8)
    _set_full_weights(actor, g)
    ids = torch.randint(4, 53, (4, 10), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(4, 10)}

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / 40, {}

    out, grad_norm, ok = actor.train_step(batch, 4, nll)
    return (out[0]["loss"].item() if out else None), grad_norm, ok


def _tp_body(rank, world, tp):
    from megatron_rl_fp8 import parallel

    layouts = [(False, "emulate")]
    if tp == 2:
        layouts += [
            (sp, b) for b in TP_CASES for sp in (False, True) if (sp, b) != (False, "emulate")
        ]
    out = {(sp, backend): _tp_step(tp, sp, backend) for sp, backend in layouts}
    parallel.destroy()
    return out


@pytest.fixture(scope="module")
def tp_runs():
    """{(sequence parallel, backend): (loss, grad norm, ok)} at TP=1 and on rank 0 of TP=2."""
    return (
        run_distributed(_tp_body, world_size=1, args=(1,))[0],
        run_distributed(_tp_body, world_size=2, args=(2,))[0],
    )


def test_tp2_fp8_step_matches_tp1(tp_runs):
    """MXFP8's 32-element scale groups fall inside the TP shards here (every split dim is a
    multiple of 32), so TP=2 quantizes exactly the groups TP=1 does and must agree up to fp32
    reduction order. (With the column-parallel dgrad all-reduce removed the grad norm drops
    6.5 -> 4.6.)"""
    (loss1, gn1, ok1), (loss2, gn2, ok2) = (run[False, "emulate"] for run in tp_runs)
    assert ok1 and ok2
    assert loss2 == pytest.approx(loss1, rel=1e-5)
    assert gn2 == pytest.approx(gn1, rel=1e-5)


@pytest.mark.parametrize("backend", sorted(TP_CASES))
def test_sequence_parallel_fp8_step_matches_tp2(tp_runs, backend):
    """Sequence parallelism at TP=2 under FP8 (the emulation, and the torch backend's real codes):
    each column-parallel linear all-gathers the sequence-split input before quantizing it, so it
    sees the tensor it sees without SP; the row-parallel outputs are reduce-scattered instead of
    all-reduced and the dgrads reduce-scattered instead of all-reduced: the same two-term sums."""
    tp2 = tp_runs[1]
    (loss, gn, ok), (loss_sp, gn_sp, ok_sp) = tp2[False, backend], tp2[True, backend]
    assert ok and ok_sp
    assert loss_sp == pytest.approx(loss, rel=1e-5)
    assert gn_sp == pytest.approx(gn, rel=1e-5)


def _torch_backend_gaps(actor):
    """The torch backend's linears (real FP8 codes into ``torch._scaled_mm``, which CPU torch runs
    at these sizes) in the actor's schedule. ``fp8.backend: torch`` needs an FP8 GPU, so the
    emulated linears are swapped for the torch backend's on the same weights. Mean logprob gaps:
    torch vs emulation, emulation vs BF16, the same two after a step, torch before vs after."""
    from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch
    from megatron_rl_fp8.models.fp8 import emulated_linears

    fp8 = actor.fp8
    gemms = [gemm for _, _, gemm in emulated_linears(actor.module)]
    ids = torch.randint(4, 53, (8, 10), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(8, 10)}

    def logprobs(kind):
        for gemm in gemms:
            gemm.emulator = FP8LinearTorch(fp8) if kind == "torch" else FP8LinearEmulator(fp8)
        if kind == "bf16":
            with actor.full_precision():
                return actor.compute_logprobs(batch, 8, entropy=False)["logprobs"]
        # 4 micro-batches: the torch backend reuses each quantized weight across them
        return actor.compute_logprobs(batch, 2, entropy=False)["logprobs"]

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / 80, {}

    before = {kind: logprobs(kind) for kind in ("torch", "emulate", "bf16")}
    logprobs("torch")
    _, grad_norm, ok = actor.train_step(batch, 2, nll)
    after = {kind: logprobs(kind) for kind in ("torch", "emulate")}
    gap = lambda a, b: (a - b).abs().mean().item()  # noqa: E731
    return (
        gap(before["torch"], before["emulate"]),
        gap(before["emulate"], before["bf16"]),
        gap(after["torch"], after["emulate"]),
        gap(after["torch"], before["torch"]),
        ok,
    )


def _sp_linear_body(rank, world):
    """One torch-backend linear, sequence-parallel over the two ranks, against the same linear on
    the whole sequence in this process; and what each keeps for its backward."""
    import torch.distributed as dist

    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(12, 2, 64, generator=gen).bfloat16()  # [sequence, batch, hidden]
    w = (torch.randn(48, 64, generator=gen) * 0.1).bfloat16()
    dy = torch.randn(12, 2, 48, generator=gen).bfloat16()
    out = {}
    real_gather = dist.all_gather_into_tensor
    for recipe in ("tensorwise_current", "tensorwise_delayed", "rowwise"):
        runs = []
        for sp in (True, False):
            xi = (x.chunk(world)[rank] if sp else x).clone().requires_grad_(True)
            wi = w.clone().requires_grad_(True)
            saved, wire = [], []

            def pack(t, saved=saved):
                saved.append((tuple(t.shape), t.dtype))
                return t

            def gather(out, t, group=None, wire=wire):  # the real all-gather, its input noted
                wire.append((tuple(t.shape), t.dtype))
                return real_gather(out, t, group=group)

            linear = FP8LinearTorch(FP8Config(recipe=recipe))
            dist.all_gather_into_tensor = gather
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = linear(xi, wi, sp_group=dist.group.WORLD if sp else None)
            finally:
                dist.all_gather_into_tensor = real_gather
            y.backward(dy)
            amax = linear.input_state.amax() if recipe == "tensorwise_delayed" else None
            runs.append((y.detach(), xi.grad, wi.grad, saved, wire, amax))
        out[recipe] = runs
    return out


def test_torch_backend_gathers_a_sequence_parallel_input_and_keeps_its_own_rows():
    """Each rank quantizes its 12 of the 24 token rows (6 positions x batch 2) with the whole sequence's
    scales and the forward all-gathers FP8 codes (bytes), plus the row scales under rowwise,
    never the bf16 input. Both ranks hold the same weight and output gradient, so the
    reduce-scattered input gradient is twice this rank's rows of the whole sequence's (an exact
    doubling); output and wgrad are the whole-sequence linear's bit for bit (the same codes);
    delayed scaling records the whole sequence's amax. For its backward the SP linear keeps this
    rank's rows: FP8 codes under tensorwise scaling, the bf16 input under rowwise."""
    for rank, got in enumerate(run_distributed(_sp_linear_body, world_size=2)):
        for recipe, (sp_run, ref_run) in got.items():
            y, dx, dw, saved, wire, amax = sp_run
            y_ref, dx_ref, dw_ref, saved_ref, wire_ref, amax_ref = ref_run
            assert torch.equal(y, y_ref) and torch.equal(dw, dw_ref), recipe
            assert torch.equal(dx, 2 * dx_ref.chunk(2)[rank]), recipe
            assert amax is None or torch.equal(amax, amax_ref), recipe
            assert wire_ref == [], wire_ref  # no gather without SP
            assert wire[0] == ((12, 64), torch.uint8), (recipe, wire)
            if recipe == "rowwise":
                assert wire[1:] == [((12, 1), torch.float32)], wire
                kept, whole = torch.bfloat16, (24, 64)
            else:  # the whole sequence's codes, rows padded to 16
                assert wire[1:] == [], wire
                kept, whole = torch.float8_e4m3fn, (32, 64)
            assert ((12, 64), kept) in saved and (whole, kept) not in saved, saved
            assert (whole, kept) in saved_ref, saved_ref


def _saved_bytes_body(rank, world):
    """Bytes the actor's first layer saves for its backward with the torch backend's linears
    (real FP8 codes on the CPU), rowwise vs tensorwise, and what the planner predicts."""

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch
    from megatron_rl_fp8.models.fp8 import emulated_linears
    from megatron_rl_fp8.plan.measure import FirstLayerSaved
    from megatron_rl_fp8.plan.model_bytes import layer_activation_bytes

    ids = torch.randint(4, 53, (4, 16), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(4, 16)}
    out = {}
    for recipe in ("rowwise", "tensorwise_current"):
        actor, _ = _actor(dict(recipe=recipe))
        gemms = [gemm for name, _, gemm in emulated_linears(actor.module)]
        for gemm in gemms:
            gemm.emulator = FP8LinearTorch(actor.fp8)
        saved = FirstLayerSaved(actor.module)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            actor.train_step(batch, 4, lambda mb, lp: (-(lp * mb["loss_mask"]).sum() / 64, {}))
        out[recipe] = saved.nbytes
        kw = dict(a=4, tp=1, sequence_parallel=False, seq=16, spec="local", fused_swiglu=False)
        out["predicted " + recipe] = 64 * layer_activation_bytes(
            actor.model_cfg, **kw, fp8_inputs=recipe == "tensorwise_current"
        )
        parallel.destroy()
    return out


def test_torch_backend_tensorwise_keeps_one_byte_per_linear_input_as_planned():
    """The planner's ``fp8_inputs`` term against the real actor (fp32 on the CPU, 64 tokens):
    under tensorwise scaling the torch backend's four linears of a layer keep their inputs as
    FP8 codes and nothing else keeps them, so the layer saves 3 bytes less per element of the
    QKV, FC1, projection and FC2 inputs than under rowwise (which keeps them in fp32), less the
    tensorwise weight codes it saves instead of referencing the weights (147456 bytes: QKV
    256 x 128, projection 128 x 128, FC1 512 x 128, FC2 128 x 256) and its eight 4-byte scales."""
    (got,) = run_distributed(_saved_bytes_body, world_size=1)
    weight_codes = 256 * 128 + 128 * 128 + 512 * 128 + 128 * 256 + 8 * 4
    measured = got["rowwise"] - (got["tensorwise_current"] - weight_codes)
    predicted = got["predicted rowwise"] - got["predicted tensorwise_current"]
    assert predicted == 64 * 3 * (2 * 128 + 128 + 256)
    assert measured == predicted


def _same(a, b) -> bool:
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))


def _frozen_scaling_body(rank, world):
    import copy

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.fp8 import fp8_scaling_state

    actor, _ = _actor(dict(recipe="tensorwise_delayed"))
    lin = actor.module.decoder.layers[0].mlp.linear_fc1
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(6, 2, 128, generator=gen), 4 * torch.randn(6, 2, 128, generator=gen)
    with torch.no_grad():
        lin(small)  # the history now holds the small input's amax
        # Copies: the state holds the live histories, which the passes write in place.
        before = copy.deepcopy(fp8_scaling_state(actor.module))
        with actor.frozen_fp8_scaling():
            y_calibration, _ = lin(large)
        after = copy.deepcopy(fp8_scaling_state(actor.module))
        y_update, _ = lin(large)  # the pass that follows sees the same scales
        y_next, _ = lin(large)  # this one the large input's amax (recorded by y_update's pass)
    same_state = all(
        after[n][r]["num_updates"] == before[n][r]["num_updates"]
        and _same(after[n][r]["history"], before[n][r]["history"])
        for n in before
        for r in before[n]
    )
    parallel.destroy()
    return same_state, torch.equal(y_calibration, y_update), torch.equal(y_update, y_next)


def test_frozen_fp8_scaling_leaves_the_delayed_histories_and_the_next_pass_alone():
    same_state, calibration_is_update, update_is_next = run_distributed(
        _frozen_scaling_body, world_size=1
    )[0]
    assert same_state and calibration_is_update
    assert not update_is_next  # unfrozen, a pass moves the next one's scales


def _step_scaling_body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.fp8 import fp8_scaling_state, step_fp8_scaling

    actor, _ = _actor(dict(recipe="tensorwise_delayed"))
    lin = actor.module.decoder.layers[0].mlp.linear_fc1
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(6, 2, 128, generator=gen), 4 * torch.randn(6, 2, 128, generator=gen)
    updates = lambda: fp8_scaling_state(actor.module)["decoder.layers.0.mlp.linear_fc1"]["input"][  # noqa: E731
        "num_updates"
    ]
    with torch.no_grad():
        lin(small)  # the history holds the small input's amax
        n0 = updates()
        with step_fp8_scaling(actor.module):
            y_old, _ = lin(large)  # the step's old-logprob pass
            y_new, _ = lin(large)  # its update: the same scales, although y_old recorded more
        recorded = updates() - n0
        y_next, _ = lin(large)  # the next step: scales from the history, large amax included
    parallel.destroy()
    return torch.equal(y_old, y_new), recorded, torch.equal(y_new, y_next)


def test_step_fp8_scaling_keeps_the_steps_scales_and_records_its_amaxes():
    """``fp8.scales_per_step``: inside one step two passes over the same input quantize alike
    (unpinned, the first pass's amax moves the second's scale: the frozen test above), the
    amaxes still enter the history, and the step after takes the scales they make."""
    step_is_one_scale, recorded, next_moved = run_distributed(_step_scaling_body, world_size=1)[0]
    assert step_is_one_scale
    assert recorded == 2
    assert not next_moved
