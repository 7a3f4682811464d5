"""The default test run is the CPU suite, and it gives the same verdict on any machine.

Where a GPU is visible, unmarked tests still run on the CPU: they compare against CPU references,
spawn several ranks that would otherwise share one GPU, and must pass on a GPU box exactly as in
CI. So CUDA is hidden (``CUDA_VISIBLE_DEVICES=""``) from this process and from every rank and
subprocess it starts, unless the run selects the ``gpu`` marker (``pytest -m gpu``, as
``scripts/gpu_check.sh`` does): then the GPU tests run on the GPU. Set ``MRF8_TEST_KEEP_CUDA=1`` to
keep CUDA visible anyway.
"""

import os

CPU_SUITE_ENV = "MRF8_CPU_SUITE"


def _selects_gpu_tests(markexpr: str) -> bool:
    expr = " ".join(markexpr.split())
    return "gpu" in expr and "not gpu" not in expr


def pytest_configure(config):
    _share_cores_between_workers()
    if os.environ.get("MRF8_TEST_KEEP_CUDA") == "1":
        return
    if _selects_gpu_tests(config.getoption("markexpr") or ""):
        return
    # Before anything initialises CUDA: torch reads this at its first CUDA call.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ[CPU_SUITE_ENV] = "1"


def _share_cores_between_workers():
    """Under pytest-xdist (``make test`` runs ``-n 2``), each worker and every process it starts
    (ranks, CLI runs) gets its share of the cores as threads: two workers of two threads each on
    two cores would time-slice every intra-op parallel region (OpenMP spins) and run slower than
    one. A thread count set by the caller (``OMP_NUM_THREADS``) is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // workers))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """One tiny Hugging Face model folder (Qwen3 + BPE tokenizer + chat template + two end ids,
    ``megatron_rl_fp8/data/tiny_hf.py``) shared by every test that starts from a checkpoint."""
    from megatron_rl_fp8.data.tiny_hf import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("hf") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_sft_cache(tmp_path_factory):
    """The ``train.cache_dir`` of the tiny job's end-to-end runs: their SFT warm start (cached by
    content: model, task, tokenizer, ``sft.*``, seed; precision excluded) is computed once per
    session for every test that asks for the same SFT settings. Under pytest-xdist the workers
    share it (the directory above each worker's own): the warm start's own lock lets one worker
    build an entry while another waits for it, as two runs on one cache do."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "tiny_sft_cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("tiny_sft_cache")
