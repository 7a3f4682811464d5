"""loss/upper_rules.py: the config's accepted values, help and error come from the registry."""

import pytest

from megatron_rl_fp8.loss.config import STRATEGIES, CalibConfig
from megatron_rl_fp8.loss.upper_rules import UPPER_RULES, rules_help, upper_rule


def test_the_config_takes_its_rules_from_the_registry():
    assert STRATEGIES == tuple(UPPER_RULES) == ("balance", "quantile", "shift", "lower_only")
    for name, rule in UPPER_RULES.items():
        assert f"'{name}' {rule.help}" in rules_help()
        assert CalibConfig(strategy=name).strategy == name
    with pytest.raises(ValueError, match="strategy='median'.*balance, quantile, shift, lower_only"):
        CalibConfig(strategy="median")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="'shift' is registered twice"):
        upper_rule("shift", help="again")(lambda x: 1.0)
    assert UPPER_RULES["shift"].help == "keeps the nominal log-width of the clip interval"
