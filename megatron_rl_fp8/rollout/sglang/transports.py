"""How weights reach the SGLang engines: the ``tensor`` and ``distributed`` pushes (used by
``sender.WeightSender``), and the config-only model directory the engines start from.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import inspect
import io
import json
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d
from torch.multiprocessing import reductions  # importing it registers the tensor reductions

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.process import pick_port
from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.ipc import ipc_allocations


def handover_tensors(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """What the ``tensor`` transport hands every engine (and every TP rank) of ``bucket``: one
    set of buffers for all of them. A ``handover`` bucket's own tensors (the relay's received
    buffer); else one fresh copy per (device, dtype) (:func:`flatten_per_dtype`): one shared-memory
    file, not one per tensor, and never the trainer's own storages (sharing would move them into
    shared memory, or hand an engine live training memory)."""
    return list(bucket.tensors) if bucket.handover else flatten_per_dtype(bucket.tensors)


def push_tensor(
    http: Http, named: list[tuple[str, torch.Tensor]], *, tp_size: int, timeout: float
) -> float:
    """``tensor`` transport: the handles of ``named`` (:func:`handover_tensors`; shared memory
    on CPU, CUDA IPC on GPU) over HTTP, serialized once for each of the engine's ``tp_size``
    ranks (:func:`serialize_per_rank`). The caller keeps ``named`` alive until the call returns
    (the server has copied the values by then). Returns the seconds spent serializing (the rest
    is the engine's update call)."""
    t0 = time.perf_counter()
    payloads = serialize_per_rank(named, tp_size)
    handed = time.perf_counter() - t0
    http.ok(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": payloads, "flush_cache": False},
        timeout=timeout,
    )
    return handed


def serialize_per_rank(named: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """``/update_weights_from_tensor``'s ``serialized_named_tensors``: ``named`` pickled with
    torch's tensor reductions (handles, not bytes) and base64-encoded, once per TP rank.

    SGLang 0.5.23 does the same in each of its own clients (``Engine._serialize_tensors_per_rank``
    in ``srt/entrypoints/engine.py``, ``HttpServerEngineAdapter.update_weights_from_tensor`` in
    ``srt/entrypoints/http_server_engine.py``), and TP rank i deserializes entry i only
    (``TpModelWorker.deserialize_own_rank``, ``srt/managers/tp_worker.py``). The reason is
    cross-process reference counting: every pickling of a tensor hands out one reference to the
    producer's memory (CUDA IPC: ``storage._share_cuda_()`` opens a reference counter; shared
    memory: ``_shared_incref``), and every rank's rebuild releases one when that rank drops the
    tensor. One payload read by every rank releases ``tp_size`` references for one handed out:
    the producer's memory is freed (CUDA) or its shared-memory file unlinked (CPU) while other
    ranks still read it. ``tests/unit/test_sglang_contracts.py`` checks both sides on CPU.

    A CUDA tensor's handle names its GPU by device UUID, not ordinal (:func:`reduce_by_uuid`), as
    SGLang's own senders do: the server may number the GPUs differently (per-task GPU binding)."""

    def one() -> str:
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        for cls in (torch.Tensor, torch.nn.Parameter):
            pickler.dispatch_table[cls] = reduce_by_uuid
        pickler.dump(named)
        return base64.b64encode(buf.getvalue()).decode()

    return [one() for _ in range(tp_size)]


# Position of ``storage_device`` in the arguments of torch's ``rebuild_cuda_tensor``
# (torch/multiprocessing/reductions.py), which SGLang's patch rewrites at the same index
# (utils/patch_torch.py: _REDUCE_TENSOR_ARG_DEVICE_INDEX).
CUDA_DEVICE_ARG = 6


def with_device_uuid(rebuild, args: tuple, uuid_of) -> tuple:
    """``(rebuild, args)`` of a tensor reduction with a CUDA tensor's device ordinal replaced by
    ``uuid_of(ordinal)``; any other reduction (shared memory on CPU) unchanged."""
    if rebuild is not reductions.rebuild_cuda_tensor:
        return rebuild, args
    device = args[CUDA_DEVICE_ARG]
    return rebuild, (*args[:CUDA_DEVICE_ARG], uuid_of(device), *args[CUDA_DEVICE_ARG + 1 :])


def reduce_by_uuid(tensor: torch.Tensor):
    """torch's tensor reduction, naming a CUDA tensor's GPU by its UUID. SGLang 0.5.23's
    receiver patches ``rebuild_cuda_tensor`` before it deserializes
    (``managers/tp_worker.py: deserialize_own_rank``, ``utils/patch_torch.py:
    monkey_patch_torch_reductions``) so that a UUID there is looked up among its own GPUs
    (``_device_from_maybe_uuid``); a bare ordinal is read in the server's numbering, which under
    per-task GPU binding (``srun --gpus-per-task``, ``--gpu-bind``) is another GPU."""
    rebuild, args = reductions.reduce_tensor(tensor)
    return with_device_uuid(rebuild, args, lambda d: str(torch.cuda.get_device_properties(d).uuid))


def push_distributed(
    engines: list[Http], group: tuple, bucket: Bucket, *, device: str, timeout: float
) -> tuple[float, float]:
    """``distributed`` transport: the bucket's bytes as one flat buffer, broadcast once over the
    private group ``(pg, name)`` to every engine in ``engines`` while each one's
    ``/update_weights_from_distributed`` call (SGLang's ``flattened_bucket`` format) receives it.
    A failure names the first engine whose call failed. Returns (transfer, load) seconds: until
    the broadcast completed on the sender, then until every engine answered (it applied the
    bucket)."""
    t0 = time.perf_counter()
    ordered, flat = flatten_for_broadcast(bucket.tensors)
    if device == "cuda":
        flat = flat.cuda()
    payload = {
        "names": [n for n, _ in ordered],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in ordered],
        "shapes": [list(t.shape) for _, t in ordered],
        "group_name": group[1],
        "flush_cache": False,
        "load_format": "flattened_bucket",
    }
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        replies = [
            pool.submit(http.ok, "/update_weights_from_distributed", payload, timeout=timeout)
            for http in engines
        ]
        try:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank = 0
            group[0].broadcast([flat], opts).wait()
            if device == "cuda":
                # NCCL's wait() only orders streams; the engines' replies wait for the broadcast
                # anyway, so this costs nothing and puts the broadcast's time in transfer.
                torch.cuda.synchronize()
        except RuntimeError as e:
            for reply in replies:
                reply.cancel()
            raise ServerGone(f"weight broadcast to the SGLang engines failed: {e}") from e
        t1 = time.perf_counter()
        for http, reply in zip(engines, replies):
            try:
                reply.result()
            except RolloutEngineError as e:
                raise type(e)(f"{http.base_url}: {e}") from e
    return t1 - t0, time.perf_counter() - t1


def flatten_for_broadcast(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """(tensors in send order, their bytes as one uint8 buffer). Widest dtypes first, so every
    tensor starts at a multiple of its element size, as the receiving side requires."""
    ordered = sorted(named, key=lambda nt: -nt[1].element_size())  # stable within a width
    flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in ordered])
    return ordered, flat


