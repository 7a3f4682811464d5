"""The learning-rate schedule: Megatron's OptimizerParamScheduler as the actor builds it, checked
against the closed form (and a few values by hand); the ``optim.lr_*`` validation; and the actor's
contract: one scheduler step per applied optimizer step, ``set_lr`` pins the SFT lr, and
``reset_optimizer`` restarts the RL schedule at its step 0."""

import math

import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.trainer.config import OptimConfig
from megatron_rl_fp8.trainer.optimizer import build_opt_param_scheduler
from tests.dist_utils import run_distributed


def reference_lr(n: int, cfg: OptimConfig, decay_steps: int) -> float:
    """The lr of optimizer step ``n`` (0-based): linear warmup from 0, then constant, or cosine /
    linear from lr down to min_lr at ``decay_steps``, then min_lr."""
    w = cfg.lr_warmup_steps
    if w and n <= w:
        return cfg.lr * n / w
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    r = min((n - w) / (decay_steps - w), 1.0)
    coeff = 0.5 * (1 + math.cos(math.pi * r)) if cfg.lr_decay_style == "cosine" else 1 - r
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff


def scheduled_lrs(cfg: OptimConfig, decay_steps: int, n: int) -> list[float]:
    """The real scheduler on a real (one-parameter) optimizer: the lr of steps 0 .. n-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    sched = build_opt_param_scheduler(opt, cfg, decay_steps)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    return lrs


def test_warmup_cosine_by_hand():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine")
    c = math.cos(math.pi / 4)
    hand = [0.0, 0.5, 1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 0.1, 0.1]
    assert scheduled_lrs(cfg, 6, len(hand)) == pytest.approx(hand, abs=1e-12)


def test_warmup_linear_by_hand():
    cfg = OptimConfig(lr=1.0, min_lr=0.2, lr_warmup_steps=1, lr_decay_style="linear")
    hand = [0.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert scheduled_lrs(cfg, 5, len(hand)) == pytest.approx(hand, abs=1e-12)


@pytest.mark.parametrize("style", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("min_lr", [0.0, 2e-5])
def test_schedule_matches_closed_form(style, warmup, min_lr):
    cfg = OptimConfig(lr=3e-4, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_style=style)
    decay = cfg.resolved_lr_decay_steps(total_steps=10)
    assert decay == 10
    got = scheduled_lrs(cfg, decay, 14)  # past the end: stays at min_lr
    want = [reference_lr(n, cfg, decay) for n in range(14)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if style != "constant":
        assert got[10:] == [min_lr] * 4


def test_constant_without_warmup_is_the_plain_lr():
    # The default schedule changes nothing: every step uses optim.lr exactly.
    cfg = OptimConfig(lr=1e-4)
    assert scheduled_lrs(cfg, cfg.resolved_lr_decay_steps(None), 5) == [1e-4] * 5


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": float("nan")}, "lr must be a finite number"),
        ({"lr": float("inf")}, "lr must be a finite number"),
        ({"min_lr": float("nan")}, "min_lr must be a finite number"),
        ({"lr": 1e-4, "min_lr": 1e-3}, r"min_lr must be in \[0, lr=0.0001\]"),
        ({"min_lr": -1e-5}, "min_lr must be in"),
        ({"lr_warmup_steps": -1}, "lr_warmup_steps must be >= 0"),
        ({"lr_warmup_steps": 5, "lr_decay_steps": 5}, "lr_decay_steps=5 must be > lr_warmup"),
        ({"lr_decay_style": "exponential"}, "optim.lr_decay_style='exponential' is not valid"),
    ],
)
def test_bad_schedule_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_nan_lr_override_is_rejected():
    with pytest.raises(ConfigError, match=r"optim\.lr: expected a finite number, got nan"):
        load_config(None, ["optim.lr=.nan"])
    with pytest.raises(ConfigError, match=r"optim\.lr_decay_style: 'step' is not one of"):
        load_config(None, ["optim.lr_decay_style=step"])


def test_decay_steps_resolution():
    assert OptimConfig(lr_decay_steps=7).resolved_lr_decay_steps(100) == 7
    assert OptimConfig(lr_decay_style="cosine").resolved_lr_decay_steps(40) == 40
    # Constant never decays: no run length needed, only a horizon past the warmup.
    assert OptimConfig(lr_warmup_steps=4).resolved_lr_decay_steps(None) == 5
    with pytest.raises(ValueError, match="train.steps \\* train.updates_per_step"):
        OptimConfig(lr_decay_style="linear").resolved_lr_decay_steps(None)
    with pytest.raises(ValueError, match="optim.lr_warmup_steps=8 must end before the run's 8"):
        OptimConfig(lr_decay_style="cosine", lr_warmup_steps=8).resolved_lr_decay_steps(8)


# -- the actor --------------------------------------------------------------------------------


def _actor_body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    ids = torch.randint(0, 53, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(4, 10)}

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / 40.0, {}

    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style="cosine")
    # lr_decay_steps=None: the decay spans the run's total_steps optimizer steps.
    a = Actor(ModelConfig(vocab_size=53), cfg, g, total_steps=6)
    out = {"decay_steps": a.lr_decay_steps, "sft": [], "rl": []}
    a.set_lr(3e-3)  # the SFT warm start: a constant lr, the schedule paused
    for _ in range(3):
        out["sft"].append(a.lr)
        a.train_step(batch, 2, nll)
    a.reset_optimizer()  # RL begins: the schedule at its step 0
    for _ in range(4):
        out["rl"].append(a.lr)
        a.train_step(batch, 2, nll)
    state = a.lr_schedule_state_dict()
    b = Actor(ModelConfig(vocab_size=53), cfg, g, total_steps=6)
    b.load_lr_schedule_state_dict(state)
    out["resumed"] = [b.lr, a.lr]
    parallel.destroy()
    return out


def test_actor_steps_the_schedule_and_restarts_it_after_sft():
    (out,) = run_distributed(_actor_body, world_size=1)
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style="cosine")
    assert out["decay_steps"] == 6
    assert out["sft"] == [3e-3] * 3
    assert out["rl"] == pytest.approx([reference_lr(n, cfg, 6) for n in range(4)], rel=1e-12)
    assert out["resumed"][0] == out["resumed"][1] == pytest.approx(reference_lr(4, cfg, 6))


def test_sft_cosine_schedule_by_hand():
    """``sft.lr_schedule: cosine``: warmup reaches the peak at its last step, the decay ends at
    min_lr on the last SFT step, and the midpoint of the decay is halfway between them."""
    from megatron_rl_fp8.trainer.config import SFTConfig

    sft = SFTConfig(steps=11, lr=1e-3, lr_schedule="cosine", warmup_steps=2, min_lr=1e-4)
    lrs = [sft.lr_at(s) for s in range(11)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert lrs[2] == pytest.approx(1e-3)  # the decay's first step is the peak
    assert lrs[10] == pytest.approx(1e-4)  # and its last is min_lr
    assert lrs[6] == pytest.approx(5.5e-4)  # halfway through the decay (steps 2..10)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))
    constant = SFTConfig(steps=11, lr=1e-3)
    assert {constant.lr_at(s) for s in range(11)} == {1e-3}


@pytest.mark.parametrize(
    "override, field",
    [
        ("sft.lr_schedule=linear", "sft.lr_schedule"),
        ("sft.min_lr=1.0", "min_lr"),
        ("sft.warmup_steps=-1", "warmup_steps"),
    ],
)
def test_sft_schedule_validation(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config("examples/tiny_cpu.yaml", [override])
