"""What this project relies on SGLang to do, each written as the precondition read from SGLang's
source (0.5.23, the version ``scripts/install_sglang_cpu.sh`` installs), and the project's side of it.

The default run checks our side without SGLang. Where SGLang's own code runs on CPU, the tests
marked ``sglang`` run it too, in SGLang's interpreter (``.venv-sglang`` or ``MRF8_SGLANG_PYTHON``;
skipped without one): if a later SGLang changes a precondition, those tests say so.

Not checked on this box: a tp_size > 1 engine (SGLang's CPU engine here serves tp 1), CUDA IPC
itself, and SGLang's FP8 kernels (``--quantization fp8`` needs the CPU ``sgl_kernel`` build).
The CUDA-IPC case rests on torch's reference counting working as shared memory's does on CPU
(``torch/multiprocessing/reductions.py``: every pickling of a tensor hands out one reference,
every rebuild in another process releases one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.rollout.config import RolloutConfig
from megatron_rl_fp8.rollout.sglang.transports import handover_tensors, push_tensor
from megatron_rl_fp8.sync.buckets import Bucket
from tests.sglang.conftest import sglang_python

SHM = Path("/dev/shm")


def _python(mode: str) -> str:
    if mode == "torch":
        return sys.executable
    path = sglang_python()
    if path is None:
        pytest.skip("no SGLang python: run scripts/install_sglang_cpu.sh or set MRF8_SGLANG_PYTHON")
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_USE_CPU_ENGINE": "1"}


# -- /update_weights_from_tensor: one serialization per TP rank -------------------------------

# One TP rank of an engine: reads the request's list, deserializes its own entry (plain pickle,
# or SGLang's own path: normalize the HTTP strings, then ``TpModelWorker.deserialize_own_rank``),
# reports the shared-memory files it mapped and the values, then drops the tensors (releasing
# its references) before it exits.
_RANK = r"""
import base64, gc, json, pickle, sys, types
import torch, torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")
rank, mode = int(sys.argv[1]), sys.argv[2]
payloads = json.loads(sys.stdin.read())
if mode == "sglang":
    from sglang.srt.managers import tp_worker
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    tp_worker.get_parallel = lambda: types.SimpleNamespace(tp_rank=rank)
    named = tp_worker.TpModelWorker.deserialize_own_rank(
        None, normalize_serialized_named_tensor_payloads(payloads)
    )
else:
    named = pickle.loads(base64.b64decode(payloads[rank]))