def join_sender_group(
    engines: list[tuple[Http, int]], *, host: str, device: str, name: str, timeout: float
) -> tuple:
    """Form the private group of the ``distributed`` transport: this process is rank 0, then the
    TP ranks of each engine in ``engines`` (``(http, tp_size)``, in order). Returns
    ``(process group, name)``."""
    port = pick_port()
    world = 1 + sum(tp for _, tp in engines)
    backend = "nccl" if device == "cuda" else "gloo"
    offsets = [1 + sum(tp for _, tp in engines[:i]) for i in range(len(engines))]
    # Our side joins in a thread while the HTTP calls make the engines join; each reply comes
    # only once all sides are in. If a call fails instead (engine gone), the rendezvous can never
    # complete: it is left to time out in its thread (``timeout``), not waited for here. Not a
    # daemon: a daemon thread still blocked in c10d's store wait when the interpreter exits
    # aborts the process once the wait times out ("terminate called without an active
    # exception"), so the exit waits for the timeout instead.
    joined: dict[str, Any] = {}

    def join():
        try:
            joined["pg"] = new_sender_group(host, port, world, name, backend, timeout_s=timeout)
        except Exception as e:  # noqa: BLE001 - reported by the caller below
            joined["error"] = e

    thread = threading.Thread(target=join, name="mrf8-sglang-weight-group", daemon=False)
    thread.start()
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        calls = [
            pool.submit(
                http.ok,
                "/init_weights_update_group",
                {
                    "master_address": host,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": name,
                    "backend": backend,
                },
                timeout=timeout,
            )
            for (http, _), offset in zip(engines, offsets)
        ]
        for (http, _), call in zip(engines, calls):
            try:
                call.result()
            except RolloutEngineError as e:
                raise type(e)(f"{http.base_url}: {e}") from e
    thread.join(timeout)
    if "pg" not in joined:
        raise ServerGone(
            f"the weight-sync group with the SGLang engines did not form: "
            f"{joined.get('error', 'timed out')}"
        )
    return joined["pg"], name


