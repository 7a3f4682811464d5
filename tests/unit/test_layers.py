"""The package's shape, from its source: the layer map of docs/architecture.md holds (no import
from a lower layer to a higher one), no two modules import each other round a circle, no module
is over 500 lines, and no private name is imported from another module. Imports inside functions
and under ``TYPE_CHECKING`` count: they are dependencies all the same."""

import ast
import re
from pathlib import Path

from megatron_rl_fp8.fp8.recipes import RECIPE_NAMES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_rl_fp8"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module of the package, the name taken from it or None, line) of every import."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                # ``from pkg import module`` imports the module; ``from module import name``
                # takes a name from it.
                found.append(
                    (sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno)
                )
    return [(t, n, line) for t, n, line in found if t in MODULES]


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer_map() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for row in re.findall(r"^\| *(\d+) *\|([^|]*)\|", section, flags=re.M):
        for entry in re.findall(r"`([\w.]+)`", row[1]):
            layers[f"{PACKAGE}.{entry}"] = int(row[0])
    assert layers, "docs/architecture.md has no layer table under '## Layers'"
    return layers


LAYERS = _layer_map()


def layer_of(module: str) -> int | None:
    if module == PACKAGE:
        return 0
    best = max(
        (k for k in LAYERS if module == k or module.startswith(k + ".")), key=len, default=None
    )
    return None if best is None else LAYERS[best]


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"add these to the layer table of docs/architecture.md: {missing}"


def test_no_import_runs_up_the_layers():
    upward = [
        f"{MODULES[m].relative_to(ROOT)}:{line} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, found in IMPORTS.items()
        for t, _, line in found
        if layer_of(t) is not None and layer_of(m) is not None and layer_of(t) > layer_of(m)
    ]
    assert not upward, "\n".join(upward)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    graph = {m: sorted({t for t, _, _ in found if t != m}) for m, found in IMPORTS.items()}
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_no_import_cycle():
    assert not _cycles()


def test_the_cycle_finder_finds_one():
    # A check that cannot fail checks nothing: two modules that import each other are found.
    saved = dict(IMPORTS)
    a, b = f"{PACKAGE}.loss", f"{PACKAGE}.fp8"
    try:
        IMPORTS[a] = [*IMPORTS[a], (b, None, 0)]
        IMPORTS[b] = [*IMPORTS[b], (a, None, 0)]
        assert any(a in c and b in c for c in _cycles())
    finally:
        IMPORTS.clear()
        IMPORTS.update(saved)


def test_no_private_name_crosses_a_module():
    crossing = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {n} from {t}"
        for m, found in IMPORTS.items()
        for t, n, line in found
        if n is not None and n.startswith("_") and not n.startswith("__") and t != m
    ]
    assert not crossing, "\n".join(crossing)


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_loop_holds_the_order_of_the_phases_and_little_else():
    loop = ROOT / PACKAGE / "trainer" / "loop.py"
    assert len(loop.read_text().splitlines()) <= 220


def _strings(node: ast.AST) -> list[str]:
    """The string constants of a comparison operand: a constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def _names_recipe(node: ast.AST) -> bool:
    """Whether an expression reads a recipe: a name or attribute called ``*recipe*``, or
    ``config_value(cfg, "fp8.recipe")``-style lookups of the key."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and "recipe" in sub.id.lower():
            return True
        if isinstance(sub, ast.Attribute) and "recipe" in sub.attr.lower():
            return True
        if isinstance(sub, ast.Constant) and sub.value == "fp8.recipe":
            return True
    return False


