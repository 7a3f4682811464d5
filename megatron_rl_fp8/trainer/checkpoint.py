"""Checkpoints you can trust: Megatron ``dist_checkpointing`` (torch_dist) + a JSON trainer state,
written atomically, with a manifest of every file, verified before a resume.

Layout under ``<output_dir>/checkpoints``::

    iter_0000010/
        __<rank>_<k>.distcp   each rank's shards (dist_checkpointing torch_dist)
        .metadata, common.pt, metadata.json
                              the global index and common state (written by rank 0)
        trainer_state.json    step, dataset position, calibration state, ...
        rank_state/<rank>.pt  what each rank holds that no other rank has (FP8 delayed-scaling
                              amax histories); only when there is some
        manifest.json         every other file: size in bytes and crc32; written last
    latest                    text file naming the last complete checkpoint

**Writing** (:func:`save`). A checkpoint is written into ``iter_XXXXXXX.tmp``. Right after its
write, each rank checksums the shard files it wrote (``__<rank>_*.distcp``: the bytes are still
in its page cache, and the hashing of a large checkpoint is spread over all ranks); rank 0 gathers
the results, writes ``trainer_state.json``, checksums its own files and anything no rank claimed,
and writes ``manifest.json`` last (atomically). Only then is the directory renamed and ``latest``
replaced. A crash mid-save leaves the previous checkpoint as ``latest`` and a stale ``.tmp`` that
the next :func:`prune` removes. Because dist_checkpointing stores global shapes, a checkpoint
loads into any TP/PP layout.

**Choosing what to resume** (:func:`find_resumable`, :func:`load_newest_intact`). Candidates are
tried newest first: the one ``latest`` names (an empty, unreadable or dangling ``latest`` is said
and skipped, never a reason to restart from step 0), then every other complete ``iter_*``. A
candidate is intact when ``manifest.json`` and ``trainer_state.json`` parse and every listed file
is there with its size (``train.checkpoint_verify``):

* ``sizes``: a ``stat`` per file, no data read. Catches missing and truncated files (the usual
  damage: a full disk, a killed copy, a deleted file). It does **not** catch bytes changed in
  place: a shard overwritten with the same length passes and loads wrong values silently.
* ``full``: also recomputes every file's crc32, the files spread over the ranks by size, so the
  cost is one more read of the checkpoint, shared by all ranks (about what a load reads).

Each rejected candidate gets one line naming the file and what is wrong, then the next is tried;
a candidate that passes but still fails to load, or loads NaN or inf values (none is ever saved),
on any rank (all ranks agree) is rejected the same way. A trainer state without the keys the
caller requires (``required``: ``step`` and the data position for a run) is damage too. If checkpoints exist but none is intact, :class:`ConfigError` says so: existing
checkpoints are never silently replaced by a fresh start. Checkpoints without a manifest (written
before manifests existed) are accepted, said to be unverified, when ``trainer_state.json`` parses
and ``.metadata`` exists.

**Retention** (:func:`prune`): the newest ``train.keep_checkpoints``, plus the ones the caller
protects (the stability guard's last healthy checkpoint), plus the one ``latest`` names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.utils.fs import StorageError, atomic_write_text, fsync_dir, storage_refusal

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RANK_STATE = "rank_state"
"""Directory of the per-rank state files, and the key :func:`load` returns their content under."""
MANIFEST_FORMAT = 1
# zlib's crc32, streamed in 8 MiB chunks: in memory 2.1 GB/s on one core of the project's CPU
# machine (sha1 1.5, sha256 1.4, md5 0.6, blake2b 0.6), ~1.6 GB/s reading a file from the page
# cache (tools/bench_checkpoint.py). It detects accidental damage (torn writes, bad copies, bit
# rot), which is all a manifest is for; it is no defence against a shard forged on purpose.
CHECKSUM = "crc32"
_CHUNK = 8 << 20
_ITER = re.compile(r"iter_(\d+)")
VERIFY_MODES = ("sizes", "full")
NONFINITE = "non-finite values"


class CheckpointError(Exception):
    """A checkpoint could not be read. ``reason`` is the underlying error in one line."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot load checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason


