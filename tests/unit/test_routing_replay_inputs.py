"""Routing replay's inputs (issue 47, item 5): SGLang's routed experts as its answers carry them,
the batch's encoding of every row's routes, and the settings refused in one line."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.models.routing_replay import ROUTES
from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.rollout.errors import RolloutEngineError
from megatron_rl_fp8.rollout.sglang.answers import pack, unpack
from megatron_rl_fp8.rollout.sglang.http import generate_request, parse_completion
from megatron_rl_fp8.trainer.batch import build_rl_batch

MOE = ["model.num_experts=4", "model.moe_topk=2", "model.moe_ffn_hidden_size=64"]


def _answer(output_ids, routes: np.ndarray | None) -> dict:
    """A /generate answer as SGLang 0.5.23 writes it: routes are the base64 of the capturer's
    int32 [positions, layers, top-k] host buffer (DetokenizerManager._b64_encode_per_request)."""
    meta = {
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
    }
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(routes.astype(np.int32).tobytes()).decode()
    return {"output_ids": output_ids, "meta_info": meta}


def test_sglang_routes_are_parsed_per_position_layer_and_expert():
    routes = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 4  # prompt 3 + output 3, minus the last
    c = parse_completion(
        [1, 2, 3], _answer([7, 8, 9], routes), eos_token_id=2, expected_version="3",
        route_shape=(2, 2),
    )  # fmt: skip
    assert c.routed_experts.dtype == torch.int16
    assert torch.equal(c.routed_experts, torch.from_numpy(routes).to(torch.int16))
    back = unpack([1, 2, 3], pack(c))  # across the answer process
    assert torch.equal(back.routed_experts, c.routed_experts) and back.response_ids == [7, 8, 9]
    plain = parse_completion([1], _answer([7], None), eos_token_id=2, expected_version="3")
    assert plain.routed_experts is None
    assert generate_request([[1]], **_sampling(), return_routes=True)["return_routed_experts"]
    assert "return_routed_experts" not in generate_request([[1]], **_sampling())


def _sampling():
    return dict(max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False, seed=0, eos_token_id=2)


@pytest.mark.parametrize(
    "routes, message",
    [(None, "--enable-return-routed-experts"), (np.zeros(7), "not a whole number of positions")],
)
def test_bad_sglang_routes_are_one_line_engine_errors(routes, message):
    with pytest.raises(RolloutEngineError, match=message):
        parse_completion(
            [1], _answer([7], routes), eos_token_id=2, expected_version="3", route_shape=(2, 2)
        )


def test_the_batch_stores_each_rows_routes_as_expert_plus_one():
    def completion(prompt, response, routes):
        return Completion(prompt, response, [0.0] * len(response), True, routed_experts=routes)

    r1 = torch.tensor([[[0, 3]], [[1, 2]], [[3, 1]]], dtype=torch.int16)  # 3 positions, 1 layer
    rows = [completion([5, 6], [7, 8], r1), completion([5], [7], None)]
    batch = build_rl_batch(rows, torch.zeros(2), pad_id=0)
    got = batch[ROUTES]
    assert got.dtype == torch.uint8 and got.shape == (2, 4, 1, 2)
    assert torch.equal(got[0, :3], (r1 + 1).to(torch.uint8))
    assert not got[0, 3:].any() and not got[1].any()  # the last token, padding, no routes: free
    many = completion([5], [7], torch.tensor([[[300, 2]]], dtype=torch.int16))
    assert build_rl_batch([many], torch.zeros(1), pad_id=0)[ROUTES].dtype == torch.int32
    assert ROUTES not in build_rl_batch(rows[1:], torch.zeros(1), pad_id=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.routing_replay=measure"], "needs a mixture-of-experts model"),
        ([*MOE, "rollout.routing_replay=replay", "env.tools=calculator"], "multi-turn"),
        ([*MOE, "rollout.routing_replay=replay", "rollout.engine=sglang",
          "rollout.sglang.device=cpu"], "only from GPU servers"),
        (["rollout.routing_replay=on"], "quote the word"),
    ],
)  # fmt: skip
def test_routing_replay_settings_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides).validate(1, this_machine=False)
    assert "\n" not in str(e.value)
    load_config(None, [*MOE, "rollout.routing_replay=replay"]).validate(1, this_machine=False)
