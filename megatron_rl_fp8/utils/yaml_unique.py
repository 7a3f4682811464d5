"""YAML that refuses a key given twice in one mapping.

PyYAML keeps the last of two equal keys, so a study file with two arms of one name, or a config
with a section written twice, silently loses the first. :func:`safe_load` is ``yaml.safe_load``
that raises a ``yaml.constructor.ConstructorError`` (a ``MarkedYAMLError``: line and column of the
second key) instead. Keys a merge (``<<: *anchor``) brings in may still be overridden by the
mapping's own keys, as YAML means them to be.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r} (first on line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str | bytes) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (see the module docstring)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """A YAML error in one line: where (line, column) and what, without PyYAML's source excerpt."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = "; ".join(part for part in (e.context, e.problem) if part)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        return where + (what or type(e).__name__)
    if isinstance(e, yaml.reader.ReaderError):  # a control character
        line = text.count("\n", 0, e.position) + 1
        return f"line {line}: character #x{e.character:04x}: {e.reason}"
    return " ".join(str(e).split())