# -- writing -------------------------------------------------------------------------------------
def save_sharded(sharded_state_dict: dict, path: str | Path) -> None:
    """``dist_checkpointing.save`` (collective) without a helper process that can outlive us.

    Megatron's torch_dist writer hands each rank's write results back through a queue it makes
    with ``multiprocessing.get_context("spawn").Manager()``: a server process, created at the
    first save, that is not tied to the trainer and survives a kill -9 of it (two ~330 MB orphans
    per killed run). Our saves are synchronous: the results are produced and consumed inside this
    call, in this process, so a thread queue carries them and no server is started. (The writer's
    forked per-file workers are joined inside the call.) Megatron creates its queue only while the
    module global is None, so setting it first is all it takes.
    """
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(path))


def file_checksum(path: Path) -> str:
    """crc32 of a file's bytes as 8 hex digits, streamed (memory: one 8 MiB buffer)."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _describe(root: Path, files: Iterable[Path]) -> dict[str, dict]:
    return {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, CHECKSUM: file_checksum(p)}
        for p in files
    }


def save(
    ckpt_root: str | Path,
    name: str,
    sharded_state_dict: dict,
    trainer_state: dict,
    rank_state: dict | None = None,
    *,
    latest: bool = True,
) -> Path:
    """Collective over all ranks. Returns the final directory (module docstring: the layout).
    ``rank_state``: this rank's own state (tensors and plain values), kept when not empty.
    ``latest=False`` leaves ``ckpt_root/latest`` alone (a directory of unrelated entries, such as
    the warm-start cache, that other processes write at the same time).

    A write the storage refuses (full disk, quota, read-only, permission) on any rank is a
    :class:`StorageError` on every rank, naming the path and what ran out, with the partial
    ``.tmp`` removed and ``latest`` unchanged; any other failure is re-raised after the same
    clean-up."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(ckpt_root)
    final = root / name
    tmp = root / (name + ".tmp")
    rank, world = dist.get_rank(), dist.get_world_size()
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = e
    why = _from_rank0(_one_line(error) if error else None)
    if why is not None:  # nothing written yet
        _raise_save_error(error, why, tmp, name, root)
    mine: dict[str, dict] = {}
    try:
        save_sharded(sharded_state_dict, tmp)
        # torch_dist names a rank's files __<rank>_<k>.distcp; this rank's are complete (the
        # save is synchronous), so it hashes them now, while their bytes are in its page cache.
        files = sorted(tmp.glob(f"__{rank}_*.distcp"))
        if rank_state:
            (tmp / RANK_STATE).mkdir(exist_ok=True)
            torch.save(rank_state, tmp / RANK_STATE / f"{rank}.pt")
            files.append(tmp / RANK_STATE / f"{rank}.pt")
        mine = _describe(tmp, files)
    # torch's CheckpointException is a BaseException; dist_checkpointing raises it on every rank.
    except (Exception, CheckpointException) as e:
        error = e
    everyone = [None] * world if rank == 0 else None
    dist.gather_object((mine, _one_line(error) if error else None), everyone, dst=0)
    failed = None
    if rank == 0:
        failed = next(((r, why) for r, (_, why) in enumerate(everyone) if why), None)
        if failed is None:
            try:
                _publish(root, name, tmp, final, trainer_state, everyone, latest)
            except OSError as e:
                error, failed = e, (0, _one_line(e))
    failed = _from_rank0(failed)
    if failed is not None:
        _raise_save_error(error, failed[1], tmp, name, root, failed_rank=failed[0])
    return final


