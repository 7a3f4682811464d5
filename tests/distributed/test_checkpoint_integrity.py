"""Checkpoints you can trust (megatron_rl_fp8/checkpoint/): each damage a user met falls back to the
newest intact checkpoint with one line naming what was wrong, or refuses with one line when none
is left; never a bare EOFError or a silent restart from step 0.

One 1-rank gloo run (a module fixture) saves two real dist checkpoints (steps 2 and 4) once, then
damages a fresh copy of them per case and resumes; one 2-rank run checks that the ranks agree and
that each hashes only its share. Retention is file-system work on rank 0 and runs in-process.
"""

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

ROWS, COLS = 8, 64  # per rank: 2 KB of float32 in "w"


def _w(rank: int, step: int) -> torch.Tensor:
    # Distinct values everywhere, so one float's bytes occur once in the checkpoint.
    base = step * 10_000 + rank * ROWS * COLS
    return (base + torch.arange(ROWS * COLS, dtype=torch.float32)).reshape(ROWS, COLS)


def _state(rank: int, world: int, step: int | None) -> dict:
    """The sharded state dict: "w" split by rows over the ranks, "b" replicated (rank 0 writes
    it). ``step=None``: zeros to load into."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    w = torch.zeros(ROWS, COLS) if step is None else _w(rank, step)
    b = torch.zeros(16) if step is None else torch.full((16,), float(step))
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", b, replica_id=rank),
    }


def _matches(loaded: dict, rank: int, step: int) -> bool:
    return torch.equal(loaded["w"], _w(rank, step)) and torch.equal(
        loaded["b"], torch.full((16,), float(step))
    )


def _save_two(root: Path, rank: int, world: int) -> None:
    from megatron_rl_fp8 import checkpoint

    for step in (2, 4):
        checkpoint.save(root, f"iter_{step:07d}", _state(rank, world, step), {"step": step})


def _overwrite_float(ckpt: Path, rank: int, step: int, index: int) -> str:
    """Overwrite one float of rank ``rank``'s "w" shard in place (same file size). Returns the
    file's name."""
    needle = _w(rank, step).flatten()[index].numpy().tobytes()
    for f in sorted(ckpt.glob("*.distcp")):
        data = bytearray(f.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at : at + 4] = torch.tensor([-1.0]).numpy().tobytes()
            f.write_bytes(bytes(data))
            return f.name
    raise AssertionError("marker float not found in any shard")


