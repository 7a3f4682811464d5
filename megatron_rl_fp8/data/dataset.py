"""Prompt datasets for RL rollouts: JSONL or Parquet files of (prompt, answer) records.

The RL loop asks for ``n`` prompts per step (:meth:`PromptDataset.next_batch`) and never for a
full pass, so the dataset is an endless, epoch-wise shuffled stream with an explicit cursor
``(epoch, position)``. The order of epoch ``e`` is a pure function of ``(seed, e)``, so the cursor
alone (:meth:`state_dict`) is enough for a resumed run to continue with exactly the prompts the
interrupted run would have drawn next.

Files are read whole into memory: RL prompt sets are small (the shipped task is ~0.75 MB), and
having every record up front lets malformed data fail at start-up, with the file and line, rather
than hours into a run.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.data.prompts import check_messages

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


class DataError(ConfigError):
    """A prompt file or record is unusable; the message names the file (and line) and the field."""


def get_dotted(raw: dict, path: str) -> Any:
    """``raw["reward_model"]["ground_truth"]`` for ``path="reward_model.ground_truth"``; a key
    that itself contains the dots wins (some exports flatten nested columns)."""
    if path in raw:
        return raw[path]
    node: Any = raw
    for i, key in enumerate(path.split(".")):
        if not isinstance(node, dict) or key not in node:
            have = sorted(node) if isinstance(node, dict) else type(node).__name__
            prefix = ".".join(path.split(".")[:i]) or "record"
            raise KeyError(f"missing field {path!r} ({prefix} has {have})")
        node = node[key]
    return node


def _check_record(raw: Any, where: str, prompt_field: str, answer_field: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise DataError(
            f"{where}: expected a JSON object like "
            f'{{"{prompt_field}": "12+35=", "{answer_field}": "47"}}, got {type(raw).__name__}'
        )
    values = {}
    for field, name in ((prompt_field, "task.prompt_field"), (answer_field, "task.answer_field")):
        try:
            values[field] = get_dotted(raw, field)
        except KeyError as e:
            raise DataError(
                f"{where}: {e.args[0]}; fix the data or set {name} to the (dotted) path the file "
                "uses"
            ) from None
    prompt, answer = values[prompt_field], values[answer_field]
    if isinstance(prompt, list):
        problem = check_messages(prompt)
        if problem:
            raise DataError(f"{where}: field {prompt_field!r}: {problem}")
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(
            f"{where}: field {prompt_field!r} must be a non-empty string or a chat message list, "
            f"got {prompt!r}"
        )
    # Numeric answers (common in Parquet exports) are kept as their text; bool is an int subclass
    # but never a meaningful answer.
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DataError(f"{where}: field {answer_field!r} must be a string, got {answer!r}")
    return {"prompt": prompt, "answer": answer, "where": where, "record": raw}


def _read_jsonl(path: Path, prompt_field: str, answer_field: str) -> list[dict[str, Any]]:
    records = []
    # Bytes, decoded line by line, so that a file in another encoding (or not text at all) is
    # reported at its first bad line rather than as a bare UnicodeDecodeError.
    with open(path, "rb") as f:
        for lineno, data in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                # utf-8-sig: a byte-order mark (some Windows editors write one) is not JSON.
                line = data.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte "
                    f"{e.start + 1} of the line); a prompt file is UTF-8 JSON Lines"
                ) from None
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) carry no record
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one "
                    "JSON object"
                ) from None
            records.append(_check_record(raw, where, prompt_field, answer_field))
    return records


def _read_parquet_rows(path: Path) -> list[Any]:
    # Optional dependency: pyarrow (preferred) or pandas with a Parquet engine.
    try:
        import pyarrow as pa  # lazy: optional dependency (pyarrow)
        import pyarrow.parquet as pq  # lazy: optional dependency (pyarrow)
    except ImportError:
        pq = None
    if pq is not None:
        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(_parquet_problem(path, e)) from None
    try:
        import pandas as pd  # lazy: optional dependency (pandas)

        return pd.read_parquet(path).to_dict(orient="records")
    except ImportError:  # no pandas, or pandas without a Parquet engine
        raise DataError(
            f"reading the Parquet prompt file {str(path)!r} needs pyarrow: `pip install pyarrow` "
            "(or convert the file to JSONL)"
        ) from None
    except (OSError, ValueError) as e:
        raise DataError(_parquet_problem(path, e)) from None


def _parquet_problem(path: Path, e: Exception) -> str:
    """One line for a file the Parquet reader refuses (empty, truncated, not Parquet at all)."""
    why = " ".join(str(e).split())
    # pyarrow: "Could not open Parquet input source '<path>': <why>"; the path is said once.
    _, sep, tail = why.partition(f"{str(path)!r}: ")
    return f"prompt file {str(path)!r} is not a readable Parquet file ({tail if sep else why})"


def load_records(
    path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[dict[str, str]]:
    """Read every record of a ``.jsonl`` or ``.parquet`` file as ``{"prompt", "answer", "where",
    "record"}`` dicts.

    The (dotted) source fields are mapped to the canonical keys ``prompt`` (a string or a chat
    message list) and ``answer``; ``where`` is ``file:line`` (JSONL) or ``file: row i`` (Parquet,
    0-based), ``record`` the whole source record (user reward functions get it). Errors are
    :class:`DataError` naming the file and line and saying how to fix the data.
    """
    p = Path(path)
    if p.suffix not in SUPPORTED_SUFFIXES:
        raise DataError(
            f"prompt file {str(p)!r} has suffix {p.suffix!r}; supported: {SUPPORTED_SUFFIXES}"
        )
    if p.is_dir():
        raise DataError(f"prompt file {str(p)!r} is a directory; give the path of a file")
    if not p.is_file():
        raise DataError(f"prompt file {str(p)!r} does not exist")
    try:  # unreadable (permissions): one line, for both readers
        open(p, "rb").close()
    except OSError as e:
        raise DataError(f"prompt file {str(p)!r} cannot be read: {e.strerror or e}") from None
    if p.suffix == ".jsonl":
        records = _read_jsonl(p, prompt_field, answer_field)
    else:
        records = [
            _check_record(raw, f"{p}: row {i}", prompt_field, answer_field)
            for i, raw in enumerate(_read_parquet_rows(p))
        ]
    if not records:
        raise DataError(f"prompt file {str(p)!r} holds no records")
    return records


class PromptDataset:
    """An endless, deterministically shuffled stream of ``{"prompt", "answer", "index"}`` records.

    ``index`` is the record's row in the source file (stable across epochs and resumes; useful for
    logging and for grouping GRPO samples). Epoch ``e`` visits every record once, in the order
    ``random.Random(f"{seed}:{e}")`` shuffles to (file order when ``shuffle=False``). A batch that
    runs past the end of an epoch continues into the next one.
    """

    def __init__(
        self,
        records: list[dict[str, str]],
        *,
        seed: int = 0,
        shuffle: bool = True,
        source: str = "<memory>",
    ) -> None:
        if not records:
            raise ValueError(f"PromptDataset from {source} got no records")
        self.records = [dict(r) for r in records]
        self.seed = seed
        self.shuffle = shuffle
        self.source = source
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)
        self.fingerprint = self._fingerprint()

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        seed: int = 0,
        shuffle: bool = True,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
    ) -> PromptDataset:
        """Load a ``.jsonl`` / ``.parquet`` file (see :func:`load_records`)."""
        records = load_records(path, prompt_field=prompt_field, answer_field=answer_field)
        return cls(records, seed=seed, shuffle=shuffle, source=str(path))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Record ``i`` in file order (a fresh dict; callers may mutate it)."""
        return {**self.records[i], "index": i}

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by `random`, so the order is stable across
            # processes and Python versions (unlike hash(), which is salted per process).
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for r in self.records:
            prompt = r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"])
            h.update(prompt.encode() + b"\0" + r["answer"].encode() + b"\n")
        return h.hexdigest()[:16]

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` records of the stream, advancing the cursor (may cross epochs)."""
        if n < 1:
            raise ValueError(f"next_batch(n={n}): n must be >= 1")
        batch = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The cursor plus what identifies the data, for checkpoints (JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by :meth:`state_dict`.

        Refuses a state saved with other data, seed or shuffle setting: the cursor would then point
        into a different order and the resumed run would silently see different prompts.
        """
        required = {"epoch", "position", "seed", "shuffle", "num_records", "fingerprint"}
        missing = required - set(state)
        if missing:
            raise ValueError(f"dataset state is missing keys {sorted(missing)}")
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_records", "fingerprint"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"dataset state has {key}={state[key]!r} but this dataset ({self.source}) has "
                    f"{key}={mine[key]!r}; resume with the same prompt file and seed, or start "
                    "the data stream fresh"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.records):
            raise ValueError(
                f"dataset state has epoch={epoch}, position={position}; need epoch >= 0 and "
                f"0 <= position <= {len(self.records)}"
            )
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
