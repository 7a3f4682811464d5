"""Tools for the multi-turn tests (``env.tools=tests.tools_for_tests:<name>``): importable by the
spawned tool workers, as a user's tools must be."""

import time


def echo(name: str, arguments: dict, record: dict) -> str:
    return f"{name}:{arguments.get('expression', '')}:{record.get('id', '')}"


def broken(name: str, arguments: dict, record: dict) -> str:
    raise RuntimeError("the service is down")


def hangs(name: str, arguments: dict, record: dict) -> str:
    time.sleep(3600)
    return ""


def not_text(name: str, arguments: dict, record: dict):
    return 42


def huge(name: str, arguments: dict, record: dict) -> str:
    return "x" * 1_000_000