def _truncate_largest(ckpt: Path) -> None:
    f = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(f, f.stat().st_size // 2)


# -- damage, one case per entry (applied to a fresh copy of iter_2 + iter_4, latest = iter_4) --
def _truncated_shard(root):
    _truncate_largest(root / "iter_0000004")


def _no_metadata(root):
    (root / "iter_0000004" / ".metadata").unlink()


def _no_common(root):
    (root / "iter_0000004" / "common.pt").unlink()


def _no_trainer_state(root):
    (root / "iter_0000004" / "trainer_state.json").unlink()


def _garbage_manifest(root):
    (root / "iter_0000004" / "manifest.json").write_text('{"format": 1, "fil')


def _empty_latest(root):
    (root / "latest").write_text("")


def _binary_latest(root):
    (root / "latest").write_bytes(b"\xff\xfe\x00junk")


def _dangling_latest(root):
    (root / "latest").write_text("iter_0000009\n")


def _overwritten(root):
    _overwrite_float(root / "iter_0000004", 0, 4, 100)


def _no_latest_and_truncated(root):
    # The old advice for a damaged newest checkpoint was "remove latest": it restarted at step 0.
    (root / "latest").unlink()
    _truncate_largest(root / "iter_0000004")


def _all_damaged(root):
    _truncate_largest(root / "iter_0000004")
    (root / "iter_0000002" / "common.pt").unlink()


def _old_format_truncated(root):
    # Written before manifests: nothing to verify, so the load itself fails and is caught.
    for name in ("iter_0000002", "iter_0000004"):
        (root / name / "manifest.json").unlink()
    _truncate_largest(root / "iter_0000004")


def _nothing(root):
    shutil.rmtree(root)
    (root / "iter_0000006.tmp").mkdir(parents=True)  # a first save that never finished


CASES = {
    "truncated_shard": (_truncated_shard, "sizes"),
    "no_metadata": (_no_metadata, "sizes"),
    "no_common": (_no_common, "sizes"),
    "no_trainer_state": (_no_trainer_state, "sizes"),
    "garbage_manifest": (_garbage_manifest, "sizes"),
    "empty_latest": (_empty_latest, "sizes"),
    "binary_latest": (_binary_latest, "sizes"),
    "dangling_latest": (_dangling_latest, "sizes"),
    "overwritten_full": (_overwritten, "full"),
    "overwritten_sizes": (_overwritten, "sizes"),
    "no_latest_and_truncated": (_no_latest_and_truncated, "sizes"),
    "all_damaged": (_all_damaged, "full"),
    "old_format_truncated": (_old_format_truncated, "sizes"),
    "nothing": (_nothing, "sizes"),
}


def _resume(root: Path, rank: int, world: int, verify: str):
    """(outcome, console lines): outcome is (name, step, tensors equal the saved ones, the "w"
    float the test overwrites), None, or ("ConfigError", message)."""
    from megatron_rl_fp8 import checkpoint
    from megatron_rl_fp8.config_utils import ConfigError

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            got = checkpoint.load_newest_intact(
                root, lambda: _state(rank, world, None), verify=verify
            )
        except ConfigError as e:
            got = e
    if isinstance(got, ConfigError):
        outcome = ("ConfigError", str(got))
    elif got is None:
        outcome = None
    else:
        path, loaded, state = got
        w100 = loaded["w"].flatten()[100].item()
        outcome = (path.name, state["step"], _matches(loaded, rank, state["step"]), w100)
    return outcome, out.getvalue().splitlines()


def _cases_body(rank, world, tmp):
    from megatron_rl_fp8.parallel import cpu_compat

    cpu_compat.enable()  # Megatron's writer stages tensors through torch.cuda calls
    pristine = Path(tmp) / "pristine"
    _save_two(pristine, rank, world)
    ckpt = pristine / "iter_0000004"
    results = {
        "manifest": json.loads((ckpt / "manifest.json").read_text()),
        "listing": {p.name: p.stat().st_size for p in ckpt.iterdir()},
        "latest": (pristine / "latest").read_text(),
    }
    for case, (damage, verify) in CASES.items():
        root = Path(tmp) / case
        shutil.copytree(pristine, root)
        damage(root)
        results[case] = _resume(root, rank, world, verify)
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    (out,) = run_distributed(_cases_body, world_size=1, args=(str(tmp_path_factory.mktemp("c")),))
    return out


def test_manifest_lists_every_file_with_size_and_checksum(cases):
    m, listing = cases["manifest"], cases["listing"]
    assert (m["format"], m["step"], m["checksum"]) == (1, 4, "crc32")
    assert set(m["files"]) == set(listing) - {"manifest.json"}
    assert {".metadata", "common.pt", "trainer_state.json"} <= set(m["files"])
    assert any(f.endswith(".distcp") for f in m["files"])
    assert all(m["files"][f]["size"] == listing[f] for f in m["files"])
    assert all(len(e["crc32"]) == 8 for e in m["files"].values())
    assert cases["latest"] == "iter_0000004\n"


def _fell_back(case_result, *expected_lines):
    (name, step, equal, _), lines = case_result
    assert (name, step, equal) == ("iter_0000002", 2, True)
    assert lines == list(expected_lines)


@pytest.mark.parametrize(
    "case, why",
    [
        ("no_metadata", ".metadata: missing"),
        ("no_common", "common.pt: missing"),
        ("no_trainer_state", "trainer_state.json: missing"),
    ],
)
def test_a_missing_file_falls_back(cases, case, why):
    _fell_back(cases[case], f"checkpoint: iter_0000004 is damaged ({why}); trying iter_0000002")


def test_a_truncated_shard_falls_back(cases):
    _, (line,) = cases["truncated_shard"]
    assert line.startswith("checkpoint: iter_0000004 is damaged (__0_")
    assert ".distcp: " in line and " bytes, manifest says " in line
    assert line.endswith("); trying iter_0000002")
    _fell_back(cases["truncated_shard"], line)


def test_an_unreadable_manifest_falls_back(cases):
    (_, (line,)) = cases["garbage_manifest"]
    assert line.startswith("checkpoint: iter_0000004 is damaged (manifest.json: unreadable (")
    _fell_back(cases["garbage_manifest"], line)


@pytest.mark.parametrize(
    "case, note",
    [
        ("empty_latest", "latest is empty"),
        ("binary_latest", "latest is unreadable (UnicodeDecodeError: "),
        ("dangling_latest", "latest names 'iter_0000009', which is not a checkpoint in "),
    ],
)
def test_a_bad_latest_resumes_the_newest(cases, case, note):
    (name, step, equal, _), (line,) = cases[case]
    assert (name, step, equal) == ("iter_0000004", 4, True)
    assert line.startswith(f"checkpoint: {note}")
    assert line.endswith("; trying iter_0000004 (the newest)")


def test_removing_latest_no_longer_restarts_from_scratch(cases):
    _, lines = cases["no_latest_and_truncated"]
    assert lines[0] == "checkpoint: there is no latest file; trying iter_0000004 (the newest)"
    assert lines[1].startswith("checkpoint: iter_0000004 is damaged (__0_")
    _fell_back(cases["no_latest_and_truncated"], *lines)


def test_bytes_overwritten_in_place_need_full_verification(cases):
    # full: the shard's crc32 differs, and the older checkpoint is loaded.
    (_, (line,)) = cases["overwritten_full"]
    assert line.startswith("checkpoint: iter_0000004 is damaged (__0_")
    assert ".distcp: crc32 " in line and ", manifest says " in line
    _fell_back(cases["overwritten_full"], line)
    # sizes: the documented limit. Every size matches, so the damaged checkpoint is accepted
    # without a word and loads the overwritten value.
    (name, step, equal, w100), lines = cases["overwritten_sizes"]
    assert (name, step, equal, w100, lines) == ("iter_0000004", 4, False, -1.0, [])


def test_no_intact_checkpoint_refuses_with_one_line(cases):
    (kind, message), lines = cases["all_damaged"]
    assert kind == "ConfigError"
    assert "\n" not in message
    assert "holds 2 checkpoint(s) and none is usable (iter_0000004 damaged (__0_" in message
    assert "iter_0000002 damaged (common.pt: missing)" in message
    assert "move " in message and "train.output_dir" in message
    assert (
        lines[-1]
        == "checkpoint: iter_0000002 is damaged (common.pt: missing); no older checkpoint to try"
    )


def test_an_unverifiable_old_checkpoint_that_fails_to_load_falls_back(cases):
    (name, step, equal, _), lines = cases["old_format_truncated"]
    assert (name, step, equal) == ("iter_0000002", 2, True)
    assert len(lines) == 3
    assert lines[0].startswith("checkpoint: iter_0000004 has no manifest.json")
    assert lines[1].startswith("checkpoint: iter_0000004 failed to load (rank 0: ")
    assert lines[1].endswith("; trying an older one")
    assert lines[2].startswith("checkpoint: iter_0000002 has no manifest.json")


def test_no_checkpoint_is_a_fresh_start(cases):
    assert cases["nothing"] == (None, [])


# -- two ranks ---------------------------------------------------------------------------------
def _two_ranks_body(rank, world, tmp):
    import torch.distributed as dist

    from megatron_rl_fp8.checkpoint import layout, read, write
    from megatron_rl_fp8.parallel import cpu_compat

    cpu_compat.enable()
    hashed: list[str] = []

    def spy(path):
        hashed.append(f"{Path(path).parent.name}/{Path(path).name}")
        return layout.file_checksum(path)

    read.file_checksum = write.file_checksum = spy  # where the save and the verify call it
    root = Path(tmp)
    _save_two(root, rank, world)
    at_save = sorted(h for h in hashed if h.startswith("iter_0000004.tmp/"))
    manifest = json.loads((root / "iter_0000004" / "manifest.json").read_text())
    if rank == 0:
        damaged = _overwrite_float(root / "iter_0000004", 1, 4, 7)  # rank 1's shard
    dist.barrier()
    hashed.clear()
    outcome, lines = _resume(root, rank, world, "full")
    return {
        "at_save": at_save,
        "at_verify": sorted(h for h in hashed if h.startswith("iter_0000004/")),
        "files": sorted(manifest["files"]),
        "outcome": outcome,
        "lines": lines,
        "damaged": damaged if rank == 0 else None,
    }


def test_two_ranks_share_the_hashing_and_agree(tmp_path):
    r0, r1 = run_distributed(_two_ranks_body, world_size=2, args=(str(tmp_path),))
    files = set(r0["files"])
    # At save, each rank hashed the shards it wrote; rank 0 also the rest.
    save0 = {h.split("/")[1] for h in r0["at_save"]}
    save1 = {h.split("/")[1] for h in r1["at_save"]}
    assert save1 and all(f.startswith("__1_") for f in save1)
    assert save0 | save1 == files and not save0 & save1
    # Full verification: each rank hashed a share, the shares cover every file once.
    ver0 = {h.split("/")[1] for h in r0["at_verify"]}
    ver1 = {h.split("/")[1] for h in r1["at_verify"]}
    assert ver0 and ver1 and ver0 | ver1 == files and not ver0 & ver1
    # Both fell back to step 2 and loaded their own shard of it exactly.
    assert r0["outcome"][:3] == r1["outcome"][:3] == ("iter_0000002", 2, True)
    assert r0["damaged"].startswith("__1_")
    (line,) = r0["lines"]
    assert line.startswith(f"checkpoint: iter_0000004 is damaged ({r0['damaged']}: crc32 ")
    assert r1["lines"] == []  # one console line per job


# -- retention (rank 0's file-system work) -----------------------------------------------------
def _fake_run(root: Path, steps, latest: str) -> None:
    for s in steps:
        (root / f"iter_{s:07d}").mkdir(parents=True)
    (root / "iter_0000007.tmp").mkdir()
    (root / "latest").write_text(latest + "\n")


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_prune_keeps_the_newest_the_protected_and_latest(tmp_path):
    from megatron_rl_fp8 import checkpoint

    # iter_6 is newer than latest (left over from before a fallback): it is not counted.
    _fake_run(tmp_path, range(1, 7), "iter_0000005")
    removed = checkpoint.prune(tmp_path, keep=2, protect=["iter_0000002"])
    assert sorted(removed) == ["iter_0000001", "iter_0000003", "iter_0000007.tmp"]
    assert _names(tmp_path) == ["iter_0000002", "iter_0000004", "iter_0000005", "iter_0000006"]
    checkpoint.prune(tmp_path, keep=1)
    assert _names(tmp_path) == ["iter_0000005", "iter_0000006"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        checkpoint.prune(tmp_path, keep=0)


def test_discard_from_points_latest_at_the_newest_left(tmp_path):
    from megatron_rl_fp8 import checkpoint

    _fake_run(tmp_path, range(1, 6), "iter_0000005")
    assert checkpoint.discard_from(tmp_path, 4) == ["iter_0000004", "iter_0000005"]
    assert (tmp_path / "latest").read_text() == "iter_0000003\n"
    assert checkpoint.discard_from(tmp_path, 1) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert not (tmp_path / "latest").exists()


def test_find_resumable_needs_no_process_group(tmp_path, capsys):
    """Rank-0 tools call it without torch.distributed: it is then a one-rank check."""
    from megatron_rl_fp8 import checkpoint

    for step in (1, 2):
        ckpt = tmp_path / f"iter_{step:07d}"
        ckpt.mkdir()
        (ckpt / ".metadata").write_bytes(b"index" * step)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
        files = {
            p.name: {"size": p.stat().st_size, "crc32": checkpoint.file_checksum(p)}
            for p in ckpt.iterdir()
        }
        manifest = {"format": 1, "step": step, "checksum": "crc32", "files": files}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "latest").write_text("iter_0000002\n")
    (tmp_path / "iter_0000002" / ".metadata").write_bytes(b"INDEXINDEX")  # same size
    assert checkpoint.find_resumable(tmp_path, verify="sizes").name == "iter_0000002"
    assert capsys.readouterr().out == ""
    assert checkpoint.find_resumable(tmp_path, verify="full").name == "iter_0000001"
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("checkpoint: iter_0000002 is damaged (.metadata: crc32 ")
    with pytest.raises(ValueError, match="verify='crc'"):
        checkpoint.find_resumable(tmp_path, verify="crc")


# -- a storage that refuses the write (issue 31.3) ----------------------------------------------
def _refusing_storage_body(rank, world, tmp):
    import builtins
    import errno

    import torch.distributed as dist

    from megatron_rl_fp8 import checkpoint
    from megatron_rl_fp8.parallel import cpu_compat
    from megatron_rl_fp8.utils.fs import StorageError

    cpu_compat.enable()
    root = Path(tmp)
    checkpoint.save(root, "iter_0000002", _state(rank, world, 2), {"step": 2})
    real_open = builtins.open

    class Full(io.FileIO):
        """A real file on a device that has just filled up: every write is refused."""

        def write(self, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_for(pattern):
        def fake_open(path, mode="r", *a, **k):
            if "w" in mode and pattern in os.path.basename(str(path)):
                raw = io.BufferedWriter(Full(path, "w"))
                return raw if "b" in mode else io.TextIOWrapper(raw)
            return real_open(path, mode, *a, **k)

        return fake_open

    seen = {}
    # The disk fills while rank 1 writes its shard, then while rank 0 writes the manifest.
    for case, (who, pattern) in {"shard": (1, "__1_"), "manifest": (0, "manifest")}.items():
        builtins.open = full_for(pattern) if rank == who else real_open
        try:
            checkpoint.save(root, "iter_0000004", _state(rank, world, 4), {"step": 4})
            seen[case] = "saved"
        except StorageError as e:
            seen[case] = str(e)
        finally:
            builtins.open = real_open
        dist.barrier()
        seen[case + "_left"] = sorted(p.name for p in root.iterdir())
        dist.barrier()  # before rank 0 starts the next case's save (its .tmp)
    return seen


def test_a_storage_refusal_on_any_rank_is_one_line_on_every_rank(tmp_path):
    for seen in run_distributed(_refusing_storage_body, world_size=2, args=(str(tmp_path),)):
        for case in ("shard", "manifest"):
            why = seen[case]
            assert why.startswith(f"cannot write checkpoint {tmp_path}/iter_0000004: "), why
            assert (
                "no space left on the device" in why and "iter_0000002 is still the latest" in why
            )
            # The partial write is gone; latest still names step 2.
            assert seen[case + "_left"] == ["iter_0000002", "latest"], seen
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
