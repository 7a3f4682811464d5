"""Small helpers shared by every config dataclass: typed fields with help, dict/YAML conversion.

Each concern owns its dataclass next to its code (``ModelConfig`` in ``models/``, ``TrainConfig`` in
``trainer/`` ...). This module only knows how to build any of them from a plain dict with
precise errors (unknown key, wrong type) naming the dotted field path, and how to write them back.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


def field(
    default=dataclasses.MISSING,
    *,
    help: str,  # noqa: A002
    default_factory=dataclasses.MISSING,
    before=dataclasses.MISSING,
):
    """A dataclass field that carries its help text (shown in errors and ``--help``). ``before``:
    the value that describes what the code did before the field existed, where that is not the
    default (a field that changed behaviour as it came); a run saved then is compared with it."""
    kwargs: dict[str, Any] = {"metadata": {"help": help}}
    if before is not dataclasses.MISSING:
        kwargs["metadata"]["before"] = before
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def check_literals(obj, owner: str) -> None:
    """Check every ``Literal``-typed field of dataclass ``obj`` against its annotation.

    The one check of enum-like values, called from ``__post_init__`` (so a config built in Python
    is checked as well as one read from YAML); the annotation is the only list of valid values.
    ``owner`` names the section in the error (``rollout.sglang``, ``FP8Config``).
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints.get(f.name)
        if get_origin(tp) is not Literal:
            continue
        value = getattr(obj, f.name)
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ValueError(f"{owner}.{f.name}={value!r} is not valid; choose one of {choices}")


class ConfigError(ValueError):
    """A config value or layout is invalid; the message names the field and the fix."""


def _type_name(tp) -> str:
    if tp is bool:
        return "true / false"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # what an integer setting may be (torch's int64)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int->float, list->tuple)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, path)
            except ConfigError as e:
                errors.append(str(e))
        names = " or ".join(_type_name(o) for o in options if o is not type(None))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} is not {names}")
    if origin is Literal:
        if value not in get_args(tp):
            hint = ""
            if isinstance(value, bool) and all(isinstance(a, str) for a in get_args(tp)):
                hint = " (YAML reads on / off / yes / no unquoted as booleans: quote the word)"
            raise ConfigError(f"{path}: {value!r} is not {_type_name(tp)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        # Every integer setting ends in torch (seeds, sizes, counts), which takes a signed 64-bit
        # value and raises "Overflow when unpacking long long" mid-run past it.
        if not INT_MIN <= value <= INT_MAX:
            raise ConfigError(
                f"{path}: {value} is past a 64-bit integer's range ({INT_MIN} to {INT_MAX})"
            )
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        # NaN passes every `x > 0` style check in __post_init__ and inf most of them; no setting
        # means anything by either (null is the way to switch one off), so refuse both here, once
        # for every float field. YAML writes them .nan / .inf; overrides also nan / inf.
        try:
            number = float(value)
        except OverflowError:  # an int past float's range (1e309 in YAML is already inf)
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    return value


SEED_MAX = 2**32 - 1


def _check_seed(value: int, path: str) -> None:
    """A seed setting (``seed``, ``*_seed``) is 0 .. 2**32 - 1: its consumers add offsets to it
    (Megatron's per-rank seeds, a step per sampling round) inside torch's int64."""
    if not 0 <= value <= SEED_MAX:
        raise ConfigError(f"{path}: {value} is not a seed; give an integer from 0 to {SEED_MAX}")


def from_dict(cls, data: dict, path: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ``ConfigError``."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys need not be strings
    if unknown:
        where = path or "the top level"
        raise ConfigError(
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} in {where}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        where = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(value, hints[name], where)
        if (name == "seed" or name.endswith("_seed")) and isinstance(kwargs[name], int):
            _check_seed(kwargs[name], where)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        # Messages that already name the field by its dotted path need no section prefix.
        named = not path or str(e).startswith(f"{path}.")
        raise ConfigError(str(e) if named else f"{path}: {e}") from e


def to_dict(obj) -> dict:
    """Dataclass -> plain dict of YAML-safe values (tuples become lists)."""

    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v

    return conv(obj)


@dataclasses.dataclass
class FieldDoc:
    """One leaf field of a config tree, as ``megatron-rl-fp8 config`` shows it."""

    path: str  # dotted, e.g. "loss.calib.interval"
    value: Any  # resolved (after YAML, base: includes and overrides)
    default: Any  # the dataclass default
    help: str
    before: Any  # what a run saved before the field existed ran with: ``before=``, else default


def describe_fields(obj, prefix: str = "", default_obj=None) -> list[FieldDoc]:
    """Every leaf field of the dataclass tree ``obj`` with its resolved value, default and help.

    Sections (nested dataclasses) are walked in declaration order; a section's default is its
    dataclass built with no arguments, so nested defaults are the ones a user gets by omission.
    """
    out = []
    for f in dataclasses.fields(obj):
        path = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = getattr(default_obj, f.name, dataclasses.MISSING)
        if dataclasses.is_dataclass(value):
            out += describe_fields(value, path, default)
        else:
            before = f.metadata.get("before", default)
            out.append(FieldDoc(path, value, default, f.metadata.get("help", ""), before))
    return out


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    """``set_dotted(d, "train.lr", 1e-4)`` creates intermediate mappings as needed."""
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value
