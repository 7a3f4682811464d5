"""The rollout round in the answer process (rollout/sglang/answers.py, issue 43 #6): the same
completions and failures as the round in the trainer's threads, decoded outside the trainer's
process, and a dead helper costs one retried round. The engine here is a stdlib HTTP server
answering ``/generate`` in SGLang 0.5.23's format (the real engine: tests/sglang/test_engine.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl_fp8.rollout.sglang import answers
from megatron_rl_fp8.rollout.sglang.answers import AnswerProcess, answer_round

EOS = 2


def _answer(input_ids: list[int], version: str) -> dict:
    """A finished completion of 5 tokens after ``input_ids``, logprobs following the prompt."""
    ids = [(sum(input_ids) + k) % 40 + 3 for k in range(4)] + [EOS]
    logprobs = [[-0.25 - 0.01 * k - 1e-3 * len(input_ids), t, None] for k, t in enumerate(ids)]
    meta = {"weight_version": version, "output_token_logprobs": logprobs}
    return {"text": "", "output_ids": ids, "meta_info": meta}


@pytest.fixture
def engine():
    state = {"version": "1", "delay_s": 0.0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(state["delay_s"])
            out = json.dumps(_answer(body["input_ids"], state["version"])).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            """No access log on the test's stderr (the stdlib server writes one per request)."""

    class Server(ThreadingHTTPServer):
        # Teardown waits for every handler (the dead-helper test leaves one sleeping), so none
        # writes to stderr during a later test; a client that hung up is no error here.
        daemon_threads = False

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
REQUESTS = {i: {"input_ids": r, "sampling_params": {}} for i, r in enumerate(ROWS)}
KW = dict(timeout=30.0, eos_token_id=[EOS], expected_version="1")


def _fields(completions: dict) -> dict:
    return {
        i: (c.prompt_ids, c.response_ids, c.response_logprobs, c.finished)
        for i, c in completions.items()
    }


def test_the_answer_process_gives_the_threads_completions_decoded_outside(engine, monkeypatch):
    url, _ = engine
    rows = dict(enumerate(ROWS))
    in_threads, failed, spans = answer_round(url, REQUESTS, rows, **KW)
    assert not failed and len(spans) == 3 and all(t0 <= t1 for t0, t1 in spans)

    def refuse(*args, **kwargs):
        raise AssertionError("an answer was decoded in the trainer's process")

    # The helper imported its own parse_completion: this process's is never called.
    monkeypatch.setattr(answers, "parse_completion", refuse)
    helper = AnswerProcess()
    try:
        out, failed, spans = helper.result(helper.submit(url, REQUESTS, **KW), REQUESTS, ROWS)
    finally:
        helper.close()
    assert not failed and len(spans) == 3
    assert _fields(out) == _fields(in_threads)
    assert out[2].response_ids[-1] == EOS and out[2].finished


def test_a_wrong_version_or_a_dead_engine_fails_each_row_in_one_line(engine):
    url, state = engine
    state["version"] = "2"
    helper = AnswerProcess()
    try:
        out, failed, _ = helper.result(helper.submit(url, REQUESTS, **KW), REQUESTS, ROWS)
        assert not out and sorted(failed) == [0, 1, 2]
        assert "weight version(s) ['2'], expected '1'" in failed[0]
        # Nothing listens there: every request fails, each with a one-line message.
        dead = "http://127.0.0.1:9"
        out, failed, _ = helper.result(helper.submit(dead, REQUESTS, **KW), REQUESTS, ROWS)
        assert not out and len(failed) == 3 and all("\n" not in m for m in failed.values())
    finally:
        helper.close()


def test_a_dead_answer_process_fails_its_round_and_the_next_round_respawns_it(engine):
    url, state = engine
    helper = AnswerProcess()
    try:
        state["delay_s"] = 5.0
        future = helper.submit(url, REQUESTS, **KW)
        time.sleep(1.0)  # the helper is waiting on the slow engine
        (child,) = [p for p in multiprocessing.active_children() if p.name.startswith("Spawn")]
        os.kill(child.pid, signal.SIGKILL)
        out, failed, _ = helper.result(future, REQUESTS, ROWS)
        assert not out and len(failed) == 3
        assert all("answer process died" in m for m in failed.values())
        state["delay_s"] = 0.0
        out, failed, _ = helper.result(helper.submit(url, REQUESTS, **KW), REQUESTS, ROWS)
        assert not failed and sorted(out) == [0, 1, 2]
    finally:
        helper.close()