files = sorted({t.untyped_storage()._share_filename_cpu_()[1].decode() for _, t in named})
out = {"files": files, "tensors": {n: t.float().tolist() for n, t in named}}
del named
gc.collect()
print(json.dumps(out))
"""


class _EngineRanks:
    """Stands in for one engine's HTTP endpoint: the call runs its ``tp_size`` ranks, each in its
    own process as SGLang's TP ranks are, and looks at the producer's shared memory once all of
    them released their tensors, while the producer still holds its buffers (the call has not
    returned)."""

    def __init__(self, python: str, mode: str, tp_size: int):
        self.python, self.mode, self.tp_size = python, mode, tp_size
        self.body: dict = {}
        self.seen: list[dict] = []
        self.files_left: dict[str, bool] = {}

    def ok(self, path: str, body: dict, *, timeout: float):
        assert path == "/update_weights_from_tensor"
        self.body = body
        ranks = [
            subprocess.Popen(
                [self.python, "-c", _RANK, str(rank), self.mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(),
            )
            for rank in range(self.tp_size)
        ]
        text = json.dumps(body["serialized_named_tensors"])
        for rank in ranks:
            out, err = rank.communicate(text, timeout=timeout)
            assert rank.returncode == 0, err[-2000:]
            self.seen.append(json.loads(out.strip().splitlines()[-1]))
        files = {f for seen in self.seen for f in seen["files"]}
        self.files_left = {f: (SHM / f.lstrip("/")).exists() for f in files}
        return {}


@pytest.fixture
def file_system_sharing():
    """The tensor transport's CPU strategy (``WeightSender`` sets it), restored afterwards."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.parametrize("mode", ["torch", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_sglang_update_weights_from_tensor_one_payload_per_tp_rank(mode, file_system_sharing):
    """Precondition (SGLang 0.5.23): ``UpdateWeightsFromTensorReqInput.serialized_named_tensors``
    (``srt/managers/io_struct.py``) is a list with one entry per TP rank, and TP rank i
    deserializes entry i only (``TpModelWorker.deserialize_own_rank``,
    ``srt/managers/tp_worker.py``: "deserializing another rank's copy would break producer-side
    CUDA-IPC refcounting"). SGLang's own clients serialize once per rank
    (``Engine._serialize_tensors_per_rank``, ``srt/entrypoints/engine.py``;
    ``HttpServerEngineAdapter.update_weights_from_tensor``, ``srt/entrypoints/http_server_engine.py``),
    because each pickling hands out one producer reference and each rank's rebuild releases one.

    Checked here with shared memory (the CPU transport; CUDA IPC counts the same way): two ranks,
    each in its own process, deserialize their entry of what ``push_tensor`` sent and drop it.
    The producer still holds its buffers, so their shared-memory files must still exist. With
    one payload copied to both ranks (before the fix) the second release took the count to zero
    and the files were unlinked under the producer. ``mode=sglang``: the ranks read the request
    with SGLang's own code (base64 strings normalized as the tokenizer manager does)."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm: torch's file_system sharing lives elsewhere on this OS")
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("model.layers.0.mlp.down_proj.weight", torch.randn(4, 6, generator=gen)),
        ("model.layers.0.input_layernorm.weight", torch.randn(6, generator=gen)),
        ("model.embed_tokens.weight", torch.randn(3, 6, generator=gen).to(torch.bfloat16)),
    ]
    engine = _EngineRanks(_python(mode), mode, tp_size=2)

    push_tensor(engine, handover_tensors(Bucket(0, tensors)), tp_size=2, timeout=300)

    payloads = engine.body["serialized_named_tensors"]
    assert isinstance(payloads, list) and len(payloads) == 2
    want = {n: t.float().tolist() for n, t in tensors}
    assert [seen["tensors"] for seen in engine.seen] == [want, want]
    assert len(engine.files_left) == 2  # one shared buffer per dtype
    assert all(engine.files_left.values()), (
        f"shared memory unlinked while the producer held it: {engine.files_left}; "
        "each TP rank needs a payload of its own"
    )


# -- what SGLang's code does, run in SGLang's interpreter -------------------------------------

# Facts read by running SGLang's own functions on CPU (printed as one JSON line).
_PROBE = r"""
import json, types
import torch

facts = {}

# Engine: one MultiprocessingSerializer.serialize per TP rank.
import sglang.srt.entrypoints.engine as engine
calls = []
real = engine.MultiprocessingSerializer.serialize
engine.MultiprocessingSerializer = types.SimpleNamespace(
    serialize=lambda obj, output_str=False: calls.append(1) or real(obj, output_str)
)
engine.get_parallel = lambda: types.SimpleNamespace(tp_size=3)
out = engine.Engine._serialize_tensors_per_rank(None, [("w", torch.ones(2))], None)
facts["engine_payloads"], facts["engine_serializations"] = len(out), len(calls)

# The request field, and which entry a rank reads.
import typing
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
hint = typing.get_type_hints(UpdateWeightsFromTensorReqInput)["serialized_named_tensors"]
facts["field"] = str(hint)
from sglang.srt.managers import tp_worker
from sglang.srt.utils import MultiprocessingSerializer
tp_worker.get_parallel = lambda: types.SimpleNamespace(tp_rank=1)
own = tp_worker.TpModelWorker.deserialize_own_rank(
    None, [MultiprocessingSerializer.serialize(x) for x in ("rank0", "rank1")]
)
facts["rank1_reads"] = own

# Fp8LinearMethod.process_weights_after_loading on an FP8 checkpoint, the GPU branch (the CPU
# branch needs sgl_kernel's AMX packing), as an SM90 GPU takes it (cutlass FP8 supported).
import sglang.srt.layers.quantization.fp8 as fp8
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from sglang.srt.model_loader.weight_utils import default_weight_loader

fp8._is_cpu = False

def loader(param, loaded, shard_id=None):
    pass

def layer_after(block, parts, k):
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=block))
    method.cutlass_fp8_supported, method.use_marlin = True, False
    layer = torch.nn.Module()
    layer.tp_group, layer.deepgemm_mxfp8_input = None, False
    method.create_weights(layer, input_size_per_partition=k, output_partition_sizes=parts,
                          input_size=k, output_size=sum(parts), params_dtype=torch.bfloat16,
                          weight_loader=loader)
    before = {n: p for n, p in layer.named_parameters()}
    if block is None:
        layer.weight_scale.data.fill_(0.01)
    method.process_weights_after_loading(layer)
    kept = {n: layer.get_parameter(n) is p for n, p in before.items()}
    loaders = {n: hasattr(p, "weight_loader") for n, p in layer.named_parameters()}
    shapes = {n: list(p.shape) for n, p in layer.named_parameters()}
    return layer, {"kept": kept, "loaders": loaders, "shapes": shapes}

