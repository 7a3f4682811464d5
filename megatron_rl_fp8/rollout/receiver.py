"""Delta receivers outside the trainer: a process beside rollout engines that no trainer rank
can reach by NCCL or shared memory / CUDA IPC (engines on nodes without trainer ranks, or on
machines outside the cluster over a slow link). It keeps its node's copy of the exported
weights, takes each sync as a delta over one TCP connection per pipeline stage, applies it, and
pushes full tensors to its own engines locally (the engine's own sender for the plan: SGLang's
``tensor`` transport).

    megatron-rl-fp8 receiver --port 7100            # on the engines' node
    rollout.delta_sync=true rollout.delta_receivers=[n3=n3.example:7100]   # the trainer

A stage's sending rank streams to it what it broadcasts to the per-node sync's relay ranks
(``sync/relay.py``: same layout, same bytes), so a receiver here and a relay rank there hold
the same copy. One connection per stage and sync, frames of JSON (4-byte length) and raw bytes:

    sender -> {"op": "version", "stage": s, "token": ...}      receiver -> {"version": v | null}
    sender -> {"op": "sync", "version", "base", "verify", "plan": {"cls", "fields"}}
    sender -> {"index", "entries", "size"} + size bytes         (one per bucket)
    sender -> {"end": true}                                    receiver -> {"error": str | null}

No pickle crosses the socket: the plan travels as its dataclass fields and is rebuilt only as a
``SyncPlan`` subclass. ``MRF8_RECEIVER_TOKEN``, when set on both sides, must match. A receiver
on another version than the sender's makes the sender send in full (the reason is logged); one
whose apply fails (digest mismatch) reports it, so the sync runs again in full.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import socket
import struct
import sys
import time

import torch

from megatron_rl_fp8.rollout.base import SyncPlan, SyncSender
from megatron_rl_fp8.rollout.errors import RolloutEngineError
from megatron_rl_fp8.sync.delta import DeltaReceiver, NeedFullSync
from megatron_rl_fp8.sync.relay import applied_bucket

TOKEN_ENV = "MRF8_RECEIVER_TOKEN"
_LEN = struct.Struct("!I")


def parse_address(text: str, field: str = "rollout.delta_receivers") -> tuple[str, str, int]:
    """``NODE=HOST:PORT`` -> (node, host, port); ValueError naming ``field`` otherwise."""
    node, eq, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not (eq and colon and node.strip() and host.strip() and port.isdigit()):
        raise ValueError(
            f"{field}: {text!r} is not NODE=HOST:PORT (the engines' node, as the engine's "
            "settings name it, = the address its receiver listens on)"
        )
    return node.strip(), host.strip(), int(port)


def _jsonable(obj):
    """JSON for the one non-JSON value plans carry: a torch dtype (``export_options``)."""
    if isinstance(obj, torch.dtype):
        return {"torch.dtype": str(obj)}
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _from_json(obj: dict):
    return _dtype(obj["torch.dtype"]) if set(obj) == {"torch.dtype"} else obj


def _send_json(sock: socket.socket, obj) -> None:
    data = json.dumps(obj, default=_jsonable).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the connection closed mid-message")
        view = view[n:]


def _recv_json(sock: socket.socket):
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head))
    data = bytearray(_LEN.unpack(head)[0])
    _recv_exact(sock, memoryview(data))
    return json.loads(data, object_hook=_from_json)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name}")
    return dtype


def _plan_json(plan: SyncPlan) -> dict:
    cls = type(plan)
    return {"cls": f"{cls.__module__}:{cls.__qualname__}", "fields": dataclasses.asdict(plan)}


def _plan_from_json(obj: dict) -> SyncPlan:
    module, _, name = obj["cls"].partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, SyncPlan)):
        raise ValueError(f"{obj['cls']} is not a SyncPlan")
    fields = dict(obj["fields"])
    if "engines" in fields:  # JSON made the (url, tp_size) pairs lists
        fields["engines"] = [tuple(e) for e in fields["engines"]]
    return cls(**fields)


class RemoteReceiver:
    """A stage sender's connection to one delta receiver for one sync (``sync/relay.py`` calls
    :meth:`version`, :meth:`begin`, :meth:`send` per bucket, :meth:`end`). Never raises: the
    first failure becomes :attr:`error` (one line) and the rest of the calls do nothing."""

    def __init__(self, node: str, host: str, port: int, *, stage: int, plan: SyncPlan,
                 timeout: float = 600.0):  # fmt: skip
        self.node, self.host, self.port = node, host, port
        self.name = f"node {node}'s delta receiver ({host}:{port})"
        self.stage, self.plan, self.timeout = stage, plan, timeout
        self.error: str | None = None
        self._sock: socket.socket | None = None

    def _guard(self, what: str, call) -> object:
        if self.error is not None:
            return None
        try:
            return call()
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.error = (
                f"{self.name}: {what} failed ({type(e).__name__}: {str(e)[:200]}); is "
                f"`megatron-rl-fp8 receiver --port {self.port}` running on {self.host}?"
            )
            self.close()
            return None

    def version(self) -> int | None:
        def ask():
            self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            token = os.environ.get(TOKEN_ENV, "")
            _send_json(self._sock, {"op": "version", "stage": self.stage, "token": token})
            reply = _recv_json(self._sock)
            if "refused" in reply:
                raise ValueError(reply["refused"])
            return reply["version"]

        return self._guard("asking its version", ask)

    def begin(self, version: int, base: int | None, *, verify: bool) -> None:
        header = {"op": "sync", "version": version, "base": base, "verify": verify,
                  "plan": _plan_json(self.plan)}  # fmt: skip
        self._guard("starting the sync", lambda: _send_json(self._sock, header))

    def send(self, index: int, entries, buf: torch.Tensor) -> None:
        def go():
            wire = [[n, str(d), list(s), o, k, dg] for n, d, s, o, k, dg in entries]
            _send_json(self._sock, {"index": index, "entries": wire, "size": buf.numel()})
            self._sock.sendall(memoryview(buf.cpu().numpy()))

        self._guard(f"sending bucket {index}", go)

    def end(self) -> None:
        def finish():
            _send_json(self._sock, {"end": True})
            return _recv_json(self._sock)["error"]

        failed = self._guard("finishing the sync", finish)
        if failed and self.error is None:
            self.error = f"{self.name}: {failed}"
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ReceiverServer:
    """The receiver process's side: one :class:`DeltaReceiver` per pipeline stage, and the
    engines' sender each plan makes (``plan.new_sender()``), kept between syncs. Connections
    are served one at a time (the stages push in turn)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self.receivers: dict[int, DeltaReceiver] = {}
        self.senders: dict[str, SyncSender] = {}
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.token = os.environ.get(TOKEN_ENV, "")

    def serve_forever(self) -> None:
        while True:
            self.serve_one()

    def serve_one(self) -> None:
        conn, peer = self.sock.accept()
        with conn:
            try:
                self._handle(conn)
            except (OSError, ValueError, KeyError) as e:  # the sender went away, or bad input
                print(f"receiver: a sync from {peer[0]} broke: {e}", file=sys.stderr, flush=True)

    def _handle(self, conn: socket.socket) -> None:
        hello = _recv_json(conn)
        if hello.get("token", "") != self.token:
            _send_json(conn, {"refused": f"wrong {TOKEN_ENV}"})
            return
        stage = int(hello["stage"])
        receiver = self.receivers.setdefault(stage, DeltaReceiver())
        _send_json(conn, {"version": receiver.version})
        head = _recv_json(conn)
        plan = _plan_from_json(head["plan"])
        receiver.verify = bool(head["verify"])
        device = torch.device(getattr(plan, "device", "cpu"))  # the engines' (CUDA IPC on cuda)
        failure = None
        try:
            receiver.begin(head["version"], head["base"])
        except NeedFullSync as e:
            failure = str(e)

        def buckets():
            nonlocal failure
            while True:
                frame = _recv_json(conn)
                if frame.get("end"):
                    return
                buf = torch.empty(int(frame["size"]), dtype=torch.uint8)
                _recv_exact(conn, memoryview(buf.numpy()))
                if failure:
                    continue  # drained: the sync fails, and its rerun goes in full
                entries = [(n, _dtype(d), tuple(s), o, k, dg) for n, d, s, o, k, dg in frame["entries"]]  # fmt: skip
                try:
                    yield applied_bucket(receiver, int(frame["index"]), entries, buf, device)
                except NeedFullSync as e:
                    failure = str(e)

        t0 = time.perf_counter()
        key = type(plan).__qualname__
        if key not in self.senders:
            self.senders[key] = plan.new_sender()
        sender = self.senders[key]
        try:
            error = sender.push(plan, buckets())
        except RolloutEngineError as e:
            error = str(e).splitlines()[0]
        if failure is None:
            receiver.finish()  # the copy is right even when an engine failed: its rerun is quick
        error = failure or error
        _send_json(conn, {"error": error})
        print(
            f"receiver: stage {stage} version {head['version']} "
            f"({'delta from ' + str(head['base']) if head['base'] is not None else 'full'}) "
            f"in {time.perf_counter() - t0:.2f} s" + (f": {error}" if error else ""),
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="megatron-rl-fp8 receiver",
        description="A delta-sync receiver beside rollout engines the trainer cannot reach "
        "(docs/delta_sync.md).",
    )
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on")
    ap.add_argument(
        "--port", type=int, required=True, help="port to listen on (0: a free one, printed)"
    )
    args = ap.parse_args(argv)
    try:
        server = ReceiverServer(args.host, args.port)
    except OSError as e:
        print(
            f"receiver: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    print(f"receiver: listening on {args.host}:{server.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return 0
    return 0