def destroy_sender_group(group: tuple) -> None:
    """Drop our side of the distributed transport's group (the server's side dies with it)."""
    try:
        torch.distributed.destroy_process_group(group[0])
    except (RuntimeError, ValueError, KeyError):
        pass  # already torn down by a failed collective: nothing left to free


def new_sender_group(
    host: str, port: int, world_size: int, group_name: str, backend: str, *, timeout_s: float
):
    """Rank 0 of a private process group with the server's TP ranks (ranks 1..world_size-1).

    It is built the way SGLang's ``init_custom_process_group`` builds the receiving side (a TCP
    rendezvous store prefixed with the group name, then c10d's group factory), so the two sides
    agree on store keys; it is *not* the default group, so the trainer's collectives are untouched.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    # This process hosts the store (not c10d.rendezvous: under torchrun, with
    # TORCHELASTIC_USE_AGENT_STORE set, rank 0 of a tcp:// rendezvous only connects to a store it
    # expects torchrun's agent to host, and the trainer and every engine wait as clients).
    store = torch.distributed.TCPStore(
        host, port, world_size, True, timeout=timeout, wait_for_workers=False
    )
    rank, world = 0, world_size
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **options,
    )
    return pg


def flatten_per_dtype(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of ``named`` as views into one fresh contiguous buffer per (device, dtype),
    allocated to be handed over CUDA IPC (:func:`ipc_allocations`)."""
    by_dtype: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_dtype.setdefault((t.device, t.dtype), []).append(i)
    out: list[tuple[str, torch.Tensor] | None] = [None] * len(named)
    for (device, dtype), idx in by_dtype.items():
        with ipc_allocations(device):
            flat = torch.empty(sum(named[i][1].numel() for i in idx), dtype=dtype, device=device)
        offset = 0
        for i in idx:
            name, t = named[i]
            view = flat[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            out[i] = (name, view)
            offset += t.numel()
    return out  # type: ignore[return-value]


def write_model_config(
    path: Path, hf_config, *, serve_dtype: str, fp8: RolloutFP8Config | None
) -> None:
    """``config.json`` of the model directory engines start from on placeholder weights
    (``fp8``: an FP8 checkpoint's ``quantization_config``, so the engine builds FP8 linears)."""
    config = hf_config.to_dict()
    config["torch_dtype"] = config["dtype"] = serve_dtype
    if fp8 is not None:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if fp8.weight_quant == "blockwise":
            qc["weight_block_size"] = list(fp8.weight_block)
        config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config, indent=1, default=str))