def recipe_branches(path: Path) -> list[str]:
    """Every place in ``path`` that compares a recipe with a name, or spells a name only a
    training recipe has ('bf16' and 'blockwise' also name dtypes and the rollout quantization)."""
    only_recipes = set(RECIPE_NAMES) - {"bf16", "blockwise"}
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_recipe(o) for o in operands) and any(_strings(o) for o in operands):
                found.append(f"{path.name}:{node.lineno}: compares a recipe with a name")
        if (
            isinstance(node, ast.Constant)
            and id(node) not in docstrings
            and isinstance(node.value, str)
            and node.value in only_recipes
        ):
            found.append(f"{path.name}:{node.lineno}: names recipe {node.value!r}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_no_module_outside_fp8_branches_on_a_recipe_name():
    """What depends on the recipe reads its description (fp8/recipes.py): a new recipe is one
    entry there plus its kernels, not an edit of the planner, the config and the report."""
    found = [
        hit
        for name, path in MODULES.items()
        if not (name == f"{PACKAGE}.fp8" or name.startswith(f"{PACKAGE}.fp8."))
        for hit in recipe_branches(path)
    ]
    assert not found, "\n".join(found)


def test_the_recipe_branch_finder_finds_them(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""Docstrings may say \'rowwise\'."""\n'
        "def f(cfg, recipe):\n"
        '    if cfg.fp8.recipe != "bf16":\n'
        "        return 1\n"
        '    table = {"mxfp8": 2}\n'
        '    return recipe in ("blockwise",)\n'
    )
    assert recipe_branches(src) == [
        "m.py:3: compares a recipe with a name",
        "m.py:5: names recipe 'mxfp8'",
        "m.py:6: compares a recipe with a name",
    ]


def sys_path_edits(path: Path) -> list[str]:
    """``file:line`` of every change to ``sys.path`` in ``path`` (a call of one of its methods
    that changes it, an assignment to it or to an item of it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear"):
                targets = [node.func.value]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t.value if isinstance(t, ast.Subscript) else t for t in targets]
        if any(ast.unparse(t) == "sys.path" for t in targets):
            found.append(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}"
            )
    return found


def test_nothing_edits_sys_path():
    """Scripts (benchmarks/, scripts/) import the installed package, never each other, and tests
    load a script from its file (tests/scripts.py): no module reaches another through sys.path."""
    skip = {".git", ".venv", ".venv-sglang", "runs"}
    files = [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]
    assert len(files) > 100
    found = [hit for path in files for hit in sys_path_edits(path)]
    assert not found, "\n".join(found)


def test_the_sys_path_finder_finds_them(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""Docstrings may say sys.path.insert."""\n'
        "import sys\n"
        "sys.path.insert(0, 'x')\n"
        "sys.path[0] = 'y'\n"
        "sys.path += ['z']\n"
        "print(sys.path.index('x'))\n"
    )
    assert sorted(sys_path_edits(src)) == ["m.py:3", "m.py:4", "m.py:5"]


def engine_name_uses(path: Path, word: str = "sglang") -> list[str]:
    """``file:line`` of code in ``path`` that names ``word`` (case-insensitive): an import, a
    name, an attribute or a string. Docstrings and comments may describe it (the FP8 checkpoint
    format SGLang reads, say)."""
    tree = ast.parse(path.read_text())
    # A string that is a statement of its own is prose: a docstring, or one under a field.
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            text = " ".join(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            text = " ".join([node.module or "", *(a.name for a in node.names)])
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = "" if id(node) in docstrings else node.value
        else:
            continue
        if word in text.lower():
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_engines_own_folder_names_sglang():
    """The trainer, the CLI, the study, the config, the planner and the launcher reach an engine
    through its registered spec (rollout/registry.py); SGLang's settings and words live in
    rollout/sglang/ alone."""
    found = [
        hit
        for name, path in MODULES.items()
        if not name.startswith(f"{PACKAGE}.rollout.sglang")
        for hit in engine_name_uses(path)
    ]
    assert not found, "\n".join(found)


def test_the_engine_name_finder_finds_code_not_prose(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""SGLang reads weight_scale_inv."""\n'
        "from x.sglang import y  # SGLang\n"
        "def f(cfg):\n"
        '    """Like SGLang does."""\n'
        "    return cfg.rollout.sglang, 'use rollout.sglang.x', SGLangFleet\n"
        "X = 'sglang'\n"
        '"""X: what SGLang calls it."""\n'
    )
    assert sorted(engine_name_uses(src)) == ["m.py:2", "m.py:5", "m.py:5", "m.py:5", "m.py:6"]
