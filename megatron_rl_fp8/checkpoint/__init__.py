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

**Writing** (:func:`save`, ``write.py``). A checkpoint is written into ``iter_XXXXXXX.tmp``. Right after its
write, each rank checksums the shard files it wrote (``__<rank>_*.distcp``: the bytes are still
in its page cache, and the hashing of a large checkpoint is spread over all ranks); rank 0 gathers
the results, writes ``trainer_state.json``, checksums its own files and anything no rank claimed,
and writes ``manifest.json`` last (atomically). Only then is the directory renamed and ``latest``
replaced. A crash mid-save leaves the previous checkpoint as ``latest`` and a stale ``.tmp`` that
the next :func:`prune` removes. Because dist_checkpointing stores global shapes, a checkpoint
loads into any TP/PP layout.

**Choosing what to resume** (:func:`find_resumable`, :func:`load_newest_intact`, ``read.py``). Candidates are
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

from megatron_rl_fp8.checkpoint.layout import (
    CHECKSUM,
    MANIFEST,
    NONFINITE,
    RANK_STATE,
    TRAINER_STATE,
    VERIFY_MODES,
    CheckpointError,
    file_checksum,
)
from megatron_rl_fp8.checkpoint.read import (
    find_resumable,
    latest,
    latest_name,
    load,
    load_newest_intact,
    verify,
)
from megatron_rl_fp8.checkpoint.write import discard_from, prune, save, save_sharded

__all__ = [
    "CHECKSUM",
    "MANIFEST",
    "NONFINITE",
    "RANK_STATE",
    "TRAINER_STATE",
    "VERIFY_MODES",
    "CheckpointError",
    "discard_from",
    "file_checksum",
    "find_resumable",
    "latest",
    "latest_name",
    "load",
    "load_newest_intact",
    "prune",
    "save",
    "save_sharded",
    "verify",
]
