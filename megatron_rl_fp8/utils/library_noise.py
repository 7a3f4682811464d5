"""Library messages that tell the user nothing, filtered where they are raised.

A run's first screen should be the project's own lines. Four libraries print among them on a CPU
box, about pieces this project does not use or cannot change:

* Megatron-Core warns at import, once per module, that Apex (and Transformer Engine) are absent
  and it falls back to torch's norm, optimizers and multi-tensor helpers. The project never uses
  Apex, and it says itself which FP8 backend a run uses (the actor line) and refuses a backend
  whose package is missing, with the install command.
* torchao, imported by transformers' quantizer registry to check its version, logs one
  "Failed to load ... _C_*.so" line per CUDA extension it cannot load where there is no CUDA.
* torchao registers its enums as pytree constants, which torch 2.13 logs as deprecated (twice).
* torch warns that ShardedTensor is deprecated for DTensor each time Megatron's checkpointing
  (``dist_checkpointing``, its torch_dist format) builds one, at every save and load. Which module
  the warning names depends on the call's stack depth, so it is matched by its words alone. At
  every load torch also warns that ``load_state_dict`` (which Megatron calls) is deprecated.
* modelopt warns that the installed transformers is newer than the ones it was tested with. This
  project installs both and checks modelopt's FP8 quantization in that install against its own
  (tests/unit/test_fp8_modelopt.py), which is what the warning asks the user to worry about.

Each filter matches its library's logger or module and the message's own words, nothing
broader: any other warning from these libraries still shows, and on a machine with CUDA the
torchao extension lines show too (there, a kernel that does not load matters).
"""

from __future__ import annotations

import logging
import os
import warnings

# Megatron-Core's import-time fallbacks (megatron/core/optimizer/__init__.py, models/backends.py,
# ...): "Transformer Engine and Apex are not installed. Falling back to ..." and "Apex is not
# installed. Falling back to Torch Norm".
_MEGATRON_FALLBACK = r"(Transformer Engine and )?Apex (is|are) not installed\. Falling back"
# modelopt/torch/__init__.py: "transformers 5.25.0 is not tested with current version of modelopt".
_MODELOPT_UNTESTED = r"transformers [\w.+-]+ is not tested with current version of modelopt"
# torch's, from Megatron's dist_checkpointing (save and load).
_SHARDED_TENSOR = r"Please use DTensor instead and we are deprecating ShardedTensor"
_LOAD_STATE_DICT = r"`load_state_dict` is deprecated and will be removed in future versions"


class _DropMessages(logging.Filter):
    """Drops a logger's records whose formatted message contains any of ``fragments``."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


_installed = False


def quiet_library_noise() -> None:
    """Install the filters, before the libraries are imported (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    warnings.filterwarnings(
        "ignore", message=_MEGATRON_FALLBACK, category=UserWarning, module=r"megatron\.core"
    )
    warnings.filterwarnings(
        "ignore", message=_MODELOPT_UNTESTED, category=UserWarning, module=r"modelopt\.torch"
    )
    warnings.filterwarnings("ignore", message=_SHARDED_TENSOR, category=FutureWarning)
    warnings.filterwarnings(
        "ignore",
        message=_LOAD_STATE_DICT,
        category=FutureWarning,
        module=r"megatron\.core\.dist_checkpointing",
    )
    logging.getLogger("torch.utils._pytree").addFilter(
        _DropMessages("is an Enum subclass and is now natively supported by torch.compile")
    )
    if not _has_cuda():
        logging.getLogger("torchao").addFilter(_DropMessages("Failed to load "))


def _has_cuda() -> bool:
    # Without importing torch (the CLI's start-up stays light): a CUDA machine has the NVIDIA
    # driver's control device; CUDA_VISIBLE_DEVICES="" hides it from torch, as the test suite does.
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return os.path.exists("/dev/nvidiactl")
