"""Fault injection for the SGLang engines (testing only): kill an engine at named points.

Tests, and CLI runs with ``MRF8_SGLANG_FAULT=<point>[@<n>][,...]``, use it to drive every recovery
path of the fleet deterministically instead of killing on a timer.
"""

from __future__ import annotations

import os
import sys
from typing import Protocol

FAULT_ENV = "MRF8_SGLANG_FAULT"
# Where the fleet calls its fault hook, in the order a run meets them. ``startup``: right after a
# (re)launch, before the engine is healthy; ``generate``: while a rollout's requests are in
# flight; the rest: just before the sync's calls they name (``end_update`` includes the version
# check).
FAULT_POINTS = ("startup", "generate", "begin_update", "push", "end_update")


class Killable(Protocol):
    """What a fault hook kills: a fleet (``pool.ServerPool.kill_server``: its last engine)."""

    def kill_server(self) -> None: ...


def parse_fault_spec(spec: str) -> dict[str, set[int]]:
    """``"push@2,generate"`` -> ``{"push": {2}, "generate": {1}}`` (point -> 1-based occurrences)."""
    plan: dict[str, set[int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, nth = item.partition("@")
        if point not in FAULT_POINTS or not (nth == "" or nth.isdigit() and int(nth) >= 1):
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: {item!r} is not <point>[@<n>] with n >= 1 and "
                f"point one of {', '.join(FAULT_POINTS)}"
            )
        plan.setdefault(point, set()).add(int(nth or 1))
    return plan


class KillServerAt:
    """TESTING ONLY: a ``fault_hook`` that SIGKILLs the fleet's last engine at chosen points.

    ``KillServerAt(engine, "begin_update")`` kills at the first ``begin_update`` the engine meets
    after this object is installed, ``"push@3"`` at the third push, ``"generate,startup@1"`` at the
    first rollout and then during the first relaunch. Occurrences count per point, from
    installation. The kill takes the whole process group and waits until it is gone, so the very
    next call to that engine fails the way a crash makes it fail. Production runs never install
    one; the fleet installs one only when ``MRF8_SGLANG_FAULT`` is set (read once, at construction).
    """

    def __init__(self, engine: Killable, spec: str):
        self.engine = engine
        self.plan = parse_fault_spec(spec)
        self.seen: dict[str, int] = {}
        self.fired: list[str] = []  # "point@n" of every kill, for tests to assert on

    def __call__(self, point: str) -> None:
        n = self.seen[point] = self.seen.get(point, 0) + 1
        if n in self.plan.get(point, ()):
            self.fired.append(f"{point}@{n}")
            self.engine.kill_server()


def fault_hook_from_env(engine: Killable) -> KillServerAt | None:
    """The hook ``MRF8_SGLANG_FAULT`` asks for (read once, when the fleet is built), or None."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    hook = KillServerAt(engine, spec)
    print(
        f"[sglang] {FAULT_ENV}={spec!r}: an engine will be SIGKILLed at these points "
        "(fault injection, for tests only)",
        file=sys.stderr,
        flush=True,
    )
    return hook
