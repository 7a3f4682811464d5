"""Every command in the README's shell blocks works here, run as written or dry-run.

The README is the front door, so a command in it that fails is the first thing a user hits. Each
fenced shell block is split into commands, and each command is checked by the rule for its program:

* ``make TARGET [VAR=value ...]``: ``make -n`` finds the target. ``make run`` also checks the
  training job it starts, as ``train`` below.
* ``megatron-rl-fp8 ...``, ``python -m megatron_rl_fp8 ...``, and the same under ``torchrun``: run
  in this process. ``config`` and ``plan`` run as written. ``train`` runs as ``plan`` of the same
  config and overrides, on torchrun's ranks as GPUs. That is the config and layout check ``train``
  makes before any compute, minus the packages this machine lacks and checkpoint folders that exist
  only on a cluster (the config states the model's shape).
* ``python scripts/X.py`` (or ``benchmarks/``): runs as written when it is cheap (``RUN_AS_WRITTEN``); otherwise its
  ``--help`` must work.
* ``pip install``: ``torch==V`` is the Makefile's pin, and ``-e ".[extras]"`` names extras that
  ``setup.py`` has.
* ``python3 -m venv DIR`` and ``. DIR/bin/activate``: DIR is the Makefile's venv.

The commands run in order, in a scratch directory. So ``scripts/make_tiny_hf_model.py`` writes
``runs/tiny_hf/`` there, and the next command's config finds it. Repository paths
(``examples/...``, ``scripts/...``) are resolved from the repository root. A command that no rule
knows fails the test, so the README cannot gain an unchecked command. Also checked: the README's
test command is the one ``.ci/run`` calls, every ``examples/*.yaml`` is in its table, every path
and link it names exists, and every ``make`` target and ``megatron-rl-fp8`` subcommand it names
is real.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
REPO_DIRS = ("examples/", "scripts/", "benchmarks/", "slurm/", "docs/", "dev/")
RUN_AS_WRITTEN = {
    "scripts/make_tiny_hf_model.py"
}  # a few seconds; the next command needs its output
MAX_LINES = 130  # a front door: settings go to `megatron-rl-fp8 config` and the docs that own them


def shell_blocks(text: str) -> list[str]:
    blocks = re.findall(r"^```([\w-]*)\n(.*?)^```", text, flags=re.M | re.S)
    return [body for lang, body in blocks if lang in SHELL_LANGS]


def commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists: continuations joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        argv: list[str] = []
        for tok in [*lex, ";"]:
            if tok in ("&&", "||", ";", "|"):
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(tok)
    return out


def makefile_var(name: str) -> str:
    m = re.search(rf"^{name} \?= (\S+)$", MAKEFILE.read_text(), flags=re.M)
    assert m, f"Makefile has no `{name} ?=`"
    return m.group(1)


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_-]+):", MAKEFILE.read_text(), flags=re.M))


def setup_extras() -> set[str]:
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {k.value for k in node.value.keys}
    raise AssertionError("setup.py has no extras_require")


def repo_path(arg: str) -> str:
    return str(ROOT / arg) if arg.startswith(REPO_DIRS) and (ROOT / arg).exists() else arg


def run_cli(argv: list[str]) -> None:
    from megatron_rl_fp8.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([repo_path(a) for a in argv])
    assert rc == 0, f"megatron-rl-fp8 {' '.join(argv)}: exit {rc}\n{err.getvalue()[-2000:]}"


def check_cli(args: list[str], gpus_per_node: int = 1, nodes: int = 1) -> None:
    sub, rest = args[0], args[1:]
    if sub == "train":
        assert not [a for a in rest if a.startswith("-")], f"train takes no flags: {args}"
        config, overrides = (rest[0], rest[1:]) if rest else ("examples/tiny_cpu.yaml", [])
        plan = ["plan", "--gpus-per-node", str(gpus_per_node), "--nodes", str(nodes)]
        run_cli([*plan, config, *overrides])
    elif sub in ("config", "plan"):
        run_cli(args)
    else:
        raise AssertionError(f"no check for `megatron-rl-fp8 {sub}` yet: add one to {__file__}")


def check_torchrun(args: list[str]) -> None:
    nproc, nnodes, i = 1, 1, 0
    while i < len(args) and args[i] != "-m":
        flag, _, value = args[i].partition("=")
        if not value:
            value, i = args[i + 1], i + 1
        if flag in ("--nproc-per-node", "--nproc_per_node"):
            nproc = int(value)
        elif flag == "--nnodes":
            nnodes = int(value)
        i += 1
    assert args[i : i + 2] == ["-m", "megatron_rl_fp8"], f"torchrun runs what? {args}"
    check_cli(args[i + 2 :], gpus_per_node=nproc, nodes=nnodes)


def check_make(args: list[str]) -> None:
    done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"make -n {' '.join(args)}: {done.stderr}"
    if args[0] == "run":  # the job it starts: `train $(CONFIG) $(ARGS)`
        given = dict(a.split("=", 1) for a in args[1:] if "=" in a)
        config = given.get("CONFIG", makefile_var("CONFIG"))
        check_cli(["train", config, *shlex.split(given.get("ARGS", ""))])


def check_pip(args: list[str]) -> None:
    assert args[0] == "install", f"pip {args}"
    specs = [a for a in args[1:] if a != "-e"]
    for spec in specs:
        if spec.startswith("torch=="):
            pin = re.search(r"pip install -q (torch==[\w.+]+)", MAKEFILE.read_text())
            assert pin, "the Makefile pins no torch"
            assert pin.group(1) == spec, f"README pins {spec}, the Makefile {pin.group(1)}"
        elif m := re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec):
            assert (ROOT / "setup.py").exists()
            missing = set((m.group(1) or "").split(",")) - setup_extras() - {""}
            assert not missing, f"setup.py has no extras {missing}"
        else:
            raise AssertionError(f"no check for `pip install {spec}` yet: add one to {__file__}")


def check_tool(script: str, args: list[str], monkeypatch) -> None:
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if script in RUN_AS_WRITTEN:
        monkeypatch.setattr(sys, "argv", [script, *args])
        runpy.run_path(str(ROOT / script), run_name="__main__")
    else:
        cmd = [sys.executable, script, "--help"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{script} --help: {done.stderr[-2000:]}"


def check(argv: list[str], monkeypatch) -> None:
    prog, args = argv[0], argv[1:]
    venv = makefile_var("VENV")
    if prog == "make":
        check_make(args)
    elif prog == "megatron-rl-fp8":
        check_cli(args)
    elif prog == "torchrun":
        check_torchrun(args)
    elif prog == "pip":
        check_pip(args)
    elif prog in (".", "source"):
        assert args == [f"{venv}/bin/activate"], f"activates {args}, the Makefile's venv is {venv}"
    elif prog in ("python", "python3") and args[:2] == ["-m", "venv"]:
        assert args[2:] == [venv], f"creates {args[2:]}, the Makefile's venv is {venv}"
    elif prog in ("python", "python3") and args[:2] == ["-m", "megatron_rl_fp8"]:
        check_cli(args[2:])
    elif prog in ("python", "python3") and args and args[0].startswith(("scripts/", "benchmarks/")):
        check_tool(args[0], args[1:], monkeypatch)
    else:
        raise AssertionError(f"no check for `{shlex.join(argv)}` yet: add one to {__file__}")


def test_every_readme_command_runs_or_dry_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmds = [c for block in shell_blocks(README.read_text()) for c in commands(block)]
    assert len(cmds) > 5, "the README's shell blocks were not found"
    for argv in cmds:
        check(argv, monkeypatch)


def test_readme_test_command_is_the_one_ci_runs():
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    readme = [shlex.join(c) for b in shell_blocks(README.read_text()) for c in commands(b)]
    assert "make test" in readme and "make test" in ci
    text = README.read_text()
    for line in sorted(ci):
        if line.startswith("make "):
            assert f"`{line}`" in text, f".ci/run runs `{line}`; the README does not say so"


def test_readme_lists_every_example_and_names_only_what_exists():
    text = README.read_text()
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        assert f"`examples/{path.name}`" in text, f"the README's example table lacks {path.name}"
    named = re.findall(r"\b(?:examples|tools|slurm|docs|dev|tests)/[\w./-]*\w", text)
    named += re.findall(r"\]\(([^)#]+)\)", text)
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_readme_names_real_make_targets_and_subcommands():
    from megatron_rl_fp8.cli import main

    text = README.read_text()
    targets = set(re.findall(r"`make ([\w-]+)", text))
    assert targets and not targets - make_targets(), f"no such targets: {targets - make_targets()}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["-h"])
    real = set(re.search(r"\{([\w,]+)\}", out.getvalue()).group(1).split(","))
    named = set(re.findall(r"`megatron-rl-fp8 ([a-z]+)", text))
    assert named and not named - real, f"no such subcommands: {named - real}"


def test_readme_stays_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): put settings in the doc that owns "
        "them (docs/train_your_own.md, docs/stability.md, ...); `megatron-rl-fp8 config` prints "
        "every one with its help"
    )
