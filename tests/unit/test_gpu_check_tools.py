"""The GPU check's pieces run on a CPU box: bench_gemm / bench_actor ``--cpu-smoke`` and
bench_sync ``--quantizers --small`` produce tables and JSON that parse, FP8 rows say why they are
unavailable, and gpu_check.sh stops early with a clear message when there is no CUDA GPU. (On a GPU node the same scripts run for real:
``make gpu-check``; see docs/gpu.md.)"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _table_rows(stdout: str) -> list[list[str]]:
    """Cells of the markdown table rows in ``stdout`` (header and separator excluded)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert len(lines) >= 3 and set(lines[1].replace("|", "")) <= set("-: "), stdout
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_bench_gemm_cpu_smoke(tmp_path):
    bench_gemm = load_script("benchmarks/bench_gemm.py")
    out = _run(
        [
            sys.executable,
            "benchmarks/bench_gemm.py",
            "--cpu-smoke",
            "--tokens",
            "64,128",
            "--json",
            str(tmp_path / "gemm.json"),
        ]
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "gemm.json").read_text())["rows"]
    table = _table_rows(out.stdout)
    # two token counts x two shapes x (bf16, fp32, four FP8 methods)
    assert len(table) == len(rows) == 2 * 2 * 6
    assert sorted({r["M"] for r in rows}) == [64, 128]
    for r in rows:
        assert r["M"] * r["N"] * r["K"] > 0
        if r["method"] in ("bf16", "fp32"):
            assert r["status"] == "ok" and r["tflops"] > 0 and r["vs_bf16"] > 0
        else:
            assert r["method"] in bench_gemm.FP8_METHODS
            assert r["status"].startswith("unavailable") and r["tflops"] is None
    assert {r["vs_bf16"] for r in rows if r["method"] == "bf16"} == {1.0}
    bad = _run([sys.executable, "benchmarks/bench_gemm.py", "--cpu-smoke", "--tokens", "100"])
    assert (
        bad.returncode == 2
        and "--tokens '100': each must be a positive multiple of 16" in bad.stderr
    )
    # The GPU shapes are the models' published linear shapes (see the module docstring).
    assert bench_gemm.SHAPES["Qwen3-8B"]["qkv"] == ((32 + 2 * 8) * 128, 4096)
    assert bench_gemm.SHAPES["Qwen3-32B"]["o"] == (5120, 64 * 128)


def test_bench_actor_cpu_smoke(tmp_path):
    out = _run(
        [
            sys.executable,
            "benchmarks/bench_actor.py",
            "--cpu-smoke",
            "--varlen",
            "--configs",
            "base,budget",
            "--peak-tflops",
            "0.5",
            "--profile",
            "4",
            "--json",
            str(tmp_path / "actor.json"),
        ]
    )
    assert out.returncode == 0, out.stderr
    base, budget = json.loads((tmp_path / "actor.json").read_text())
    # --profile: one more step's operators, the 4 largest listed, every kind's share adding up
    prof = base["profile"]
    assert len(prof["top"]) == 4 and prof["top"][0]["ms"] >= prof["top"][-1]["ms"] > 0
    assert sum(prof["kinds"].values()) == pytest.approx(1.0) and "GEMM" in prof["kinds"]
    assert (
        "base / bf16: one step's" in out.stdout and "| operator | kind | ms | share |" in out.stdout
    )
    assert (base["rows"], base["seq"], base["micro_batch"], base["layers"]) == (4, 16, 2, 2)
    # Lengths 4, 8, 12, 16 (--varlen): 40 real tokens, packed under a 32-token budget.
    assert base["real_tokens"] == budget["real_tokens"] == 40
    assert (base["max_tokens_per_gpu"], budget["max_tokens_per_gpu"]) == (None, 32)
    assert base["step_s"] > 0 and base["tokens_per_s"] == pytest.approx(40 / base["step_s"])
    assert base["mfu"] == pytest.approx(base["model_tflops"] / 0.5)
    # Host tensors from the profiler: weights + fp32 grads + Adam of ~0.09M parameters, at least.
    assert base["peak_mem_gb"] > 0.09e6 * 16 / 1e9
    rows = _table_rows(out.stdout.split("base / bf16: one step's")[0])  # before the profiles
    assert [r[0] for r in rows] == ["base", "budget"]
    assert rows[0][1] == "cpu x 1" and float(rows[0][6]) > 0 and rows[0][7] == "1.00x"
    assert "parameters on this rank" in out.stdout


