"""The SGLang engines' client side without a server: config validation, the launch command,
request building, answer parsing (version checks), the transports' bucket layouts and their
refusals, the fault injection hook, and the guard that keeps a server from outliving its
trainer."""

import contextlib
import subprocess
import sys
import time

import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout import build_engine
from megatron_rl_fp8.rollout.config import RolloutConfig
from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone, SyncFailed
from megatron_rl_fp8.rollout.sglang import (
    FAULT_ENV,
    KillServerAt,
    SGLangFleet,
    parse_completion,
    parse_fault_spec,
    sampling_params,
    server_command,
    server_group_pids,
)
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.transports import flatten_per_dtype


def test_config_defaults_and_overrides():
    cfg = load_config(
        None,
        [
            "rollout.engine=sglang",
            "rollout.sglang.transport=distributed",
            "rollout.sglang.bucket_mb=64",
            "rollout.sglang.tp_size=2",
        ],
    )
    s = cfg.rollout.sglang
    assert cfg.rollout.engine == "sglang"
    assert (s.transport, s.bucket_mb, s.tp_size, s.max_restarts) == ("distributed", 64.0, 2, 2)
    assert SGLangConfig().transport == "distributed"
    assert load_config(None, []).rollout.engine == "local"


@pytest.mark.parametrize(
    "override, match",
    [
        ("rollout.engine=vllm", "rollout.engine"),
        ("rollout.sglang.transport=nccl", "transport"),
        ("rollout.sglang.transport=disk", "transport"),
        ("rollout.sglang.bucket_mb=0", "bucket_mb"),
        ("rollout.sglang.tp_size=0", "tp_size"),
        ("rollout.sglang.mem_fraction_static=1.5", "mem_fraction_static"),
        ("rollout.sglang.max_restarts=-1", "max_restarts"),
        ("rollout.sglang.request_timeout_s=0", "request_timeout_s"),
        ("rollout.sglang.port=70000", "port"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(override, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(None, [override])


def test_extra_args_may_not_override_engine_owned_flags():
    with pytest.raises(ValueError, match="--port"):
        SGLangConfig(extra_args=["--port", "1234"])
    SGLangConfig(extra_args=["--log-level", "warning"])


def test_server_command_cpu_and_gpu():
    cfg = SGLangConfig(tp_size=2, extra_args=["--log-level", "warning"])
    cpu = server_command(
        cfg,
        python="/py",
        model_path="/m",
        port=31000,
        device="cpu",
        dtype="float32",
        fp8_checkpoint=False,
        weight_version="3",
    )
    assert cpu[:3] == ["/py", "-m", "sglang.launch_server"]
    flags = dict(zip(cpu[3::1], cpu[4::1]))
    assert flags["--model-path"] == "/m" and flags["--port"] == "31000"
    assert flags["--tp-size"] == "2" and flags["--weight-version"] == "3"
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    assert flags["--mem-fraction-static"] == "0.05"
    assert "--skip-tokenizer-init" in cpu and "--quantization" not in cpu
    assert cpu[-2:] == ["--log-level", "warning"]
    gpu = server_command(
        SGLangConfig(),
        python="/py",
        model_path="/m",
        port=1,
        device="cuda",
        dtype="bfloat16",
        fp8_checkpoint=True,
        weight_version="0",
    )
    assert "--device" not in gpu and "--mem-fraction-static" not in gpu
    assert gpu[gpu.index("--quantization") + 1] == "fp8"


def test_sampling_params_greedy_and_sampled():
    g = sampling_params(
        max_new_tokens=5, temperature=0.7, top_p=0.9, greedy=True, eos_token_id=2, seed=11
    )
    assert g["temperature"] == 0.0 and g["top_p"] == 1.0 and "sampling_seed" not in g
    s = sampling_params(
        max_new_tokens=5, temperature=0.7, top_p=0.9, greedy=False, eos_token_id=2, seed=11
    )
    assert (s["temperature"], s["top_p"], s["sampling_seed"]) == (0.7, 0.9, 11)
    assert s["stop_token_ids"] == [2] and s["max_new_tokens"] == 5 and s["top_k"] == -1


def _answer(ids, lps, version="4", spans=None):
    return {
        "output_ids": ids,
        "meta_info": {
            "weight_version": version,
            "weight_versions": spans
            if spans is not None
            else [{"version": version, "start": 0, "end": len(ids)}],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
        },
    }


def test_parse_completion_checks_version_and_alignment():
    c = parse_completion(
        [1, 5], _answer([7, 8, 2], [-0.1, -0.2, -0.3]), eos_token_id=2, expected_version="4"
    )
    assert c.prompt_ids == [1, 5] and c.response_ids == [7, 8, 2] and c.finished
    assert c.response_logprobs == [-0.1, -0.2, -0.3]
    trunc = parse_completion(
        [1], _answer([7, 8], [-0.1, -0.2]), eos_token_id=2, expected_version="4"
    )
    assert not trunc.finished
    with pytest.raises(ServerGone, match="expected '5'"):
        parse_completion([1], _answer([7], [-0.1]), eos_token_id=2, expected_version="5")
    mixed = _answer([7, 8], [-0.1, -0.2], spans=[{"version": "3"}, {"version": "4"}])
    with pytest.raises(ServerGone, match="version"):  # a half-synced server is never accepted
        parse_completion([1], mixed, eos_token_id=2, expected_version="4")
    bad = _answer([7, 8], [-0.1, -0.2])
    bad["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(RolloutEngineError, match="line up"):
        parse_completion([1], bad, eos_token_id=2, expected_version="4")


def test_flatten_copies_into_one_buffer_per_dtype():
    a, b, c = torch.randn(3, 4), torch.randn(5), torch.ones(2, 2, dtype=torch.bfloat16)
    flat = flatten_per_dtype([("a", a.t()), ("b", b), ("c", c)])
    assert [n for n, _ in flat] == ["a", "b", "c"]
    assert torch.equal(flat[0][1], a.t()) and torch.equal(flat[1][1], b)
    assert torch.equal(flat[2][1], c)
    ptr = flat[0][1].untyped_storage().data_ptr()
    assert flat[1][1].untyped_storage().data_ptr() == ptr  # same buffer for one dtype
    assert ptr != a.untyped_storage().data_ptr()  # never the caller's storage


def test_missing_server_python_names_the_field_and_the_fix(tmp_path):
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.hf_mapping import hf_config

    cfg = RolloutConfig(
        engine="sglang",
        sglang=SGLangConfig(python=str(tmp_path / "nope"), work_dir=str(tmp_path / "w")),
    )
    with pytest.raises(FileNotFoundError, match="rollout.sglang.python.*install_sglang_cpu"):
        build_engine(cfg, hf_config(ModelConfig(vocab_size=53)), pad_token_id=0, eos_token_id=2)


# -- fault injection, process lifetime (no SGLang needed: the guard runs any command) -----------


def test_fault_spec_parses_points_and_occurrences_and_names_the_variable_on_error():
    assert parse_fault_spec("push@3, generate,push") == {"push": {1, 3}, "generate": {1}}
    assert parse_fault_spec("") == {}
    for bad in ("push@0", "pushh", "push@x", "generate@-1"):
        with pytest.raises(ValueError, match=f"{FAULT_ENV}.*begin_update"):
            parse_fault_spec(bad)


def test_kill_server_at_counts_occurrences_per_point():
    class Engine:
        kills = 0

        def kill_server(self):
            self.kills += 1

    eng = Engine()
    hook = KillServerAt(eng, "push@2,generate")
    for point in ("push", "generate", "push", "push", "generate", "check_version"):
        hook(point)
    assert hook.fired == ["generate@1", "push@2"] and eng.kills == 2


def _attached(tmp_path, **kw) -> SGLangFleet:
    """A fleet attached to one engine URL where nothing listens: building it launches and calls
    nothing (no SGLang python needed)."""
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.hf_mapping import hf_config
    from megatron_rl_fp8.rollout.sglang.process import pick_port

    cfg = RolloutConfig(
        engine="sglang",
        sglang=SGLangConfig(
            python=str(tmp_path / "none"),
            engine_urls=[f"http://127.0.0.1:{pick_port()}"],
            work_dir=str(tmp_path),
            **kw,
        ),
    )
    return SGLangFleet(cfg, hf_config(ModelConfig(vocab_size=53)), pad_token_id=0, eos_token_id=2)


def test_fault_env_installs_the_hook_once_and_unset_costs_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert _attached(tmp_path).fault_hook is None
    monkeypatch.setenv(FAULT_ENV, "begin_update@2")
    hook = _attached(tmp_path).fault_hook
    assert isinstance(hook, KillServerAt) and hook.plan == {"begin_update": {2}}
    monkeypatch.setenv(FAULT_ENV, "nowhere")
    with pytest.raises(ValueError, match=FAULT_ENV):
        _attached(tmp_path)


def test_weight_group_fails_fast_when_the_engine_is_gone(tmp_path):
    # The private group's rendezvous waits up to the timeout for the engines to join; a dead
    # engine must be noticed from the refused HTTP call instead, and the sender says so.
    from megatron_rl_fp8.parallel import free_port
    from megatron_rl_fp8.rollout.sglang import SGLangSyncPlan, WeightSender
    from megatron_rl_fp8.sync.buckets import Bucket

    plan = SGLangSyncPlan(
        version=0,
        engines=[(f"http://127.0.0.1:{free_port()}", 1)],  # nothing listens there
        device="cpu",
        timeout=20,  # twice the bound below; the abandoned rendezvous lingers this long
        export_options={},
        failed=[],
    )
    t0 = time.monotonic()
    bucket = Bucket(0, [("w", torch.zeros(2))])
    error = WeightSender().push(plan, [bucket, bucket])
    assert "could not start" in error and "init_weights_update_group" in error
    assert time.monotonic() - t0 < 10


def test_a_relaunched_engine_at_the_same_url_gets_a_new_weight_group():
    # SG-11 (issue 43 #4): an engine relaunched (or rejoined) at the same URL is a new process
    # with no weight-update group; reusing the old group's name would broadcast to dead ranks.
    # The group is keyed on each engine's process generation as well as its URL.
    import dataclasses

    from megatron_rl_fp8.parallel import free_port
    from megatron_rl_fp8.rollout.sglang import SGLangSyncPlan, WeightSender
    from megatron_rl_fp8.rollout.sglang.transports import new_sender_group
    from megatron_rl_fp8.sync.buckets import Bucket

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: any call to the engine fails
    plan = SGLangSyncPlan(
        version=0,
        engines=[(url, 1)],
        device="cpu",
        timeout=5,  # the abandoned rendezvous below times out in its thread after this
        export_options={},
        failed=[],
        generations=[1],
    )
    sender = WeightSender()
    name = f"mrf8_test_{free_port()}"
    sender._group = (
        new_sender_group("127.0.0.1", free_port(), 1, name, "gloo", timeout_s=30),
        name,
    )
    sender._key = plan.group_key
    assert sender._ensure_group(plan) is sender._group  # same engines, same processes: reused
    relaunched = dataclasses.replace(plan, generations=[2])
    assert relaunched.group_key != plan.group_key
    error = WeightSender.push(sender, relaunched, [Bucket(0, [("w", torch.zeros(2))])])
    assert "could not start" in error and "init_weights_update_group" in error  # asked anew
    assert sender._group is None
    assert plan.on_node("n") is plan  # no nodes: the whole plan
    per_node = dataclasses.replace(plan, engine_nodes=["n"], generations=[7])
    assert per_node.on_node("n").generations == [7] and per_node.on_node("m").generations == []


EXIT_DURING_RENDEZVOUS = """
import contextlib, sys, time
from megatron_rl_fp8.parallel import free_port
from megatron_rl_fp8.rollout.errors import RolloutEngineError
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.transports import join_sender_group

timeout = float(sys.argv[1])
t0 = time.monotonic()
engine = Http(f"http://127.0.0.1:{free_port()}")  # nothing listens: the engine is gone
with contextlib.suppress(RolloutEngineError):  # refused at once: the engine is gone
    join_sender_group([(engine, 1)], host="127.0.0.1", device="cpu", name="g", timeout=timeout)
time.sleep(max(timeout - 0.4 - (time.monotonic() - t0), 0))  # exit as the rendezvous times out
"""


def test_exiting_while_an_abandoned_weight_group_times_out_is_a_clean_exit():
    # CI once ended in SIGABRT ("terminate called without an active exception") after every test
    # passed: join_sender_group leaves our side of the rendezvous to time out in its thread when
    # an engine is gone, and a daemon thread whose c10d store wait times out while the
    # interpreter finalizes aborts the process. The exit now waits for the thread.
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_RENDEZVOUS, "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    assert time.monotonic() - t0 >= 3  # it waited for the rendezvous to time out


def test_tensor_transport_refuses_engines_on_another_host():
    from megatron_rl_fp8.rollout.sglang import SGLangSyncPlan, WeightSender
    from megatron_rl_fp8.rollout.sglang.sender import on_this_host
    from megatron_rl_fp8.sync.buckets import Bucket

    assert on_this_host("http://127.0.0.1:1") and on_this_host("http://localhost:1")
    assert not on_this_host("http://192.0.2.1:30000")  # TEST-NET-1: never this host
    plan = SGLangSyncPlan(
        version=0,
        engines=[("http://192.0.2.1:30000", 1)],
        device="cpu",
        timeout=5,
        export_options={},
        failed=[],
        transport="tensor",
    )
    error = WeightSender().push(plan, [Bucket(0, [("w", torch.zeros(2))])])
    assert "not on this host" in error and "transport=distributed" in error


def test_tensor_transport_hands_every_engine_one_buffer(monkeypatch):
    # NC-5 (issue 43 #5): every engine of a sync (and every TP rank) opens the same buffers of a
    # bucket, made once, never the trainer's own memory; a relay's received bucket, made for
    # handing over, goes as it is (before: one copy per engine of every bucket).
    from megatron_rl_fp8.rollout.sglang import SGLangSyncPlan, WeightSender, sender
    from megatron_rl_fp8.sync.buckets import Bucket

    seen = []

    def push_tensor(http, named, *, tp_size, timeout):
        seen.append((http.base_url, tp_size, [t.untyped_storage().data_ptr() for _, t in named]))
        return 0.0

    monkeypatch.setattr(sender, "push_tensor", push_tensor)
    strategy = torch.multiprocessing.get_sharing_strategy()
    monkeypatch.setattr(
        torch.multiprocessing, "set_sharing_strategy", lambda s: None
    )  # the CPU path's switch is process-wide; this test hands nothing to another process
    plan = SGLangSyncPlan(
        version=0,
        engines=[("http://127.0.0.1:1", 1), ("http://127.0.0.1:2", 2)],
        device="cpu",
        timeout=5,
        export_options={},
        failed=[],
        transport="tensor",
    )
    w, b = torch.randn(4, 4), torch.randn(4).to(torch.bfloat16)
    assert WeightSender().push(plan, [Bucket(0, [("w", w), ("b", b)])]) is None
    assert sorted((url, tp) for url, tp, _ in seen) == [
        ("http://127.0.0.1:1", 1),
        ("http://127.0.0.1:2", 2),
    ]
    (ptrs,) = {tuple(p) for _, _, p in seen}  # one set of buffers for both engines
    assert len(set(ptrs)) == 2  # one per dtype
    assert not {w.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()} & set(ptrs)
    seen.clear()
    buf = torch.zeros(64, dtype=torch.uint8)
    relayed = Bucket(
        1,
        [("w", buf[:16].view(torch.float32)), ("b", buf[16:24].view(torch.bfloat16))],
        handover=True,
    )
    assert WeightSender().push(plan, [relayed]) is None
    assert [p for _, _, p in seen] == [[buf.untyped_storage().data_ptr()] * 2] * 2
    assert torch.multiprocessing.get_sharing_strategy() == strategy


def test_a_hung_server_counts_as_gone():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts, never answers
        port = listener.getsockname()[1]
        with pytest.raises(ServerGone, match="no answer within 0.5 s"):
            Http(f"http://127.0.0.1:{port}").call("/generate", {}, timeout=0.5)


class _KeepAliveServer:
    """A local HTTP/1.1 server that keeps connections alive, like SGLang's, counting the
    connections its clients open; stop() closes it and every connection it holds."""

    def __init__(self, port: int = 0):
        import http.server
        import socketserver
        import threading

        self.connections = 0
        self.sockets = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                outer.connections += 1
                outer.sockets.append(self.connection)

            def do_GET(self):
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                """No request log: the test's output is pytest's."""

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True  # this server's class only, not every ThreadingTCPServer

        self.server = Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """As a killed process: the listener and every open connection closed."""
        import socket

        self.server.shutdown()
        self.server.server_close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_the_client_keeps_connections_alive_and_replaces_idle_ones(monkeypatch):
    from megatron_rl_fp8.rollout.sglang import http

    monkeypatch.setattr(http, "MAX_IDLE_S", 0.3)
    server = _KeepAliveServer()
    try:
        for _ in range(5):  # back to back, also from new Http objects: one pooled connection
            assert Http(server.url).call("/health", timeout=5) == {"ok": True}
        assert server.connections == 1
        time.sleep(0.5)  # idle past MAX_IDLE_S: not reused (a server may be closing it)
        assert Http(server.url).call("/health", timeout=5) == {"ok": True}
        assert server.connections == 2
    finally:
        server.stop()


def test_a_pooled_connection_to_a_dead_server_is_one_line_and_a_relaunch_is_reached():
    """The pooled client's answer to an engine that died and came back at the same URL: the
    dead one is ServerGone in one line (as the per-request client's was), the new one is used."""
    server = _KeepAliveServer()
    port = int(server.url.rsplit(":", 1)[1])
    Http(server.url).call("/health", timeout=5)
    server.stop()
    with pytest.raises(ServerGone, match=r"^/health: .*Connection refused") as e:
        Http(server.url).call("/health", timeout=5)
    assert "\n" not in str(e.value)
    relaunched = _KeepAliveServer(port)
    try:
        assert Http(relaunched.url).call("/health", timeout=5) == {"ok": True}
    finally:
        relaunched.stop()


# A stand-in server: its main process starts a grandchild that, like SGLang's scheduler during
# its imports, has no parent-death signal, then sleeps argv[1] seconds and exits with code 3.
_TREE = (
    "import subprocess, sys, time; subprocess.Popen(['sleep', '600']); "
    "time.sleep(float(sys.argv[1])); sys.exit(3)"
)
# A trainer: launches the tree through spawn_guarded (from a thread that then ends, when asked:
# PR_SET_PDEATHSIG fires on that thread's exit too, which the guard must ignore), prints the
# group id, then waits to be killed.
_TRAINER = """
import sys, threading, time
from megatron_rl_fp8.rollout.sglang import spawn_guarded
box = []
def launch():
    box.append(spawn_guarded([sys.executable, '-c', sys.argv[1], sys.argv[2]],
                             python=sys.executable, stdout=sys.stderr))
if sys.argv[3] == 'thread':
    t = threading.Thread(target=launch); t.start(); t.join()
else:
    launch()
print(box[0].pid, flush=True)
time.sleep(600)
"""


def _start_trainer(server_seconds: float, launch_from: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, _TREE, str(server_seconds), launch_from],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    return proc, int(proc.stdout.readline())


def _wait_gone(pgid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while server_group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return server_group_pids(pgid)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_server_group_dies_with_a_sigkilled_trainer_even_launched_from_an_ended_thread():
    trainer, pgid = _start_trainer(600, "thread")
    try:
        deadline = time.monotonic() + 10
        while len(server_group_pids(pgid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # guard, stand-in server, its grandchild
        time.sleep(1.5)  # past the guard's first parent check: the ended thread did not kill it
        assert len(server_group_pids(pgid)) == 3
        trainer.kill()
        trainer.wait()
        assert _wait_gone(pgid, 5) == []
    finally:
        trainer.kill()
        _kill_pg(pgid)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_server_group_dies_when_the_server_main_process_exits():
    trainer, pgid = _start_trainer(1, "main")
    try:
        assert _wait_gone(pgid, 10) == []  # the grandchild too, although it ignores its parent
    finally:
        trainer.kill()
        trainer.wait()
        _kill_pg(pgid)


def _kill_pg(pgid):
    import os
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_export_options_tell_the_export_path_how_to_send_weights(tmp_path):
    # No server needed: the options come from the config and the device.
    fleet = _attached(tmp_path, bucket_mb=64)
    assert fleet.export_options == {"bucket_mb": 64, "dequantize_to": torch.float32}


# -- the fleet's pieces without a server -----------------------------------------------------------
@pytest.mark.parametrize(
    "override, match",
    [
        ("rollout.sglang.num_engines=-1", "num_engines"),
        ("rollout.sglang.router_url=http://127.0.0.1:1", "engine_urls is empty"),
        ("rollout.sglang.engine_urls=[localhost:3000]", "not an http://host:port URL"),
        (
            "rollout.sglang.engine_urls=[http://a:1,http://b:2]",
            None,  # with num_engines=3 below
        ),
        ("rollout.placement=colocated", "is not a placement rollout.engine=local runs with"),
        ("rollout.placement=everywhere", "rollout.placement"),
        ("rollout.sglang.router_policy=nearest", "router_policy"),
    ],
)
def test_fleet_config_rejects_bad_values_naming_the_field(override, match):
    overrides = [override]
    if match is None:
        overrides.append("rollout.sglang.num_engines=3")
        match = "num_engines=3 but 2 engine_urls"
    elif "placement" not in override:
        overrides.append("rollout.engine=sglang")
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_placeholder_launch_and_router_commands():
    from megatron_rl_fp8.rollout.sglang import router_command

    cmd = server_command(
        SGLangConfig(),
        python="/py",
        model_path="/m",
        port=1,
        device="cuda",
        dtype="bfloat16",
        fp8_checkpoint=True,
        weight_version="-1",
        placeholder_weights=True,
        base_gpu_id=4,
    )
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    assert flags["--load-format"] == "dummy" and flags["--base-gpu-id"] == "4"
    assert "--enable-metrics" in cmd and flags["--quantization"] == "fp8"
    cpu = server_command(
        SGLangConfig(),
        python="/py",
        model_path="/m",
        port=1,
        device="cpu",
        dtype="float32",
        fp8_checkpoint=False,
        weight_version="0",
        base_gpu_id=4,
    )
    assert "--base-gpu-id" not in cpu and "--load-format" not in cpu
    r = router_command(
        SGLangConfig(router_policy="cache_aware"),
        python="/py",
        port=7,
        worker_urls=["http://a:1", "http://b:2"],
        metrics_port=9,
    )
    assert r[:3] == ["/py", "-m", "sglang_router.launch_router"]
    assert r[r.index("--policy") + 1] == "cache_aware" and r[r.index("--port") + 1] == "7"
    assert r[r.index("--prometheus-port") + 1] == "9"
    assert r[r.index("--worker-urls") + 1 :] == ["http://a:1", "http://b:2"]


def test_row_requests_keep_the_batch_seeds():
    from megatron_rl_fp8.rollout.sglang.http import generate_request, row_requests

    kw = dict(max_new_tokens=4, temperature=0.7, top_p=1.0, greedy=False, seed=5, eos_token_id=2)
    rows = [[1, 2], [1, 2], [3]]
    batch = generate_request(rows, **kw)
    single = row_requests(rows, **kw)
    assert [r["input_ids"] for r in single] == rows
    assert [r["sampling_params"] for r in single] == batch["sampling_params"]
    assert len({p["sampling_seed"] for p in batch["sampling_params"]}) == 3
    assert all(r["return_logprob"] for r in single)


def test_broadcast_buffer_is_aligned_and_round_trips():
    from megatron_rl_fp8.rollout.sglang.transports import flatten_for_broadcast

    named = [
        ("codes", torch.randint(0, 255, (3, 5), dtype=torch.uint8).view(torch.float8_e4m3fn)),
        ("scale", torch.rand(1, 1)),
        ("norm", torch.randn(7, dtype=torch.bfloat16)),
        ("w", torch.randn(4, 3).t()),  # not contiguous
    ]
    ordered, flat = flatten_for_broadcast(named)
    assert [n for n, _ in ordered] == ["scale", "w", "norm", "codes"]  # widest first, stable
    offset = 0
    for name, t in ordered:
        size = t.numel() * t.element_size()
        assert offset % t.element_size() == 0  # what SGLang's receiving bucket requires
        back = flat[offset : offset + size].view(t.dtype).view(t.shape)
        assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8)), name
        offset += size
    assert offset == flat.numel() and flat.dtype == torch.uint8


def test_attached_fleet_launches_nothing_and_drops_an_engine_that_is_gone(tmp_path):
    # Attach mode without any server: nothing is launched (no SGLang python needed), a rollout
    # before the first sync is refused, the first sync waits startup_timeout_s for the engine to
    # come up, a sync into a dead engine drops it (it cannot be relaunched) and asks for the sync
    # again, and with no engine left the next one says so.
    fleet = _attached(tmp_path, startup_timeout_s=1.5)
    try:
        assert fleet.router.url == "" and fleet.engines[0].proc is None
        with pytest.raises(RolloutEngineError, match="no synced weights"):
            fleet.generate([[1]], n=1, max_new_tokens=2, temperature=1.0)
        t0 = time.monotonic()
        with pytest.raises(SyncFailed, match="run again"):
            fleet.update_weights([], version=0)
        assert time.monotonic() - t0 >= 1.5  # waited for it to come up
        assert fleet.engines[0].url == ""  # dropped
        with pytest.raises(RolloutEngineError, match="no SGLang engine is up"):
            fleet.update_weights([], version=0)
    finally:
        fleet.shutdown()
