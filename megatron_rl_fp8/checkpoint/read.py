"""Choosing what to resume, verifying it against its manifest, loading it (see the package
docstring)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8.checkpoint.layout import (
    CHECKSUM,
    MANIFEST,
    NONFINITE,
    RANK_STATE,
    TRAINER_STATE,
    VERIFY_MODES,
    CheckpointError,
    all_gather,
    complete_names,
    file_checksum,
    from_rank0,
    latest_entry,
    one_line,
    rank_world,
    step_of,
)
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import print_rank0


def _candidates(root: Path, skip: Iterable[str]) -> tuple[list[str], str | None]:
    """(names to try in order, a note on ``latest`` when it could not be used). Rank 0 only."""
    complete = complete_names(root)
    name, problem = latest_entry(root)
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
        return None, f"{path.name}: unreadable ({one_line(e)})"


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
    step = step_of(path.name)
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
            problems.append(f"{rel}: {one_line(e)}")
    return problems


def verify(path: str | Path, mode: str, required: dict | None = None) -> tuple[str | None, bool]:
    """(what is wrong with the checkpoint at ``path`` or None, whether a manifest vouched for
    it): the checks of the module docstring, ``mode`` one of :data:`VERIFY_MODES`; ``required``
    names the trainer-state keys (and their types) it must have. Collective."""
    path = Path(path)
    rank, world = rank_world()
    info = from_rank0(_inspect(path, required or {}) if rank == 0 else None)
    if "problem" in info:
        return info["problem"], True
    if info.get("unverified"):
        return None, False
    files = info["files"]
    mine = _shares(files, world, by_size=mode == "full")[rank]
    found = sorted(
        set(p for part in all_gather(_check_files(path, files, mine, mode)) for p in part)
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
    rank, _ = rank_world()
    names, note = from_rank0(_candidates(root, rejected) if rank == 0 else None)
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
    return latest_entry(Path(ckpt_root))[0]


def latest(ckpt_root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, unverified (tools and tests; a resume uses
    :func:`find_resumable`). None when there is no ``latest``."""
    root = Path(ckpt_root)
    if not (root / "latest").exists():
        return None
    name, problem = latest_entry(root)
    if problem:
        raise FileNotFoundError(f"checkpoint: {problem}")
    path = root / name
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(f"checkpoint: latest names {name}, which has no {TRAINER_STATE}")
    return path


def load(path: str | Path, sharded_state_dict: dict) -> tuple[dict, dict]:
    """(loaded state dict, trainer state). Collective over all ranks. Any failure to read is a
    :class:`CheckpointError` naming the checkpoint and the underlying error. The loaded dict
    has this rank's :func:`save` ``rank_state`` under :data:`RANK_STATE` where it has one."""
    # lazy: Megatron-Core (~6 s) and torch.distributed.checkpoint (~1 s) only to load; manifests,
    # verification and `study` import this package without them
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
        return one_line(failures[min(failures)][0])
    return one_line(e)


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
        errors = [(r, e) for r, e in enumerate(all_gather(error)) if e is not None]
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