def test_bench_actor_fp8_rows_through_the_real_fp8_backends(tmp_path):
    """gpu_check's bench_actor rows (BF16, the torch backend, torchao) run their own code paths
    end to end (CPU torch's ``_scaled_mm`` behind tests/scaled_mm_stand_in.py): each row is
    measured and profiled, its ratio is against the BF16 row. Times mean nothing here."""
    pytest.importorskip("torchao")
    fp8 = "bf16,torch:tensorwise_current,torchao:tensorwise_current"
    out = _run(
        [sys.executable, "tests/scaled_mm_stand_in.py", "benchmarks/bench_actor.py", "--cpu-smoke",
         "--fp8", fp8, "--profile", "2", "--json", str(tmp_path / "actor.json")]
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "actor.json").read_text())
    assert [r["fp8"] for r in rows] == fp8.split(",")
    assert all(r["step_s"] > 0 and "GEMM" in r["profile"]["kinds"] for r in rows)
    assert "FP8 tensorwise_current (torch._scaled_mm)" in out.stdout
    assert "FP8 tensorwise_current (torchao float8)" in out.stdout
    table = _table_rows(out.stdout.split("one step's")[0])
    assert [r[3] for r in table] == fp8.split(",") and table[0][7] == "1.00x"


def test_bench_sync_quantizers_cpu_smoke(tmp_path, capsys):
    """In process (modelopt's import is paid once per test session, not once more here); the
    thread count passed is the current one, so the run leaves this process's setting alone."""
    bench_sync = load_script("benchmarks/bench_sync.py")
    args = ["--quantizers", "--device", "cpu", "--small", "--reps", "1"]
    threads = ["--threads", str(torch.get_num_threads()), "--json", str(tmp_path / "q.json")]
    bench_sync.main(args + threads)
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert len(_table_rows(out)) == len(rows) == 2 * len(bench_sync.SMALL_LINEARS)
    assert {r["dtype"] for r in rows} == {"bfloat16", "float32"}
    for r in rows:
        assert r["codes_differ"] == 0 and r["scales_identical"], r
        assert r["builtin_gbps"] > 0 and r["modelopt_gbps"] > 0
    assert all(row[-1] == "True (0)" for row in _table_rows(out))
    ratios = [r["ratio"] for r in rows]
    assert out.splitlines()[-1] == (
        f"modelopt/builtin time ratio: {min(ratios):.2f}-{max(ratios):.2f}"
    )
    assert bench_sync.QWEN3_8B_LINEARS["gate_proj / up_proj"] == (12288, 4096)


def test_actor_flops_match_qwen3_published_sizes():
    """The FLOP count's parameter arithmetic reproduces Qwen3-1.7B's model card (1.7B, 1.4B
    non-embedding, tied embeddings); the benchmark unties the output layer: 2.03B."""
    bench_actor = load_script("benchmarks/bench_actor.py")
    mc = bench_actor.model_config(False, 2048)
    fpt, params = bench_actor.flops_per_token(mc, 2048)
    assert params == pytest.approx(2.03e9, rel=0.005)
    tied = dataclasses.replace(mc, tie_word_embeddings=True)
    _, tied_params = bench_actor.flops_per_token(tied, 2048)
    embedding = mc.hidden_size * mc.vocab_size
    assert tied_params == pytest.approx(1.72e9, rel=0.01)
    assert tied_params - embedding == pytest.approx(1.41e9, rel=0.01)
    # 6 FLOPs per weight per token, plus attention: 12 * layers * seq * heads * head_dim.
    assert fpt == pytest.approx(6 * (params - embedding) + 12 * 28 * 2048 * 16 * 128, rel=1e-3)


def test_actor_shapes_of_larger_models_with_fewer_layers(capsys):
    """``--shape`` / ``--layers``: a preset's layers (the GEMM shapes of an 8B or 32B model), as
    deep as one GPU holds. At full depth the parameter count is the model card's: Qwen3-8B 8.2B,
    Qwen3-32B 32.8B (untied output layers)."""
    bench_actor = load_script("benchmarks/bench_actor.py")
    mc = bench_actor.model_config(False, 2048, shape="qwen3-8b", layers=8)
    assert (mc.num_layers, mc.hidden_size, mc.ffn_hidden_size) == (8, 4096, 12288)
    full = {"qwen3-8b": 8.19e9, "qwen3-32b": 32.76e9}
    for shape, card in full.items():
        _, params = bench_actor.flops_per_token(
            bench_actor.model_config(False, 2048, shape=shape), 2048
        )
        assert params == pytest.approx(card, rel=0.005), shape
    for argv, msg in (
        (["--shape", "qwen3-8b", "--cpu-smoke"], "--cpu-smoke and --cpu-small have their own"),
        (["--layers", "-1"], "--layers -1: give a positive number"),
    ):
        with pytest.raises(SystemExit):
            bench_actor.main(argv)
        assert msg in capsys.readouterr().err


