"""SGLang rollout engines: launches (or attaches to) ``sglang.launch_server`` processes and an
sglang-router, samples through their HTTP API, and syncs every weight update into them.

Modules: ``config`` (``rollout.sglang.*``), ``process`` (command lines, environment, guard,
ports, process groups), ``http`` (the JSON client, request and answer formats), ``server``
(:class:`~.server.SGLangServer`: one server's process, health and calls), ``router`` (the
sglang-router), ``transports`` (tensor / distributed pushes, the config-only model directory),
``sender`` (a sending rank's side of a sync: :class:`~.sender.SGLangSyncPlan`,
:class:`~.sender.WeightSender`), ``faults`` (fault injection, testing only), ``pool``
(:class:`~.pool.ServerPool`: the servers and the router kept up), ``fleet``
(:class:`SGLangFleet`: the engine over them: sync, generate, recovery; its docstring tells the
whole story). The errors are ``megatron_rl_fp8.rollout.errors``'s, shared by every engine.

How it fits the trainer: :class:`SGLangFleet` implements the same ``RolloutEngine`` protocol as the
in-process ``LocalEngine``; the trainer's ``EngineLink.sync`` has each pipeline stage's sending rank
push the buckets of ``sync.buckets.export_for_rollout`` (HF names; FP8 codes + ``_scale_inv``
when ``rollout.fp8`` is on, or their values in the serving dtype where the engine has no FP8
GEMMs: ``export_options``) between the driver's ``begin_sync`` and ``end_sync`` (the plan's
``from_stages`` says so), and its rollout calls :meth:`SGLangFleet.generate` on the driver.

* Versions: before the first bucket every engine's weight version is set to ``"<v>-partial"``,
  after the last to ``"<v>"`` (then the KV/radix cache is flushed and ``/model_info`` is read
  back). Every ``/generate`` answer carries the version(s) that produced it; a completion whose
  version is not the fleet's current one is retried, so a half-applied sync is never served
  unnoticed. SGLang 0.5.23 takes tensor/distributed updates only between
  ``/begin_weight_update`` and ``/end_weight_update``.
* Process lifetime: each engine runs under a tiny guard process (``_GUARD`` in ``process.py``)
  in a process group of its own. The guard kills that whole group when the trainer dies (Linux
  parent-death signal, and a once-a-second parent check everywhere), and when the server's main
  process exits. SGLang's scheduler/detokenizer arm their own parent-death signal only after
  ~20 s of imports, so without the guard a trainer killed during startup would leak them.
  ``kill -9 -- -$(cat <work_dir>/engine0.pid)`` stops an engine and everything it started.
* Fault injection (testing only): ``MRF8_SGLANG_FAULT=<point>[@<n>][,...]`` or the fleet's
  ``fault_hook`` attribute SIGKILLs the last engine at named points (:data:`FAULT_POINTS`), so
  tests exercise every recovery path deterministically. Unset, it costs one attribute check per
  point.

Numerics: SGLang's returned logprob of a sampled token is log softmax(logits / T) at the sampling
temperature T (log of the probabilities it sampled from; with top_p < 1 these are the
*unfiltered* probabilities, as in ``LocalEngine``), and log softmax(logits) for greedy requests.
That is exactly what the trainer recomputes. On CPU, SGLang has no FP8 GEMM kernels
(``--quantization fp8`` needs the CUDA/CPU ``sgl_kernel`` build), so the FP8 weights are sent
dequantized: the rollout still runs on FP8-rounded weights, with activations in full precision.
On GPU the engines start from an FP8 config (``quantization_config`` in ``config.json``) with
``--quantization fp8`` and receive codes + scales.
"""

from __future__ import annotations

import importlib

from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.rollout.sglang.faults import (
    FAULT_ENV,
    FAULT_POINTS,
    KillServerAt,
    parse_fault_spec,
)
from megatron_rl_fp8.rollout.sglang.http import parse_completion, sampling_params

# lazy: these modules import torch (and are the engines' code, which loading a run's config does
# not need), and this file runs in the answer process (``answers.py``: a spawned helper that
# imports ``http`` through this package and starts without torch); they load on first use.
_LAZY = {
    "SGLangFleet": "fleet",
    "ServerPool": "pool",
    "SGLangServer": "server",
    "SGLangSyncPlan": "sender",
    "WeightSender": "sender",
    "pick_port": "process",
    "resolve_python": "process",
    "server_command": "process",
    "router_command": "process",
    "server_group_pids": "process",
    "spawn_guarded": "process",
    "new_sender_group": "transports",
}

__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "KillServerAt",
    "SGLangConfig",
    "parse_completion",
    "parse_fault_spec",
    "sampling_params",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
