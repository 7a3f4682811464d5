"""Write a whole output directory or nothing: stage next to ``--out``, fsync, rename.

The output is built in ``<parent>/.<name>.partial`` (same filesystem, so the final ``rename`` is
atomic). On any error the staging directory is removed and ``--out`` is untouched. On success every
file and directory under it is fsynced before the rename, and the parent directory after it, so a
crash never leaves a directory named ``--out`` with missing bytes. With several ranks (torchrun),
rank 0 owns the directory operations and the others wait at barriers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.utils.fs import fsync_dir, storage_refusal


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def check_not_input(out: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """Refuse an ``out`` that overlaps an input (``{"--hf": path, ...}``; None = flag not given).

    Replacing ``out`` deletes it, so ``out`` must not be an input or hold one; writing inside an
    input would mix the output into it; and an input must not be (inside) one of the staging
    directories next to ``out``, which are deleted too. Paths are compared after ``resolve()``, so
    a symlink or ``..`` cannot hide the overlap. Checked with or without ``--overwrite``.
    """
    o = Path(out).resolve()
    a = Path(out).absolute()  # staged_output names its siblings after the unresolved path
    staging = [(a.parent / f".{a.name}{s}").resolve() for s in (".partial", ".old")]
    for flag, path in inputs.items():
        if path is None:
            continue
        i = Path(path).resolve()
        if i == o:
            relation = "is"
        elif o in i.parents:
            relation = "contains"
        elif i in o.parents:
            relation = "is inside"
        else:
            hit = [t for t in staging if t == i or t in i.parents]
            if not hit:
                continue
            relation = f"is staged in {hit[0]}, which is or holds"
        raise ConvertError(
            f"--out {out} {relation} {flag} {path}; choose an --out outside every input "
            "(replacing it would delete or mix into the input)"
        )


def check_output(
    out: Path, *, overwrite: bool, inputs: dict[str, str | Path | None] | None = None
) -> None:
    """Fail before any work if ``out`` overlaps an input, or holds something without ``overwrite``."""
    check_not_input(out, inputs or {})
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConvertError(f"--out {out} exists and is not empty; pass --overwrite to replace it")
    if not out.exists():
        _check_creatable(out)


def _check_creatable(out: Path) -> None:
    """``out`` can be made: its nearest existing ancestor is a directory this user can create a
    directory in (tried with one that is removed again, so nothing is left behind)."""
    above = next(a for a in Path(out).absolute().parents if a.exists())
    if not above.is_dir():
        raise ConvertError(
            f"--out {out} cannot be created: {above} is a file; choose another --out"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".convert-probe-", dir=above))
    except OSError as e:
        raise ConvertError(
            f"--out {out} cannot be created in {above} ({e.strerror or e}); choose another --out"
        ) from None


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


@contextlib.contextmanager
def staged_output(out: str | Path, *, overwrite: bool = False, rank: int = 0, world: int = 1):
    """Yield the staging directory; on clean exit it becomes ``out`` (see module docstring)."""
    out = Path(out).absolute()
    check_output(out, overwrite=overwrite)
    tmp = out.parent / f".{out.name}.partial"
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crashed run
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier(world)
    try:
        yield tmp
        _barrier(world)
    except BaseException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_refusal(e, out)
        raise
    if rank == 0:
        try:
            fsync_tree(tmp)
            old = None
            if out.exists() and any(out.iterdir()):
                old = out.parent / f".{out.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(out, old)
            os.replace(tmp, out)  # replaces an empty directory too
            fsync_dir(out.parent)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            _raise_refusal(e, out)
            raise
    _barrier(world)


def _raise_refusal(e: BaseException, out: Path) -> None:
    """A write the storage refused (full disk, quota, permission) as one line; else nothing."""
    if isinstance(e, Exception) and (refusal := storage_refusal(e, out.parent)) is not None:
        raise ConvertError(
            f"cannot write --out {out}: {refusal}; the partial output was removed and --out is "
            "as it was"
        ) from e
