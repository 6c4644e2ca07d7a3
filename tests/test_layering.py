"""Imports inside `occult/` go one way (docs/design.md, "Layers"), and no module grows past MAX_LINES.

Every module's imports are read from its syntax tree: module-level and inside functions,
`import x` and `from x import y` (relative ones resolved). Each module belongs to the unit
named by the longest prefix in `LAYERS`; a unit may import from itself or from a lower layer,
never from a higher one nor from another unit of its own layer (placement and kernels do not
import each other; lm and integrations do not either). The base layer's modules may use each
other. The facade (`occult/__init__.py`, `occult/__main__.py`) is exempt, and importing it
(`from occult import OccultMoE`) from inside the package is an upward import like any other.
Imports given as strings (`importlib.import_module`, the CLI's lazy commands) are not seen.

The same walk also fails on (issue 25, "No circles, public seams"): an import circle between
modules of `occult/`; a private name (`_x`, not a dunder) of one module used by another, imported
(`from occult.a.b import _c`) or reached through an imported module (`b._c`); a private module
(`occult.a._m`) imported from outside its package `occult.a`; a function or method longer than
MAX_FUNCTION_LINES; a file longer than MAX_LINES; and an environment variable (`OCCULT_*`,
`TRITON_INTERPRET`) named anywhere but `occult/settings.py`, which reads them all.
Violations in files being rewritten now are listed in PENDING, which may only shrink.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "occult"
MAX_LINES = 400
MAX_FUNCTION_LINES = 80

LAYERS: dict[str, int] = {
    "occult._atomic": 0,
    "occult._rank_signals": 0,
    "occult._rank_preload": 0,
    "occult.settings": 0,
    "occult.distributed": 0,
    "occult.teardown": 0,
    "occult.placement": 1,
    "occult.kernels": 1,
    "occult.moe": 2,
    "occult.training": 3,
    "occult.lm": 4,
    "occult.integrations": 4,
    "occult.tools": 5,
    "occult.cli": 6,
}
BASE = 0
FACADE = ("occult", "occult.__main__")
FACADE_RANK = max(LAYERS.values()) + 1


def package_modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under `root` (packages by their __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(source: str, module: str, is_package: bool, is_module: Callable[[str], bool]) -> list[tuple[int, str]]:
    """(line, imported occult module) for every import anywhere in `source`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub) else target))
    return [(line, name) for line, name in found if name == "occult" or name.startswith("occult.")]


def unit_of(module: str) -> str | None:
    """The `LAYERS` entry a module belongs to (longest prefix), the facade, or None."""
    if module in FACADE:
        return module
    best = None
    for unit in LAYERS:
        if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best)):
            best = unit
    return best


def rank_of(unit: str) -> int:
    return FACADE_RANK if unit in FACADE else LAYERS[unit]


def violations(module: str, imports: Iterable[tuple[int, str]]) -> list[str]:
    """What is wrong with `module` importing these (empty when it keeps to the layers)."""
    unit = unit_of(module)
    if unit is None:
        return [f"{module}: not in any layer; add its package to LAYERS (tests/test_layering.py) and docs/design.md"]
    if unit in FACADE:
        return []
    out = []
    for line, target in imports:
        tunit = unit_of(target)
        if tunit is None:
            out.append(f"{module}:{line} imports {target}, which is in no layer")
            continue
        if tunit == unit:
            continue
        r, t = rank_of(unit), rank_of(tunit)
        if t > r:
            out.append(f"{module}:{line} imports {target}: {tunit} (layer {t}) is above {unit} (layer {r})")
        elif t == r and r != BASE:
            out.append(
                f"{module}:{line} imports {target}: {unit} and {tunit} share layer {r} and must not import each other"
            )
    return out


def check_package(root: Path = PACKAGE_DIR) -> list[str]:
    modules = package_modules(root)
    problems = []
    for name, path in modules.items():
        found = imports_of(path.read_text(), name, path.name == "__init__.py", modules.__contains__)
        problems += violations(name, found)
    return problems


# ------------------------------------------------------------------ circles, private names, sizes, settings
# Violations in files being rewritten now (the moe core, the training core, hf generation), to be
# emptied by issue 25's redesign. The list may only shrink: a new violation fails, and so does an
# entry here that no longer violates (delete it then).
PENDING: frozenset[str] = frozenset({})

