"""The first screen's filters drop the libraries' exact messages and nothing beside them: the
texts below are the ones Megatron-Core 0.16.1, modelopt 0.47, torchao 0.18.0 and torch 2.13
print on a CPU box
(the end-to-end check is tests/integration/test_tiny_run.py's first-screen test)."""

import logging
import warnings

import pytest

from megatron_rl_fp8.utils import library_noise

MEGATRON = [
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", True),
    ("Apex is not installed. Falling back to Torch Norm", True),
    (
        "Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier and multi_tensor_scale",
        True,
    ),  # fmt: skip
    ("Transformer Engine is not installed. Falling back to nothing", False),
    ("moe_router_load_balancing_type is deprecated", False),
]
MODELOPT = [
    "transformers 5.25.0 is not tested with current version of modelopt and may cause issues.",
    "modelopt says something else",
]
TORCHAO = "Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
PYTREE = (
    "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile "
    "as an opaque value type. Calling register_constant() on Enum subclasses is deprecated"
)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


@pytest.fixture
def quiet(monkeypatch):
    """Installs the filters afresh (``cuda`` chosen by the test) and removes them afterwards."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    handler = _Collect()
    for lg in loggers:
        lg.addHandler(handler)

    def install(cuda: bool):
        monkeypatch.setattr(library_noise, "_installed", False)
        monkeypatch.setattr(library_noise, "_has_cuda", lambda: cuda)
        library_noise.quiet_library_noise()
        return handler

    with warnings.catch_warnings():  # the warning filter goes with this block
        yield install
    for lg in loggers:
        lg.removeHandler(handler)
        lg.filters = [f for f in lg.filters if not isinstance(f, library_noise._DropMessages)]


def test_library_notices_are_dropped_and_their_other_warnings_kept(quiet):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet(cuda=False)  # its filter goes on top of "always"
        for text, _ in MEGATRON:
            warnings.warn_explicit(text, UserWarning, "megatron/core/x.py", 1, "megatron.core.x")
        # The same words from another package are not Megatron's fallback notice.
        warnings.warn_explicit(MEGATRON[0][0], UserWarning, "other.py", 1, "other")
        sharded = "Please use DTensor instead and we are deprecating ShardedTensor."
        warnings.warn_explicit(
            sharded, FutureWarning, "strategies/torch.py", 799, "megatron.core.x"
        )
        warnings.warn_explicit(sharded, UserWarning, "elsewhere.py", 1, "elsewhere")
        load = "`load_state_dict` is deprecated and will be removed in future versions. Please use"
        for module in ("megatron.core.dist_checkpointing.strategies.torch", "mine"):
            warnings.warn_explicit(load, FutureWarning, "torch.py", 799, module)
        for text in MODELOPT:
            warnings.warn_explicit(
                text, UserWarning, "modelopt/torch/__init__.py", 55, "modelopt.torch"
            )
    kept = [str(w.message) for w in caught]
    want = [text for text, dropped in MEGATRON if not dropped]
    want += [MEGATRON[0][0], "Please use DTensor instead and we are deprecating ShardedTensor."]
    want += ["`load_state_dict` is deprecated and will be removed in future versions. Please use"]
    want += [MODELOPT[1]]
    assert kept == want


@pytest.mark.parametrize("cuda", [False, True])
def test_torchaos_extension_lines_are_dropped_only_without_cuda(quiet, cuda):
    seen = quiet(cuda=cuda).seen
    torchao = logging.getLogger("torchao")
    torchao.warning(TORCHAO)
    torchao.warning("torchao: something else")
    logging.getLogger("torch.utils._pytree").warning(PYTREE)
    logging.getLogger("torch.utils._pytree").warning("a pytree warning of another kind")
    kept = ["torchao: something else", "a pytree warning of another kind"]
    assert seen == ([TORCHAO] if cuda else []) + kept
