#!/usr/bin/env bash
# Install SGLang's CPU engine into its own venv (default .venv-sglang), for the SGLang rollout
# engine on CPU boxes (CI, laptops). Idempotent: a stamp file records what was installed.
#
#   scripts/install_sglang_cpu.sh [VENV_DIR]
#
# Why a separate venv: `pip install sglang` pins torch 2.14.1 (a multi-GB CUDA build on this kind
# of box), transformers 5.19.0 and CUDA-only kernels. The trainer's venv must keep its own
# transformers / megatron-core, so the server runs from this venv and the trainer only talks to it
# over HTTP (rollout.sglang.python points at this venv's python).
#
# Recipe (docs/sglang.md, "Install"):
#   1. torch==2.13.0 (the CPU build; any other spec pulls CUDA torch);
#   2. sglang==0.5.23 --no-deps, then the pure-Python requirements its server imports;
#   3. import-time stand-ins for `sgl_kernel` (its CPU build is not on PyPI) and `torchvision`
#      (the PyPI build is CUDA-only). Every function they expose raises when called, so a code path
#      that really needs them fails loudly instead of computing something wrong.
# GPU clusters: do not use this script; `pip install sglang==0.5.23` in a CUDA environment.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"

# Pure-Python (or CPU-wheel) requirements of sglang 0.5.23 that the server's import path needs,
# with sglang's own pins where it has them. CUDA-only ones (flashinfer, deep-gemm, cutlass,
# sglang-kernel, quack, tilelang, torchaudio/torchcodec ...) are deliberately absent.
REQUIREMENTS=(
  "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
  "xgrammar==0.2.7" "llguidance>=1.7.6,<2.0.0" "openai==2.8.0" "openai-harmony==0.0.4"
  "soundfile==0.13.1" "numba==0.65.1" "outlines==0.1.11" "blobfile==3.0.0"
  aiohttp anthropic blobfile distro easydict einops fastapi gguf interegular IPython msgspec ninja
  numpy orjson packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64
  pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy setproctitle
  tiktoken tqdm "uvicorn>=0.51" uvloop watchfiles xxhash zstandard dill mistral_common
  safetensors huggingface_hub pyyaml
  "sglang-router==0.3.2"
)
STAMP="$VENV/.sglang-cpu-installed"
WANT="sglang=$SGLANG_VERSION torch=$TORCH_VERSION $(printf '%s\n' "${REQUIREMENTS[@]}" | sha256sum | cut -c1-16) stubs=2"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "SGLang CPU engine already installed in $VENV"
  exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# Keep torch at the CPU build whatever a requirement asks for.
CONSTRAINTS="$VENV/sglang-cpu-constraints.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH_VERSION"
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$PY" -m pip install -q -c "$CONSTRAINTS" "${REQUIREMENTS[@]}"

# Stand-ins. They are real importable packages (no dist-info, so `importlib.metadata` and
# transformers' availability checks still report them absent) whose attributes are callables that
# raise, including attributes of any submodule (sgl_kernel.<anything>).
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
write_standin() {  # $1 = package name, $2 = why it is missing
  local pkg="$1" why="$2"
  mkdir -p "$SITE/$pkg"
  cat > "$SITE/$pkg/__init__.py" <<EOF
"""Import-time stand-in for \`$pkg\` written by megatron-rl-fp8's scripts/install_sglang_cpu.sh.

$why Importing works (SGLang imports it at module top on every device); calling anything raises.
"""
import importlib.abc
import importlib.machinery
import sys
import types

_WHY = "$pkg is a stand-in on this CPU install ($why)"


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}() called, but {_WHY}")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __repr__(self):
        return f"<unavailable {self._name}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("$pkg."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        """Nothing to execute: every attribute of a stand-in raises when used."""


sys.meta_path.append(_Finder())
sys.modules[__name__].__class__ = _StandinModule
__version__ = "0.0.0+standin"
EOF
}
write_standin sgl_kernel "its CPU build is not published on PyPI"
write_standin torchvision "the PyPI build is CUDA-only"

# The server must at least import; fail here, not at the first rollout.
SGLANG_USE_CPU_ENGINE=1 "$PY" -c "import sglang.srt.entrypoints.http_server" \
  || { echo "SGLang installed in $VENV but its server does not import (see above)" >&2; exit 1; }
echo "*" > "$VENV/.gitignore"  # keep the venv out of git status
echo "$WANT" > "$STAMP"
echo "SGLang $SGLANG_VERSION CPU engine installed in $VENV (server python: $PY)"
