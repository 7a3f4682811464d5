"""SGLang rollout engine: launches and owns ``sglang.launch_server`` processes, samples through
their HTTP API, and pushes every weight sync into them.

Modules: ``config`` (``rollout.sglang.*``), ``process`` (command line, environment, guard,
ports, process groups), ``http`` (the JSON calls, request and answer formats), ``transports``
(tensor / distributed pushes, the disk copy), ``faults`` (fault injection, testing only),
``engine`` (:class:`SGLangEngine`: the server's life, sync, generate, recovery), ``fleet``
(:class:`SGLangFleet`: several engines behind sglang-router, broadcast sync, no disk copy; its
docstring says how it differs from the single engine described below).

How it fits the trainer: :class:`SGLangEngine` implements the same ``RolloutEngine`` protocol as the
in-process ``LocalEngine``; the trainer's ``sync_weights`` streams the buckets of
``sync.buckets.export_for_rollout`` (HF names; FP8 codes + ``_scale_inv`` when ``rollout.fp8`` is
on, or their values in the serving dtype where the server has no FP8 GEMMs: ``export_options``)
into :meth:`SGLangEngine.update_weights`, and its rollout calls :meth:`SGLangEngine.generate`.

Life of the server:

* It starts lazily, at the first ``update_weights``: a server needs a checkpoint to start from, and
  the first synced weights are that checkpoint. Every sync writes the weights it received to
  ``<work_dir>/weights/v<version>/`` (safetensors shards, one per bucket, + ``config.json``) while it
  streams them to the server; only the last complete version is kept. That copy is what a restarted
  server loads, so a crash never needs the trainer to re-send anything.
* Three transports (``rollout.sglang.transport``), all between ``/begin_weight_update`` and
  ``/end_weight_update`` (SGLang 0.5.23 refuses tensor/distributed updates outside that session):
  ``tensor`` (colocated: tensors go through shared memory, only handles travel over HTTP),
  ``distributed`` (disaggregated: a private gloo/NCCL group between this process and the server's
  TP ranks, separate from the trainer's default group; the server joins with
  ``/init_weights_update_group``), ``disk`` (``/update_weights_from_disk`` on the shards above).
* Versions: before the first bucket the server's weight version is set to ``"<v>-partial"``, after
  the last to ``"<v>"`` (then the KV/radix cache is flushed and ``/model_info`` is read back).
  Every ``/generate`` answer carries the version(s) that produced it; a completion whose version is
  not the engine's current one is an error, so a half-applied sync can never be served unnoticed.
* Failures: wherever the engine meets a dead, hung or confused server -- ``generate``, the begin of
  a sync (``/update_weight_version``, ``/begin_weight_update``), the push of a bucket, the end of a
  sync (``/end_weight_update``, ``/update_weight_version``, ``/flush_cache``), the disk update, the
  version check (``/model_info``) -- it kills what is left of the server and launches a fresh one
  from the last complete disk copy, checks the version it reports, and goes on (a rollout is
  retried; a sync is finished, since that copy *is* the new version). A sync always consumes its
  whole stream first: the trainer's gather is a collective. Relaunches, including ones that die
  during startup, are bounded by ``max_restarts`` per call; then :class:`SGLangServerError` names
  the setting and the server log. ``weight_version()`` is -1 whenever no server verifiably serves
  the synced weights (during a sync, after a failure).
* Process lifetime: the server runs under a tiny guard process (``_GUARD``) in a process group of
  its own. The guard kills that whole group when the trainer dies (Linux parent-death signal, and
  a once-a-second parent check everywhere), and when the server's main process exits. SGLang's
  scheduler/detokenizer arm their own parent-death signal only after ~20 s of imports, so without
  the guard a trainer killed during startup would leak them. ``kill -9 -- -$(cat
  <work_dir>/server.pid)`` stops everything.
* Fault injection (testing only): ``MRF8_SGLANG_FAULT=<point>[@<n>][,...]`` or the engine's
  ``fault_hook`` attribute SIGKILLs the server at named points (:data:`FAULT_POINTS`), so tests
  exercise every recovery path deterministically. Unset, it costs one attribute check per point.

Numerics: SGLang's returned logprob of a sampled token is log softmax(logits / T) at the sampling
temperature T (log of the probabilities it sampled from; with top_p < 1 these are the
*unfiltered* probabilities, as in ``LocalEngine``), and log softmax(logits) for greedy requests.
That is exactly what the trainer recomputes. On CPU, SGLang has no FP8 GEMM kernels
(``--quantization fp8`` needs the CUDA/CPU ``sgl_kernel`` build), so the FP8 weights are sent
dequantized: the rollout still runs on FP8-rounded weights, with activations in full precision.
On GPU the server starts from an FP8 block-quantized checkpoint (``quantization_config`` in
``config.json``) with ``--quantization fp8`` and receives codes + scales.
"""

from __future__ import annotations

import importlib

from megatron_rl_fp8.rollout.sglang.config import SGLangConfig

# Everything but the config loads on first use: ``rollout.base`` imports the config from here,
# and the engine imports ``rollout.base``, so loading the engine eagerly would be circular.
_LAZY = {
    "SGLangEngine": "engine",
    "SGLangFleet": "fleet",
    "SyncFailed": "errors",
    "SGLangServerError": "errors",
    "FAULT_ENV": "faults",
    "FAULT_POINTS": "faults",
    "KillServerAt": "faults",
    "parse_fault_spec": "faults",
    "parse_completion": "http",
    "sampling_params": "http",
    "pick_port": "process",
    "resolve_python": "process",
    "server_command": "process",
    "router_command": "process",
    "server_group_pids": "process",
    "spawn_guarded": "process",
    "new_sender_group": "transports",
}

__all__ = ["SGLangConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
