"""The stability guard's decisions (pure: metrics in, events and actions out) and its config."""

from __future__ import annotations

import math

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.trainer.config import GuardConfig
from megatron_rl_fp8.trainer.guard import StabilityGuard, event_metrics, strongest

HEALTHY = {
    "train/loss": 0.1,
    "train/grad_norm": 0.5,
    "train/param_norm": 30.0,
    "train/entropy": 1.0,
    "rollout/reward_mean": 0.5,
    "rollout/garbled_frac": 0.0,
    "fp8/token_mult_prob_error": 1.01,
}


def _run(guard: StabilityGuard, steps: int, start: int = 1, **changes) -> None:
    for step in range(start, start + steps):
        assert guard.check(step, {**HEALTHY, **changes}) == []


def test_healthy_steps_fire_nothing_and_vouch_for_earlier_checkpoints():
    g = StabilityGuard(GuardConfig())
    _run(g, 2)
    g.saved(2)
    assert g.healthy_checkpoint is None  # step 2's policy is measured at step 3
    _run(g, 1, start=3)
    assert g.healthy_checkpoint == 2 and g.pending == []


def test_entropy_rise_over_the_window_minimum_rolls_back():
    g = StabilityGuard(GuardConfig(max_entropy_rise=1.0, window=3))
    for step, ent in enumerate([1.2, 0.9, 1.1], start=1):
        assert g.check(step, {**HEALTHY, "train/entropy": ent}) == []
    g.saved(3)
    # 1.85 - 0.9 = 0.95: within the limit; the window's minimum is the baseline.
    assert g.check(4, {**HEALTHY, "train/entropy": 1.85}) == []
    (event,) = g.check(5, {**HEALTHY, "train/entropy": 3.97})
    assert event.rule == "entropy" and event.action == "rollback"
    assert "rose 3.07 above the minimum 0.9" in event.evidence
    assert g.resolve([event]) == ("rollback", "")
    assert g.healthy_checkpoint == 3
    # A failing step does not enter the baseline or vouch for anything.
    assert max(g.entropy) == 1.85


def test_rollback_without_a_healthy_checkpoint_or_past_the_limit_stops():
    g = StabilityGuard(GuardConfig(max_rollbacks=1))
    _run(g, 1)
    (event,) = g.check(2, {**HEALTHY, "train/entropy": 9.0})
    action, why = g.resolve([event])
    assert action == "stop" and "no checkpoint has been verified healthy" in why
    g.saved(2)
    _run(g, 1, start=3)
    assert g.resolve([event]) == ("rollback", "")
    g.rolled_back(2)
    assert g.lr_scale == 0.5 and g.rollbacks == 1 and not g.entropy
    action, why = g.resolve([event])
    assert action == "stop" and "max_rollbacks=1" in why


def test_nonfinite_skips_then_rolls_back_and_overflowing_weights_roll_back_at_once():
    g = StabilityGuard(GuardConfig(max_consecutive_skips=2))
    for step in (1, 2):
        (e,) = g.check(step, {**HEALTHY, "train/loss": math.nan, "train/skipped_updates": 1.0})
        assert e.rule == "nonfinite" and e.action == "skip" and "train/loss=nan" in e.evidence
    (e,) = g.check(3, {**HEALTHY, "train/skipped_updates": 2.0})
    assert e.action == "rollback" and "3 skipped steps in a row" in e.evidence
    g2 = StabilityGuard(GuardConfig())
    (e,) = g2.check(1, {**HEALTHY, "train/param_norm": math.inf})
    assert e.action == "rollback" and "overflow" in e.evidence


def test_mismatch_reward_and_garbled_rules_and_the_strongest_action():
    cfg = GuardConfig(
        max_mismatch=1.2, reward_collapse_ratio=0.25, max_garbled_frac=0.5, on_garbled="stop"
    )
    g = StabilityGuard(cfg)
    _run(g, 3)
    events = g.check(
        4,
        {
            **HEALTHY,
            "fp8/token_mult_prob_error": 1.5,
            "rollout/reward_mean": 0.1,
            "rollout/garbled_frac": 0.9,
        },
    )
    assert [e.rule for e in events] == ["mismatch", "reward", "garbled"]
    assert [e.action for e in events] == ["recalibrate", "rollback", "stop"]
    assert strongest(events) == "stop"
    m = event_metrics(events, "stop")
    assert m["guard/events"] == 3 and m["guard/action/stop"] == 1 and m["guard/rule/reward"] == 1
    # NaN metrics fire the threshold rules (a comparison with NaN is never "within the limit").
    assert g.check(5, {**HEALTHY, "fp8/token_mult_prob_error": math.nan})[0].rule == "mismatch"


