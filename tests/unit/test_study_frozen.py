"""A study's existing run is compared with its file field by field; a field the run's code did
not have yet counts as the value that code ran with (``field(before=...)``), not today's
default, so a default that changed behaviour as it came does not pass old runs as new ones."""

import pytest
import yaml

from megatron_rl_fp8.config_utils import ConfigError, describe_fields, to_dict
from megatron_rl_fp8.study.runner import RUN_CONFIG, load_study
from tests.unit.test_study_evidence import BASE, Path

DELAYED = {"fp8.recipe": "tensorwise_delayed"}


def test_before_is_the_default_unless_a_field_says_otherwise():
    from megatron_rl_fp8.config import load_config

    docs = {d.path: d for d in describe_fields(load_config(None))}
    assert docs["fp8.scales_per_step"].default == "auto"
    assert docs["fp8.scales_per_step"].before is False
    assert docs["optim.lr"].before == docs["optim.lr"].default


def _study_with_old_run(tmp_path, arm: dict) -> Path:
    """A study file of one arm and the run its older code froze: without
    ``fp8.scales_per_step``, as runs before 2026-12-07 were saved."""
    base = (Path(__file__).parents[2] / BASE).resolve()
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": str(base), "seeds": [1], "arms": {"fp8": arm}}))
    run = load_study(path).runs[0]
    frozen = to_dict(run.config)
    del frozen["fp8"]["scales_per_step"]
    run.path.mkdir(parents=True)
    (run.path / RUN_CONFIG).write_text(yaml.safe_dump(frozen))
    return path


def test_an_old_run_matches_a_file_that_pins_what_it_ran(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _study_with_old_run(tmp_path, {**DELAYED, "fp8.scales_per_step": False})
    run = load_study(path).runs[0]
    assert (run.path / RUN_CONFIG).is_file() and run.config.fp8.scales_per_step is False


def test_an_old_run_is_refused_under_todays_default(tmp_path, monkeypatch):
    """Held scales (``auto``) are not what the old run did: re-run it, or pin ``false``."""
    monkeypatch.chdir(tmp_path)
    path = _study_with_old_run(tmp_path, {**DELAYED, "fp8.scales_per_step": False})
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "arms": {"fp8": DELAYED}}))
    with pytest.raises(ConfigError, match=r"fp8.scales_per_step: '\(unset\)' -> 'auto'"):
        load_study(path)