def _publish(root, name, tmp, final, trainer_state, everyone, latest: bool) -> None:
    """Rank 0: trainer state, the manifest (last), the rename, then ``latest``."""
    atomic_write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1))
    files: dict[str, dict] = {}
    for part, _ in everyone:
        files.update(part)
    # Rank 0's own files (.metadata, common.pt, metadata.json, trainer_state.json) and anything
    # a later Megatron adds that no rank claimed by name.
    rest = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    files.update(_describe(tmp, [p for p in rest if p.relative_to(tmp).as_posix() not in files]))
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": trainer_state.get("step"),
        "checksum": CHECKSUM,
        "files": dict(sorted(files.items())),
    }
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    if not latest:
        return
    try:
        atomic_write_text(root / "latest", name + "\n")
    except OSError:
        # Not published after all: `latest` still names the previous checkpoint, and a complete
        # directory newer than it would be mistaken for the trajectory's next step.
        shutil.rmtree(final, ignore_errors=True)
        raise


def _raise_save_error(
    error: BaseException | None,
    why: str,
    tmp: Path,
    name: str,
    root: Path,
    failed_rank: int = 0,
) -> None:
    """Every rank: remove the partial output (rank 0), then raise the failure: one line when
    the storage refused the write, else this rank's own error (or a line naming the rank)."""
    rank, _ = _rank_world()
    refusal = None
    if rank == 0:
        if error is not None:
            refusal = storage_refusal(error, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        for leftover in root.glob(f"{name}.tmp*"):  # atomic_write_text's siblings included
            if leftover.is_file():
                leftover.unlink(missing_ok=True)
    refusal = _from_rank0(refusal)
    if refusal is not None:
        kept, _ = _latest_name(root)
        raise StorageError(
            f"cannot write checkpoint {root / name}: {refusal}"
            + (f"; {kept} is still the latest checkpoint" if kept else "")
            + f"; the partial write was removed. Free space under {root} (or choose another "
            "path) and run again"
        )
    if error is not None:
        raise error
    raise RuntimeError(f"checkpoint {root / name}: rank {failed_rank} failed to write it: {why}")


# -- choosing what to resume ---------------------------------------------------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    _, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj):
    """Rank 0's ``obj`` on every rank: the file system is read once and every rank decides alike."""
    _, world = _rank_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(e: BaseException, limit: int = 200) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    text = "; ".join(lines) if len(lines) > 1 else (lines[0] if lines else "")
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _step(name: str) -> int | None:
    m = _ITER.fullmatch(name)
    return int(m.group(1)) if m else None


def _complete(root: Path) -> list[str]:
    """Renamed (finished) ``iter_*`` directories, newest step first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and _step(p.name) is not None]
    return sorted(names, key=_step, reverse=True)


def _latest_name(root: Path) -> tuple[str | None, str | None]:
    """(what ``latest`` names if it is a directory here, else None; what is wrong with it)."""
    marker = root / "latest"
    if not marker.exists():
        return None, None
    try:
        text = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"latest is unreadable ({_one_line(e)})"
    if not text:
        return None, "latest is empty"
    if "/" in text or text in (".", "..") or text.endswith(".tmp") or not (root / text).is_dir():
        return None, f"latest names {text[:80]!r}, which is not a checkpoint in {root}"
    return text, None


def _candidates(root: Path, skip: Iterable[str]) -> tuple[list[str], str | None]:
    """(names to try in order, a note on ``latest`` when it could not be used). Rank 0 only."""
    complete = _complete(root)
    name, problem = _latest_name(root)
    if problem is None and name is None and complete:
        problem = "there is no latest file"
    skip = set(skip)
    names = [n for n in ([name] if name else []) + complete if n not in skip]
    names = list(dict.fromkeys(names))  # latest's name first, once
    if problem and names:
        problem += f"; trying {names[0]} (the newest)"
    return names, problem


def _read_json(path: Path) -> tuple[object, str | None]:
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"{path.name}: missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path.name}: unreadable ({_one_line(e)})"


def _well_formed(manifest) -> bool:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return (
        isinstance(files, dict)
        and manifest.get("checksum") == CHECKSUM
        and all(
            isinstance(e, dict) and type(e.get("size")) is int and isinstance(e.get(CHECKSUM), str)
            for e in files.values()
        )
    )


def _state_problem(path: Path, required: dict[str, type]) -> str | None:
    """What is wrong with the candidate's trainer state: unreadable, not an object, a
    ``required`` key missing or of another type, or a step other than its directory's."""
    state, problem = _read_json(path / TRAINER_STATE)
    if problem is not None:
        return problem
    if not isinstance(state, dict):
        return f"{TRAINER_STATE}: not a JSON object"
    for key, kind in required.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            what = {int: "an integer", float: "a number", dict: "a mapping"}.get(
                kind, kind.__name__
            )
            return f"{TRAINER_STATE}: {key!r} is missing or not {what}"
    step = _step(path.name)
    if step is not None and "step" in required and state["step"] != step:
        return f"{TRAINER_STATE}: step {state['step']} in the checkpoint of step {step}"
    return None


def _inspect(path: Path, required: dict[str, type]) -> dict:
    """Rank 0's first look at a candidate: ``{"problem": what is wrong}``, ``{"unverified":
    True}`` (no manifest) or ``{"files": the manifest's files}``."""
    if not (path / MANIFEST).exists():
        # Written before manifests (or the manifest was deleted: the two look alike).
        problem = _state_problem(path, required)
        if problem is None and not (path / ".metadata").is_file():
            problem = ".metadata: missing"
        return {"problem": problem} if problem else {"unverified": True}
    manifest, problem = _read_json(path / MANIFEST)
    if problem is None and not _well_formed(manifest):
        problem = f"{MANIFEST}: not a list of files with sizes and {CHECKSUM} checksums"
    if problem is None:
        problem = _state_problem(path, required)
    return {"problem": problem} if problem else {"files": manifest["files"]}


def _shares(files: dict[str, dict], world: int, *, by_size: bool) -> list[list[str]]:
    """Files per rank: greedy by bytes (largest first onto the least-loaded rank) when hashing,
    by count when only stat-ing. Deterministic, so every rank computes the same split."""
    load = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    order = sorted(files, key=lambda f: (-files[f]["size"], f)) if by_size else files
    for f in order:
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(f)
        load[r] += max(files[f]["size"], 1) if by_size else 1
    return out


def _check_files(path: Path, files: dict[str, dict], mine: list[str], verify: str) -> list[str]:
    problems = []
    for rel in mine:
        want = files[rel]
        p = path / rel
        try:
            size = p.stat().st_size
            if size != want["size"]:
                problems.append(f"{rel}: {size} bytes, manifest says {want['size']}")
            elif verify == "full" and (crc := file_checksum(p)) != want[CHECKSUM]:
                problems.append(f"{rel}: {CHECKSUM} {crc}, manifest says {want[CHECKSUM]}")
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
        except OSError as e:
            problems.append(f"{rel}: {_one_line(e)}")
    return problems


def verify(path: str | Path, mode: str, required: dict | None = None) -> tuple[str | None, bool]:
    """(what is wrong with the checkpoint at ``path`` or None, whether a manifest vouched for
    it): the checks of the module docstring, ``mode`` one of :data:`VERIFY_MODES`; ``required``
    names the trainer-state keys (and their types) it must have. Collective."""
    path = Path(path)
    rank, world = _rank_world()
    info = _from_rank0(_inspect(path, required or {}) if rank == 0 else None)
    if "problem" in info:
        return info["problem"], True
    if info.get("unverified"):
        return None, False
    files = info["files"]
    mine = _shares(files, world, by_size=mode == "full")[rank]
    found = sorted(
        set(p for part in _all_gather(_check_files(path, files, mine, mode)) for p in part)
    )
    if not found:
        return None, True
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return found[0] + more, True


def _find(
    root: Path, mode: str, rejected: dict[str, str], required: dict | None
) -> tuple[Path | None, bool]:
    """(the newest intact candidate not in ``rejected``, whether a manifest vouched for it);
    ``rejected`` gains the ones found damaged."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={mode!r} is not valid; choose one of {VERIFY_MODES}")
    rank, _ = _rank_world()
    names, note = _from_rank0(_candidates(root, rejected) if rank == 0 else None)
    if note and not rejected:  # said once, not again after a candidate failed to load
        print_rank0(f"checkpoint: {note}")
    for i, name in enumerate(names):
        problem, verified = verify(root / name, mode, required)
        if problem is None:
            if not verified:
                print_rank0(
                    f"checkpoint: {name} has no {MANIFEST} (written before manifests): its files "
                    "cannot be verified; trying it as it is"
                )
            return root / name, verified
        rejected[name] = f"damaged ({problem})"
        then = f"trying {names[i + 1]}" if i + 1 < len(names) else "no older checkpoint to try"
        print_rank0(f"checkpoint: {name} is damaged ({problem}); {then}")
    if rejected:
        found = "; ".join(f"{n} {why}" for n, why in rejected.items())
        raise ConfigError(
            f"checkpoint: {root} holds {len(rejected)} checkpoint(s) and none is usable ({found}); "
            f"to start over, move {root} away or choose another train.output_dir"
        )
    return None, False


def find_resumable(
    ckpt_root: str | Path, *, verify: str = "sizes", required: dict | None = None
) -> Path | None:
    """The newest intact checkpoint under ``ckpt_root`` (module docstring), None when there is
    none at all. Collective: every rank calls it and gets the same answer. Raises
    :class:`ConfigError` when checkpoints exist but none is intact."""
    return _find(Path(ckpt_root), verify, {}, required)[0]


def latest_name(ckpt_root: str | Path) -> str | None:
    """The name ``latest`` holds when it names a checkpoint directory there, else None."""
    return _latest_name(Path(ckpt_root))[0]


def latest(ckpt_root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, unverified (tools and tests; a resume uses
    :func:`find_resumable`). None when there is no ``latest``."""
    root = Path(ckpt_root)
    if not (root / "latest").exists():
        return None
    name, problem = _latest_name(root)
    if problem:
        raise FileNotFoundError(f"checkpoint: {problem}")
    path = root / name
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(f"checkpoint: latest names {name}, which has no {TRAINER_STATE}")
    return path


# -- loading -------------------------------------------------------------------------------------
def load(path: str | Path, sharded_state_dict: dict) -> tuple[dict, dict]:
    """(loaded state dict, trainer state). Collective over all ranks. Any failure to read is a
    :class:`CheckpointError` naming the checkpoint and the underlying error. The loaded dict
    has this rank's :func:`save` ``rank_state`` under :data:`RANK_STATE` where it has one."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    mine = path / RANK_STATE / f"{dist.get_rank()}.pt"
    try:
        loaded = dist_checkpointing.load(sharded_state_dict, str(path))
        state = json.loads((path / TRAINER_STATE).read_text())
        if mine.exists():
            loaded[RANK_STATE] = torch.load(mine, map_location="cpu", weights_only=True)
    # torch's CheckpointException is a BaseException: it carries every rank's error.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(path, _reason(e)) from e
    return loaded, state


def _nonfinite(tree, key: str = "") -> str | None:
    """The first tensor of a loaded state dict holding NaN or inf, as a reason; None when all
    are finite. No checkpoint of non-finite values is ever written, so one read back is damaged
    (bytes changed in place, which ``verify=sizes`` cannot see)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        t = getattr(tree, "data", tree)  # a ShardedTensor's local data, or a tensor
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            return f"{NONFINITE} in {key or 'a tensor'}"
        return None
    for k, v in items:
        if (problem := _nonfinite(v, f"{key}.{k}" if key else str(k))) is not None:
            return problem
    return None


def _reason(e: BaseException) -> str:
    """One line for a load error; for torch's CheckpointException the lowest failing rank's."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return _one_line(failures[min(failures)][0])
    return _one_line(e)


def load_newest_intact(
    ckpt_root: str | Path,
    make_sharded_state_dict: Callable[[], dict],
    *,
    verify: str = "sizes",
    required: dict | None = None,
) -> tuple[Path, dict, dict] | None:
    """(path, loaded state dict, trainer state) of the newest checkpoint that verifies *and*
    loads on every rank; None when there is no checkpoint at all. Collective.

    ``make_sharded_state_dict`` is called once per attempt (a load consumes the dict it fills).
    A failed attempt may have overwritten part of the tensors; the next attempt loads all of them
    again. ``required``: the trainer-state keys (and types) a usable checkpoint has; one
    without them is damaged. Raises :class:`ConfigError` when checkpoints exist but none can be
    loaded.
    """
    root = Path(ckpt_root)
    rejected: dict[str, str] = {}
    while True:
        path, verified = _find(root, verify, rejected, required)
        if path is None:
            return None
        try:
            loaded, state = load(path, make_sharded_state_dict())
            error = _nonfinite(loaded)
        except CheckpointError as e:
            loaded, state, error = None, None, e.reason
        errors = [(r, e) for r, e in enumerate(_all_gather(error)) if e is not None]
        if not errors:
            return path, loaded, state
        r, reason = errors[0]
        where = f"rank {r}" if len(errors) == 1 else f"{len(errors)} ranks, rank {r}"
        if reason.startswith(NONFINITE):
            reason += " (bytes changed in place? train.checkpoint_verify=full checks every byte)"
        elif verified:
            # Every file is as written, so the likelier cause is the run's side of the load.
            reason += (
                "; its files match its manifest: does the run's model/optimizer config fit it?"
            )
        rejected[path.name] = f"failed to load ({where}: {reason})"
        print_rank0(
            f"checkpoint: {path.name} failed to load ({where}: {reason}); trying an older one"
        )


# -- retention -----------------------------------------------------------------------------------
def prune(ckpt_root: str | Path, keep: int, protect: Iterable[str] = ()) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints, the ones named in ``protect`` and the one
    ``latest`` names; remove the other ``iter_*`` and every stale ``*.tmp`` directory. Rank 0
    only. Returns the names removed.

    "Newest" counts up to the checkpoint ``latest`` names: ones with a higher step are left over
    from before a fallback (damaged, or from the abandoned trajectory). They neither count towards
    ``keep`` nor are removed here; the run overwrites each when it reaches its step again.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(ckpt_root)
    current, _ = _latest_name(root)
    complete = _complete(root)
    cut = _step(current) if current else None
    counted = [n for n in complete if cut is None or _step(n) <= cut]
    kept = set(counted[:keep]) | set(protect) | ({current} if current else set())
    kept |= {n for n in complete if n not in counted}
    removed = [n for n in complete if n not in kept]
    removed += [p.name for p in root.glob("*.tmp") if p.is_dir()] if root.is_dir() else []
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    return removed


def discard_from(ckpt_root: str | Path, first_step: int) -> list[str]:
    """Remove every ``iter_*`` of step >= ``first_step`` and point ``latest`` at the newest one
    left (no ``latest`` when none is left). Rank 0 only (the stability guard's rollback). Returns
    the names removed, oldest first."""
    root = Path(ckpt_root)
    complete = _complete(root)
    removed = sorted((n for n in complete if _step(n) >= first_step), key=_step)
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    left = [n for n in complete if n not in removed]
    if left:
        atomic_write_text(root / "latest", left[0] + "\n")
    elif (root / "latest").exists():
        (root / "latest").unlink()
    if removed:
        fsync_dir(root)
    return removed