@cpu_only
def test_gpu_check_stops_clearly_without_a_gpu(tmp_path):
    env_python = {"PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--out", str(tmp_path / "o")],
        cwd=ROOT,
        env={**os.environ, **env_python},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA GPU" in out.stdout
    assert "torch " in (tmp_path / "o" / "versions.txt").read_text()
    assert not (tmp_path / "o" / "runs").exists()  # stopped before the jobs


def test_bench_actor_profile_kinds_from_kernel_names():
    """GPU kernel names as the profiler reports them (H100/H200, torch 2.x) sorted into kinds."""
    bench_actor = load_script("benchmarks/bench_actor.py")
    kinds = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "GEMM",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT": "GEMM",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits": (
            "attention"
        ),
        "void (anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float>": "attention",
        "void cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>": "loss",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": (
            "communication"
        ),
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>": "optimizer",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>": "norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": (
            "other"
        ),
    }
    for name, kind in kinds.items():
        assert bench_actor.kernel_kind(name) == kind, name


def test_bench_actor_fp8_entries_and_ratios_against_bf16():
    """``--fp8``: entries are checked before anything is built, and each row's ratios are
    against its configuration's BF16 row."""
    bench_actor = load_script("benchmarks/bench_actor.py")
    entries = bench_actor.parse_fp8("bf16, torch:tensorwise_current,rowwise,emulate:mxfp8")
    assert [label for label, _ in entries] == [
        "bf16",
        "torch:tensorwise_current",
        "rowwise",
        "emulate:mxfp8",
    ]
    assert entries[1][1] == {"recipe": "tensorwise_current", "backend": "torch"}
    assert entries[2][1] == {"recipe": "rowwise", "backend": "auto"}
    with pytest.raises(ValueError, match="--fp8 entry 'te:rowwise': FP8Config.backend='te'"):
        bench_actor.parse_fp8("bf16,te:rowwise")
    compiled = bench_actor.parse_fp8("torch:rowwise+compile")
    assert compiled == [
        ("torch:rowwise+compile", {"recipe": "rowwise", "backend": "torch", "compile_casts": True})
    ]
    with pytest.raises(ValueError, match="the only suffix is '\\+compile'"):
        bench_actor.parse_fp8("torch:rowwise+fused")
    with pytest.raises(
        ValueError, match="compile_casts=True applies to backends 'torch' and 'torchao' only"
    ):
        bench_actor.parse_fp8("emulate:rowwise+compile")

    def row(config, fp8, recipe, tokens_per_s):
        return {
            "config": config, "fp8": fp8, "fp8_recipe": recipe, "device": "H200", "ranks": 1,
            "params_b": 2.03, "rows": 8, "seq": 2048, "max_tokens_per_gpu": None,
            "micro_batch": 2, "step_s": 1.0, "tokens_per_s": tokens_per_s, "mfu": None,
            "peak_mem_gb": 80.0,
        }  # fmt: skip

    results = [
        row("base", "bf16", "bf16", 100.0),
        row("base", "torch:tensorwise_current", "tensorwise_current", 150.0),
        row("recompute", "bf16", "bf16", 50.0),
        row("recompute", "torch:rowwise", "rowwise", 60.0),
    ]
    table = _table_rows(bench_actor.markdown(results))
    assert [(r[3], r[7]) for r in table] == [
        ("bf16", "1.00x"),
        ("torch:tensorwise_current", "1.50x"),
        ("bf16", "1.00x"),
        ("torch:rowwise", "1.20x"),
    ]


def test_bench_rollout_parse_cpu_smoke(capsys, monkeypatch):
    import runpy
    import sys

    script = str(ROOT / "benchmarks" / "bench_rollout_parse.py")
    argv = [
        script,
        "--tokens",
        "64",
        "--answers",
        "2",
        "--steps",
        "2",
        "--layers",
        "2",
        "--reps",
        "1",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(script, run_name="__main__")
    out = capsys.readouterr().out
    assert "| alone |" in out and "| with a thread parsing answers |" in out
    bench = runpy.run_path(script)  # the canned answer is one parse_completion accepts
    bench["parse_all"](bench["canned_answer"](5), 1)