ENV_NAME = re.compile(r"(OCCULT_[A-Z0-9_]+|TRITON_INTERPRET)")
SETTINGS_MODULE = "occult.settings"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` names (relative ones resolved against `package`)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_graph(root: Path = PACKAGE_DIR) -> dict[str, dict[str, int]]:
    """{module: {occult module it imports: first line}} (function-level imports included)."""
    modules = package_modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, target in imports_of(path.read_text(), name, path.name == "__init__.py", modules.__contains__):
            if target != name and target in modules:
                edges.setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every set of modules that import each other in a circle (strongly connected, > 1 module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def private_uses(source: str, module: str, is_package: bool, is_module: Callable[[str], bool]) -> list[tuple[int, str]]:
    """(line, `module.name`) for every private name of another occult module that `source` uses:
    imported by name, reached as an attribute of an imported module, or a private module imported
    from outside its package."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # local name -> the occult module it is bound to

    def outside_private_module(line: int, target: str) -> None:
        parts = target.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if _is_private(part) and not (module == owner or module.startswith(owner + ".")):
                found.append((line, ".".join(parts[: i + 1])))
                return

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "occult":
                    outside_private_module(node.lineno, alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["occult"] = "occult"
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, package)
            if target.split(".")[0] != "occult":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if is_module(sub):
                    outside_private_module(node.lineno, sub)
                    bound[alias.asname or alias.name] = sub
                else:
                    outside_private_module(node.lineno, target)
                    if _is_private(alias.name) and target != module:
                        found.append((node.lineno, sub))
    for node in ast.walk(tree):  # `mod.name` / `pkg.mod.name` through a module bound above
        chain, value = [], node
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not chain or not isinstance(value, ast.Name) or value.id not in bound:
            continue
        target = bound[value.id]
        for attr in chain:
            if is_module(f"{target}.{attr}"):
                target = f"{target}.{attr}"
                continue
            if _is_private(attr) and target != module:
                found.append((node.lineno, f"{target}.{attr}"))
            break
    return sorted(set(found))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str, int]]:
    """(line, qualified name, lines) of every function or method longer than `limit` lines (def to end)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    found.append((child.lineno, name, n))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def env_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is exactly an `OCCULT_*` / `TRITON_INTERPRET`
    variable name: a read of the environment outside the settings module."""
    return sorted(
        {
            (node.lineno, node.value)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)
        }
    )


def structure_findings(root: Path = PACKAGE_DIR) -> dict[str, str]:
    """{stable key (the form PENDING lists): where it is, for the message} of every violation of
    the rules above in the package under `root`."""
    modules = package_modules(root)
    found: dict[str, str] = {}
    graph = import_graph(root)
    for members in circles(graph):
        where = "; ".join(f"{m}:{graph[m][t]} imports {t}" for m in members for t in graph[m] if t in members)
        found["circle: " + " <-> ".join(members)] = where
    for name, path in modules.items():
        source = path.read_text()
        rel = str(path.relative_to(root.parent))
        for line, used in private_uses(source, name, path.name == "__init__.py", modules.__contains__):
            found.setdefault(f"private: {name} uses {used}", f"{rel}:{line}")
        for line, qualname, n in long_functions(source):
            found[f"long function: {name}.{qualname}"] = f"{rel}:{line}, {n} lines (at most {MAX_FUNCTION_LINES})"
        if (n := len(source.splitlines())) > MAX_LINES:
            found[f"long file: {rel}"] = f"{n} lines"
        if name != SETTINGS_MODULE:
            for line, var in env_names(source):
                found.setdefault(f"env: {name} reads {var}", f"{rel}:{line}")
    return found


def rule_problems(found: dict[str, str], pending: Iterable[str], kind: str) -> tuple[list[str], list[str]]:
    """(violations of rule `kind` not in `pending`, with where they are; `pending` entries of that
    rule that no longer violate)."""
    pending = set(pending)
    mine = {k: w for k, w in found.items() if k.startswith(kind + ": ")}
    new = [f"{k}  ({w})" for k, w in sorted(mine.items()) if k not in pending]
    stale = sorted(k for k in pending if k.startswith(kind + ": ") and k not in mine)
    return new, stale


_FINDINGS: list[dict[str, str]] = []  # the package's findings, once per session (an empty dict is a result too)


def assert_rule(kind: str, fix: str) -> None:
    """Fail on a new violation of rule `kind` (saying how to `fix` it) or on a stale PENDING entry."""
    if not _FINDINGS:
        _FINDINGS.append(structure_findings())
    new, stale = rule_problems(_FINDINGS[0], PENDING, kind)
    msg = []
    if new:
        msg.append(f"{kind} ({fix}):\n  " + "\n  ".join(new))
    if stale:
        msg.append("fixed, so delete from PENDING in tests/test_layering.py:\n  " + "\n  ".join(stale))
    assert not msg, "\n".join(msg)


# ------------------------------------------------------------------ the package
def test_imports_follow_the_layers():
    problems = check_package()
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_every_layer_exists_and_every_module_has_a_layer():
    modules = package_modules()
    for unit in LAYERS:
        assert unit in modules, f"{unit} is in LAYERS but not in occult/"
    assert all(unit_of(m) is not None for m in modules)


RULES = {
    "circle": "break it: move what both need into a module below them",
    "private": "make the seam public (drop the underscore; grep every use, tests included) or move the code",
    "long function": f"split it into steps of at most {MAX_FUNCTION_LINES} lines, each with one job",
    "long file": f"split it by job (at most {MAX_LINES} lines)",
    "env": "read the variable through occult.settings (add it there and to docs/settings.md)",
}


def test_no_import_circles():
    assert_rule("circle", RULES["circle"])


def test_no_private_names_used_across_modules():
    assert_rule("private", RULES["private"])


def test_no_function_is_too_long():
    assert_rule("long function", RULES["long function"])


def test_no_module_is_too_long():
    assert_rule("long file", RULES["long file"])


def test_environment_is_read_only_by_the_settings_module():
    assert_rule("env", RULES["env"])


def test_pending_entries_name_a_rule():
    assert all(p.split(": ", 1)[0] in RULES for p in PENDING), sorted(PENDING)


# ------------------------------------------------------------------ the checker itself
def _check(module: str, source: str, is_package: bool = False) -> list[str]:
    known = package_modules()
    return violations(module, imports_of(source, module, is_package, known.__contains__))


def test_checker_finds_upward_imports_in_function_bodies():
    src = "import numpy\n\ndef f():\n    from occult.moe.layer import OccultMoE\n    return OccultMoE\n"
    (problem,) = _check("occult.placement.stats", src)
    assert "occult.placement.stats:4 imports occult.moe.layer" in problem and "above" in problem


def test_checker_finds_siblings_relative_imports_and_the_facade():
    (p,) = _check("occult.kernels.op", "from occult.placement import Placement\n")
    assert "share layer 1" in p and "occult.kernels" in p and "occult.placement" in p
    (p,) = _check("occult.lm.model", "def f():\n    from occult.integrations import hf\n")
    assert "occult.lm.model:2 imports occult.integrations.hf" in p and "share layer 4" in p
    (p,) = _check("occult.tools.demo", "from ..cli import main\n")  # relative: occult.cli
    assert "imports occult.cli" in p and "above" in p
    (p,) = _check("occult.moe", "from .. import cli\n", is_package=True)  # package __init__
    assert "imports occult.cli" in p
    (p,) = _check("occult.moe.layer", "from occult import OccultMoE\n")  # the facade
    assert "imports occult:" in p and "above" in p
    (p,) = _check("occult.distributed", "import occult.placement.trace as t\n")
    assert "above" in p
    assert "not in any layer" in _check("occult.newthing", "")[0]


def test_checker_allows_downward_and_own_unit_imports():
    src = (
        "from occult._atomic import atomic_path\nfrom occult.placement import Placement\n"
        "from . import routing\nfrom .plan import trim\nfrom occult import kernels\n"
        "def f():\n    import occult.moe.comm\n"
    )
    assert _check("occult.moe.layer", src) == []
    assert _check("occult.distributed", "from occult._atomic import atomic_path\n") == []
    assert _check("occult", "from occult.cli import main\n", is_package=True) == []  # the facade is exempt


def _tiny_package(root: Path, files: dict[str, str]) -> Path:
    """A package `occult` under `root` with these {relative path: source} files."""
    pkg = root / "occult"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_checker_finds_circles_through_function_level_imports(tmp_path):
    pkg = _tiny_package(
        tmp_path,
        {
            "a.py": "from occult.b import f\n",
            "b.py": "def f():\n    from occult import a\n",  # b -> a only inside a function: still a circle
            "c.py": "import occult.a\n",  # imports into the circle without closing one
            "d/__init__.py": "from .e import g\n",
            "d/e.py": "def g():\n    from . import h\n",
            "d/h.py": "import occult.d.e\n",
        },
    )
    assert circles(import_graph(pkg)) == [["occult.a", "occult.b"], ["occult.d.e", "occult.d.h"]]
    found = structure_findings(pkg)
    assert found["circle: occult.a <-> occult.b"] == "occult.a:1 imports occult.b; occult.b:2 imports occult.a"
    assert "circle: occult.d.e <-> occult.d.h" in found


def test_checker_finds_private_names_used_across_modules():
    known = {"occult", "occult.a", "occult.a.b", "occult.a._m", "occult.x", "occult.x.y"}.__contains__

    def uses(src: str, module: str = "occult.x.y") -> list[tuple[int, str]]:
        return private_uses(src, module, False, known)

    assert uses("from occult.a.b import _c, d, __all__\n") == [(1, "occult.a.b._c")]
    assert uses("from .b import _c as c\n", "occult.a.z") == [(1, "occult.a.b._c")]  # relative
    assert uses("import occult.a.b as m\ndef f():\n    return m._c + m.d + m.__name__\n") == [(3, "occult.a.b._c")]
    assert uses("from occult.a import b\nb._c()\n") == [(2, "occult.a.b._c")]
    assert uses("import occult.a.b\nx = occult.a.b._c\n") == [(2, "occult.a.b._c")]
    assert uses("from occult.a import _m\n") == [(1, "occult.a._m")]  # a private module, from outside
    assert uses("import occult.a._m\n") == [(1, "occult.a._m")]
    assert uses("from occult.a import _m\n", "occult.a.b") == []  # ... from inside its package
    assert uses("from occult.a._m import f\n", "occult.a.q") == []
    assert uses("from occult.a.b import _c\n", "occult.a.b") == []  # its own name
    assert uses("import os\nos._exit\nfrom numpy import _x\n") == []  # not occult's


def test_checker_finds_long_functions_and_methods():
    body = "        x = 1\n"
    src = (
        "class A:\n    def m(self):\n"
        + body * 79
        + "    async def n(self):\n"
        + body * 80
        + "def f():\n    def g():\n"
        + body * 80
        + "    return g\n"
    )
    assert long_functions(src) == [(82, "A.n", 81), (163, "f", 83), (164, "f.g", 81)]  # A.m: exactly 80


def test_checker_finds_environment_reads_and_only_them():
    src = (
        '"""Set OCCULT_FOO=1 to ... (prose is not a read)."""\nimport os\n'
        'a = os.environ.get("OCCULT_FOO", "")\nb = os.getenv("TRITON_INTERPRET")\nc = "OCCULT_FOO is bad"\n'
    )
    assert env_names(src) == [(3, "OCCULT_FOO"), (4, "TRITON_INTERPRET")]


def test_pending_entries_must_still_violate():
    found = {"private: a uses b._c": "a.py:1", "long file: x.py": "401 lines"}
    new, stale = rule_problems(found, {"private: a uses b._c", "private: a uses b._gone"}, "private")
    assert new == [] and stale == ["private: a uses b._gone"]
    new, stale = rule_problems(found, set(), "long file")
    assert new == ["long file: x.py  (401 lines)"] and stale == []


def test_design_doc_module_map_matches_the_tree():
    """docs/design.md lists every module under occult/ (and nothing that is not there)."""
    doc = (PACKAGE_DIR.parent / "docs" / "design.md").read_text()
    table = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed, package = set(), None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`"):
            continue
        if cells[0]:
            package = cells[0].strip("`").rstrip("/")
        for name in re.findall(r"`([^`]+)`", cells[1]):
            listed.add(f"{package}/{name}")
    actual = {str(p.relative_to(PACKAGE_DIR.parent)) for p in PACKAGE_DIR.rglob("*.py")}
    actual |= {str(p.relative_to(PACKAGE_DIR.parent)) for p in (PACKAGE_DIR / "data").iterdir()}
    assert listed == actual, (
        f"missing from docs/design.md: {sorted(actual - listed)}; not in occult/: {sorted(listed - actual)}"
    )


def test_importing_occult_leaves_triton_and_dynamo_unimported():
    """`import occult` (and its kernels package) must not import Triton or torch._dynamo: Triton
    imported early cannot switch to its CPU interpreter later (the kernel tests set
    TRITON_INTERPRET=1 on import), and torch._dynamo costs seconds at every start."""
    import subprocess
    import sys

    code = (
        "import sys, occult, occult.kernels, occult.moe.layer; "
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