# A fused qkv-like layer (three shards, 512 x 256) per tensor, and block-quantized.
_, facts["per_tensor_fused"] = layer_after(None, [256, 128, 128], 256)
_, facts["blockwise_fused"] = layer_after([128, 128], [256, 128, 128], 256)

# A square o_proj-like layer per tensor: what the loader a model falls back to for a parameter
# without weight_loader (default_weight_loader) makes of the codes we send.
layer, _ = layer_after(None, [128], 128)
codes = torch.randn(128, 128).to(torch.float8_e4m3fn)
default_weight_loader(layer.weight, codes)
w = layer.weight.float()
try:  # our per-tensor scale is 0-d; the post-processed scale is per channel
    default_weight_loader(layer.weight_scale, torch.tensor(0.02))
    scale_error = None
except Exception as e:
    scale_error = type(e).__name__
facts["square_load"] = {
    "weight_accepted": True,
    "weight_as_apply_reads_it": bool(torch.equal(w, codes.float().t())),
    "scale_error": scale_error,
}
from sglang.srt.utils import patch_torch
from torch.multiprocessing import reductions

patch_torch.monkey_patch_torch_reductions()
facts["uuid_patch"] = {
    "device_arg": patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX,
    "rebuild_patched": reductions.rebuild_cuda_tensor is patch_torch._rebuild_cuda_tensor_modified,
    "ordinal_passes": patch_torch._device_from_maybe_uuid(0),
}
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def sglang_facts():
    python = _python("sglang")
    out = subprocess.run(
        [python, "-c", _PROBE], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.sglang
def test_sglang_engine_serializes_update_weights_from_tensor_once_per_tp_rank(sglang_facts):
    """SGLang 0.5.23, ``srt/entrypoints/engine.py`` ``Engine._serialize_tensors_per_rank``: one
    ``MultiprocessingSerializer.serialize`` per TP rank; ``srt/managers/io_struct.py``:
    ``serialized_named_tensors: List[bytes]``; ``srt/managers/tp_worker.py``
    ``deserialize_own_rank``: rank i reads entry i. The precondition ``push_tensor`` follows."""
    assert sglang_facts["engine_payloads"] == sglang_facts["engine_serializations"] == 3
    assert sglang_facts["field"] == "typing.List[bytes]"
    assert sglang_facts["rank1_reads"] == "rank1"


@pytest.mark.sglang
def test_sglang_per_tensor_fp8_post_processing_leaves_no_loadable_weight(sglang_facts):
    """SGLang 0.5.23, ``srt/layers/quantization/fp8.py`` ``Fp8LinearMethod
    .process_weights_after_loading`` on an FP8 checkpoint without ``weight_block_size``: the
    weight becomes a new, transposed ``Parameter`` without ``weight_loader``, and on cutlass GPUs
    (SM89+) the per-shard scale a per-channel ``(N, 1)`` one without ``weight_loader``. The dummy
    loader (``srt/model_loader/loader.py`` ``DummyModelLoader.load_model``) runs it at start-up,
    before the first sync, and ``Fp8LinearMethod`` has no ``restore_weights_before_loading`` to
    undo it at ``/begin_weight_update`` (the base class's is a no-op). So a fused qkv / gate_up
    update fails (``LlamaForCausalLM`` / ``Qwen3ForCausalLM.load_weights`` call
    ``param.weight_loader`` for stacked shards), a square o_proj's codes go in through
    ``default_weight_loader`` untransposed, and its 0-d scale does not fit the per-channel one.
    Block-quantized checkpoints keep their parameters and loaders: ``blockwise`` is what SGLang
    engines are sent (the refusal below)."""
    per_tensor = sglang_facts["per_tensor_fused"]
    assert per_tensor["kept"] == {"weight": False, "weight_scale": False}
    assert per_tensor["loaders"] == {"weight": False, "weight_scale": False}
    assert per_tensor["shapes"] == {"weight": [256, 512], "weight_scale": [512, 1]}
    blockwise = sglang_facts["blockwise_fused"]
    assert blockwise["kept"] == {"weight": True, "weight_scale_inv": True}
    assert blockwise["loaders"] == {"weight": True, "weight_scale_inv": True}
    assert blockwise["shapes"] == {"weight": [512, 256], "weight_scale_inv": [4, 2]}
    assert sglang_facts["square_load"] == {
        "weight_accepted": True,
        "weight_as_apply_reads_it": False,
        "scale_error": "AssertionError",
    }


# -- per-tensor FP8 rollout weights: refused for SGLang engines -------------------------------


def test_sglang_per_tensor_fp8_weights_refused():
    """SGLang engines cannot take per-tensor FP8 hot updates (the precondition above): the config
    refuses ``rollout.fp8.weight_quant=per_tensor`` with ``rollout.engine=sglang`` in one line
    naming the field, why, and what to use, before any process starts. The in-process engine
    keeps per_tensor; blockwise and bf16 stay valid for SGLang."""
    per_tensor = RolloutFP8Config(weight_quant="per_tensor")
    with pytest.raises(ValueError) as err:
        RolloutConfig(engine="sglang", fp8=per_tensor)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("rollout.fp8.weight_quant=per_tensor")
    assert "rollout.engine=sglang" in msg and "weight_loader" in msg
    assert "rollout.fp8.weight_quant=blockwise" in msg
    with pytest.raises(ValueError, match=r"^rollout\.fp8\.weight_quant=per_tensor"):
        load_config(None, ["rollout.engine=sglang", "rollout.fp8.weight_quant=per_tensor"])
    RolloutConfig(engine="local", fp8=per_tensor)
    for quant in ("blockwise", "bf16"):
        RolloutConfig(engine="sglang", fp8=RolloutFP8Config(weight_quant=quant))


def test_cli_refuses_per_tensor_fp8_for_sglang_in_one_line(capsys):
    # A python that does not exist: were the refusal gone, the run would fail at the engine's
    # launch at once instead of training with SGLang.
    overrides = [
        "rollout.engine=sglang",
        "rollout.fp8.weight_quant=per_tensor",
        "rollout.sglang.python=/nonexistent/python",
    ]
    assert cli.main(["train", "examples/tiny_cpu.yaml", *overrides]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("config error: rollout.fp8.weight_quant=per_tensor")


# -- SG-9 (issue 43 #2): expandable segments ------------------------------------------------------
ALLOC = "PYTORCH_CUDA_ALLOC_CONF"


@pytest.mark.parametrize(
    "conf, left",
    [
        ("expandable_segments:True", None),
        ("expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:128"),
        (
            "garbage_collection_threshold:0.6, expandable_segments:True",
            "garbage_collection_threshold:0.6",
        ),
        ("max_split_size_mb:128", "max_split_size_mb:128"),
    ],
)
def test_memory_saver_engines_start_without_expandable_segments(monkeypatch, conf, left):
    # torch_memory_saver 0.0.10 (entrypoint.py: _sanity_checks) raises at the engine's start when
    # PYTORCH_CUDA_ALLOC_CONF holds expandable_segments:True; slurm/README.md recommends it for
    # the trainer, whose environment the engines inherit.
    from megatron_rl_fp8.rollout.launching import NodeRole
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
    from megatron_rl_fp8.rollout.sglang.process import MEMORY_SAVER_FLAG, server_env
    from megatron_rl_fp8.rollout.sglang.role import node_sglang

    monkeypatch.setenv(ALLOC, conf)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    saver = SGLangConfig(extra_args=[MEMORY_SAVER_FLAG])
    for var in (ALLOC, "PYTORCH_ALLOC_CONF"):
        assert server_env(saver, "cuda").get(var) == left
        assert server_env(SGLangConfig(), "cuda")[var] == conf  # no memory saver: untouched
    role = NodeRole(
        node_index=0, node="n1", addr="127.0.0.1", engines=(), router_port=None, worker_urls=()
    )
    colocated = node_sglang(SGLangConfig(), role, colocated=True, device="cuda")
    assert MEMORY_SAVER_FLAG in colocated.extra_args
    assert server_env(colocated, "cuda").get(ALLOC) == left
    assert (
        MEMORY_SAVER_FLAG
        not in node_sglang(SGLangConfig(), role, colocated=False, device="cuda").extra_args
    )


def test_ipc_buffers_are_allocated_outside_expandable_segments(monkeypatch):
    # torch shares an expandable segment over CUDA IPC by pidfd_getfd on the sender
    # (CUDACachingAllocator.cpp: ExpandableSegment::fromShared), which containers and Yama
    # ptrace_scope >= 1 deny; the buffers the tensor transport hands out must be cudaMalloc'd.
    from megatron_rl_fp8.rollout.sglang import transports
    from megatron_rl_fp8.sync import ipc

    assert not ipc.expandable_segments_on({ALLOC: "max_split_size_mb:64"})
    assert not ipc.expandable_segments_on({ALLOC: "expandable_segments:False"})
    assert ipc.expandable_segments_on({"PYTORCH_ALLOC_CONF": " expandable_segments:True"})
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setenv(ALLOC, "expandable_segments:True")
    with ipc.ipc_allocations(torch.device("cuda")):
        assert calls == ["expandable_segments:False"]
    assert calls == ["expandable_segments:False", "expandable_segments:True"]
    calls.clear()
    with ipc.ipc_allocations(torch.device("cpu")):  # shared memory: nothing to switch
        pass
    monkeypatch.setenv(ALLOC, "max_split_size_mb:64")
    with ipc.ipc_allocations(torch.device("cuda")):
        pass
    assert calls == []
    named = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    flat = transports.flatten_per_dtype(named)
    assert [n for n, _ in flat] == ["a", "b"] and flat[1][1].untyped_storage() is not None
    assert flat[0][1].data_ptr() + 3 * 4 == flat[1][1].data_ptr()  # one buffer per dtype


def test_colocated_tp_engines_start_with_the_memory_balance_check_off(monkeypatch):
    # SG-10 (issue 43 #3): SGLang 0.5.23's distributed/bootstrap.py: _check_tp_memory_balance
    # raises for tp_size > 1 when a GPU's free memory is < 90% of another's, unless
    # SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK is false (environ.py: EnvBool); the trainer's ranks
    # on the same GPUs make free memory unequal.
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
    from megatron_rl_fp8.rollout.sglang.process import (
        MEMORY_SAVER_FLAG,
        TP_BALANCE_CHECK,
        server_env,
    )

    monkeypatch.delenv(TP_BALANCE_CHECK, raising=False)
    colocated = SGLangConfig(tp_size=2, extra_args=[MEMORY_SAVER_FLAG])
    assert server_env(colocated, "cuda")[TP_BALANCE_CHECK] == "false"
    assert TP_BALANCE_CHECK not in server_env(SGLangConfig(tp_size=2), "cuda")  # own GPUs: kept
    forced = SGLangConfig(tp_size=2, extra_args=[MEMORY_SAVER_FLAG], env={TP_BALANCE_CHECK: "1"})
    assert server_env(forced, "cuda")[TP_BALANCE_CHECK] == "1"  # the user's choice wins


def test_weight_blocks_sglang_refuses_are_refused_at_config():
    # SG-6 (issue 43 #8): SGLang 0.5.23's Fp8LinearMethod.validate_block_quant_shapes raises at
    # start-up unless merged and column-parallel output partitions are multiples of block_n and
    # row-parallel input partitions (TP > 1) multiples of block_k.
    from megatron_rl_fp8.config import ConfigError
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.rollout.sglang.config import block_quant_shape_problem

    tiny = load_config(None, []).model  # 4 heads of 32, 2 KV groups: k_proj is 64 wide
    assert "k_proj / v_proj output per tensor-parallel rank is 64" in block_quant_shape_problem(
        tiny, 1, (128, 128)
    )
    assert block_quant_shape_problem(tiny, 1, (64, 64)) is None
    qwen8b = ModelConfig(
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_layers=2,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        vocab_size=151936,
    )
    for tp in (1, 2, 8, 16):  # at 16 each rank holds one replicated KV head: 128 wide
        assert block_quant_shape_problem(qwen8b, tp, (128, 128)) is None
    assert "o_proj input per tensor-parallel rank is 256" in block_quant_shape_problem(
        qwen8b, 16, (128, 512)
    )
    # A MoE model: the experts' width (Fp8MoEMethod.create_weights), not the dense MLP's.
    a3b = dataclasses.replace(qwen8b, num_experts=128, moe_topk=8, moe_ffn_hidden_size=768)
    assert block_quant_shape_problem(a3b, 2, (128, 128)) is None  # 384 per rank
    assert "experts' down_proj input per tensor-parallel rank is 192" in (
        block_quant_shape_problem(a3b, 4, (64, 128))
    )
    narrow = dataclasses.replace(a3b, moe_ffn_hidden_size=96)
    assert "experts' gate_proj / up_proj output per tensor-parallel rank is 96" in (
        block_quant_shape_problem(narrow, 1, (128, 128))
    )
    bad = ["rollout.engine=sglang", "rollout.fp8.weight_quant=blockwise"]
    with pytest.raises(ConfigError, match=r"rollout.fp8.weight_block=\[128, 128\] with "):
        load_config(None, bad).validate(1, this_machine=False)
    load_config(None, [*bad, "rollout.fp8.weight_block=[64,64]"]).validate(1, this_machine=False)
    load_config(None, [*bad, "rollout.sglang.device=cpu"]).validate(1, this_machine=False)


def test_cuda_ipc_handles_name_the_gpu_by_uuid():
    # IPC-2 (issue 43 #8): a CUDA IPC handle carries the sender's device ordinal, read in the
    # receiver's numbering; under per-task GPU binding that is another GPU. The sender puts the
    # device UUID at torch's storage_device argument, which SGLang's patched rebuild resolves.
    import inspect

    from torch.multiprocessing import reductions

    from megatron_rl_fp8.rollout.sglang import transports

    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params[transports.CUDA_DEVICE_ARG] == "storage_device"
    args = tuple(range(15))
    rebuild, out = transports.with_device_uuid(
        reductions.rebuild_cuda_tensor, args, lambda d: f"GPU-uuid-{d}"
    )
    assert out[transports.CUDA_DEVICE_ARG] == "GPU-uuid-6" and out[:6] == args[:6]
    assert out[7:] == args[7:] and rebuild is reductions.rebuild_cuda_tensor
    cpu = reductions.reduce_tensor(torch.ones(2))  # shared memory: no device to rename
    assert transports.with_device_uuid(*cpu, lambda d: "x") == cpu


@pytest.mark.sglang
def test_sglang_resolves_a_device_uuid_where_torch_has_the_ordinal(sglang_facts):
    """SGLang 0.5.23, ``utils/patch_torch.py``: ``monkey_patch_torch_reductions`` (run by
    ``tp_worker.py: deserialize_own_rank`` and ``update_weights_from_tensor`` before unpickling)
    replaces ``reductions.rebuild_cuda_tensor``, so a pickle naming torch's function reaches the
    patched one; it maps argument ``_REDUCE_TENSOR_ARG_DEVICE_INDEX`` from a UUID (or an int,
    kept) to the server's ordinal."""
    from megatron_rl_fp8.rollout.sglang.transports import CUDA_DEVICE_ARG

    assert sglang_facts["uuid_patch"] == {
        "device_arg": CUDA_DEVICE_ARG,
        "rebuild_patched": True,
        "ordinal_passes": 0,
    }


def test_fp8_engines_on_blackwell_start_without_deepgemm(monkeypatch):
    # SG-12 (issue 43 #7): on sm100+, SGLang 0.5.23's DeepGEMM path requantizes block-FP8 weights
    # to UE8M0 and repacks the scales once, at load (fp8_utils.py:
    # requant_block_scale_ue8m0_for_deepgemm; early return on format_ue8m0), so synced
    # checkpoint-format scales no longer fit. Hopper's DeepGEMM reads the live scales.
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
    from megatron_rl_fp8.rollout.sglang.process import DEEPGEMM, fp8_engine_env, server_env

    assert fp8_engine_env([(9, 0), (9, 0)]) == {}
    assert fp8_engine_env([(10, 0)]) == {DEEPGEMM: "0"}
    assert fp8_engine_env([(9, 0), (12, 0)]) == {DEEPGEMM: "0"}
    assert fp8_engine_env([]) == {}
    monkeypatch.delenv(DEEPGEMM, raising=False)
    # This machine has no GPU: nothing to switch, whatever the checkpoint.
    assert DEEPGEMM not in server_env(SGLangConfig(), "cuda", fp8_checkpoint=True)
    from megatron_rl_fp8.rollout.sglang import process

    monkeypatch.setattr(process, "_visible_capabilities", lambda: [(10, 0)])
    assert server_env(SGLangConfig(), "cuda", fp8_checkpoint=True)[DEEPGEMM] == "0"
    assert DEEPGEMM not in server_env(SGLangConfig(), "cuda")  # BF16 engines keep DeepGEMM
    mine = SGLangConfig(env={DEEPGEMM: "1"})
    assert server_env(mine, "cuda", fp8_checkpoint=True)[DEEPGEMM] == "1"  # the user's choice
