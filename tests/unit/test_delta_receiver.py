"""The delta receiver's wire (``rollout/receiver.py``): its address setting, the plan it rebuilds
from JSON (no pickle crosses the socket), the token, and the one-line errors of a sender whose
receiver is absent or refuses it."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.receiver import (
    TOKEN_ENV,
    ReceiverServer,
    RemoteReceiver,
    parse_address,
)
from megatron_rl_fp8.rollout.sglang.sender import SGLangSyncPlan


def _plan():
    return SGLangSyncPlan(
        version=3, export_options={"bucket_mb": 5.0, "dequantize_to": torch.float32},
        engines=[("http://127.0.0.1:1", 2)], device="cpu", timeout=3.0, failed=[],
        transport="tensor", engine_nodes=["n3"],
    )  # fmt: skip


def test_an_address_is_node_host_port():
    assert parse_address("n3=10.0.0.7:7100") == ("n3", "10.0.0.7", 7100)
    for bad in ("n3", "n3=10.0.0.7", "=h:1", "n3=h:port"):
        with pytest.raises(ValueError, match=r"rollout.delta_receivers: .* is not NODE=HOST:PORT"):
            parse_address(bad)


def test_the_config_names_what_is_wrong():
    with pytest.raises(ConfigError, match="needs rollout.delta_sync=true"):
        load_config(None, ["rollout.delta_receivers=[n3=h:1]"])
    with pytest.raises(ConfigError, match="is not NODE=HOST:PORT"):
        load_config(None, ["rollout.delta_sync=true", "rollout.delta_receivers=[h:1]"])
    with pytest.raises(ConfigError, match="delta_verify_every must be >= 0"):
        load_config(None, ["rollout.delta_verify_every=-1"])


def _serve(server: ReceiverServer, seen: list):
    server._handle, handle = (lambda conn: seen.append(handle(conn))), server._handle
    thread = threading.Thread(target=server.serve_one, daemon=True)
    thread.start()
    return thread


def test_a_receiver_with_another_token_refuses_in_one_line(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "secret")
    server = ReceiverServer("127.0.0.1", 0)
    thread = _serve(server, [])
    monkeypatch.setenv(TOKEN_ENV, "guess")
    remote = RemoteReceiver("n3", "127.0.0.1", server.port, stage=0, plan=_plan(), timeout=10)
    assert remote.version() is None
    thread.join(10)
    assert remote.error.startswith("node n3's delta receiver (127.0.0.1:")
    assert f"wrong {TOKEN_ENV}" in remote.error and "\n" not in remote.error
    server.sock.close()


def test_an_absent_receiver_fails_in_one_line_with_the_command():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = RemoteReceiver("n3", "127.0.0.1", port, stage=1, plan=_plan(), timeout=5)
    assert remote.version() is None
    remote.begin(1, None, verify=True)  # no-ops after the failure
    remote.end()
    assert "asking its version failed (ConnectionRefusedError" in remote.error
    assert f"`megatron-rl-fp8 receiver --port {port}` running on 127.0.0.1?" in remote.error


def test_the_plan_travels_as_json_and_comes_back_equal(monkeypatch):
    """An empty sync: the receiver rebuilds the plan (its dtype included) and pushes nothing."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    server = ReceiverServer("127.0.0.1", 0)
    got = []
    server.senders["SGLangSyncPlan"] = type(
        "Keeps", (), {"push": lambda self, plan, buckets: got.append((plan, list(buckets)))}
    )()
    thread = _serve(server, [])
    remote = RemoteReceiver("n3", "127.0.0.1", server.port, stage=0, plan=_plan(), timeout=10)
    assert remote.version() is None  # a fresh receiver holds nothing
    remote.begin(3, None, verify=True)
    remote.end()
    thread.join(10)
    assert remote.error is None
    assert got == [(_plan(), [])]
    assert server.receivers[0].version == 3
    server.sock.close()