def test_disabled_guard_and_state_round_trip():
    assert StabilityGuard(GuardConfig(enabled=False)).check(1, {"train/loss": math.nan}) == []
    g = StabilityGuard(GuardConfig())
    _run(g, 2)
    g.saved(2)
    g.bf16_until = 7
    h = StabilityGuard(GuardConfig())
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() and h.bf16(7) and not h.bf16(8)


@pytest.mark.parametrize(
    "override, message",
    [
        ("guard.window=0", "guard.window must be >= 1"),
        (
            "guard.max_entropy_rise=.nan",
            "guard.max_entropy_rise: expected a finite number, got nan",
        ),
        ("guard.max_mismatch=0.9", "guard.max_mismatch must be > 1"),
        ("guard.on_entropy=skip", "on_entropy"),
        ("guard.rollback_lr_factor=2", "rollback_lr_factor must be in (0, 1]"),
    ],
)
def test_bad_guard_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_actions_that_need_fp8_are_refused_without_it():
    with pytest.raises(ConfigError, match="guard.on_mismatch=recalibrate needs FP8 training"):
        load_config(None, ["guard.max_mismatch=1.5"]).validate()
    with pytest.raises(ConfigError, match="action is bf16"):
        load_config(None, ["guard.on_entropy=bf16"]).validate()
    fp8 = load_config("examples/tiny_cpu_fp8.yaml", ["guard.max_mismatch=1.5"])
    assert fp8.validate() is fp8


NONFINITE = {**HEALTHY, "train/loss": math.nan, "train/param_norm": math.inf}


def test_a_checkpoint_non_finite_twice_right_after_loading_is_distrusted():
    """Issue 31.6: the weights go non-finite on the first step after a resume from the step 4
    checkpoint, and again after the rollback to it: it is not healthy, and the rollback goes
    further back (checkpoints from step 4 on are discarded)."""
    g = StabilityGuard(GuardConfig(max_rollbacks=3))
    _run(g, 4)
    g.saved(2)
    _run(g, 1, start=3)
    g.saved(4)
    assert g.healthy_checkpoint == 2
    g.loaded_from(4)  # a resume from step 4 (its own guard state: healthy 2, pending [4])
    (event,) = g.check(5, NONFINITE)
    # Once may be the update's fault (a learning rate raised on resume): the non-finite update
    # vouches for the policy it started from, as always.
    assert "right after loading" not in event.evidence and g.healthy_checkpoint == 4
    assert g.resolve([event]) == ("rollback", "") and g.first_suspect(5) == 5
    g.rolled_back(4)
    (event,) = g.check(5, NONFINITE)
    assert "the second time right after loading the step 4 checkpoint" in event.evidence
    assert "checkpoint_verify=full" in event.evidence
    assert g.distrusted == 4 and g.first_suspect(5) == 4  # step 4's checkpoint goes too
    h = StabilityGuard(GuardConfig())
    h.load_state_dict(g.state_dict())
    assert h.distrusted == 4
    # Rolled back to the step 2 checkpoint, the run trains healthy again: step 4's checkpoint
    # of the new trajectory is vouched for as usual.
    g.rolled_back(2)
    _run(g, 2, start=3)
    g.saved(4)
    _run(g, 1, start=5)
    assert g.healthy_checkpoint == 4 and g.distrusted is None


def test_a_finite_first_step_after_a_load_clears_the_suspicion():
    g = StabilityGuard(GuardConfig(max_rollbacks=3))
    _run(g, 2)
    g.saved(2)
    g.loaded_from(2)
    g.check(3, NONFINITE)
    g.rolled_back(2)
    _run(g, 1, start=3)  # the same checkpoint trains finite this time
    g.rolled_back(2)
    (event,) = g.check(3, NONFINITE)
    assert "right after loading" not in event.evidence and g.distrusted is None
