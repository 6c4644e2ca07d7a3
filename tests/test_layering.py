"""Imports inside `occult/` go one way (docs/design.md, "Layers"), and no module grows past MAX_LINES.

Every module's imports are read from its syntax tree: module-level and inside functions,
`import x` and `from x import y` (relative ones resolved). Each module belongs to the unit
named by the longest prefix in `LAYERS`; a unit may import from itself or from a lower layer,
never from a higher one nor from another unit of its own layer (placement and kernels do not
import each other; lm and integrations do not either). The base layer's modules may use each
other. The facade (`occult/__init__.py`, `occult/__main__.py`) is exempt, and importing it
(`from occult import OccultMoE`) from inside the package is an upward import like any other.
Imports given as strings (`importlib.import_module`, the CLI's lazy commands) are not seen.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Callable, Iterable

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "occult"
MAX_LINES = 420

LAYERS: dict[str, int] = {
    "occult._atomic": 0,
    "occult.distributed": 0,
    "occult.placement": 1,
    "occult.kernels": 1,
    "occult.moe": 2,
    "occult.lm": 3,
    "occult.integrations": 3,
    "occult.tools": 4,
    "occult.cli": 5,
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
            out.append(f"{module}:{line} imports {target}: {unit} and {tunit} share layer {r} and must not import each other")
    return out


def check_package(root: Path = PACKAGE_DIR) -> list[str]:
    modules = package_modules(root)
    problems = []
    for name, path in modules.items():
        found = imports_of(path.read_text(), name, path.name == "__init__.py", modules.__contains__)
        problems += violations(name, found)
    return problems


# ------------------------------------------------------------------ the package
def test_imports_follow_the_layers():
    problems = check_package()
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_every_layer_exists_and_every_module_has_a_layer():
    modules = package_modules()
    for unit in LAYERS:
        assert unit in modules, f"{unit} is in LAYERS but not in occult/"
    assert all(unit_of(m) is not None for m in modules)


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE_DIR.parent)): n for p in PACKAGE_DIR.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by job (at most {MAX_LINES} lines): {long}"


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
    assert "occult.lm.model:2 imports occult.integrations.hf" in p and "share layer 3" in p
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
    assert listed == actual, f"missing from docs/design.md: {sorted(actual - listed)}; not in occult/: {sorted(listed - actual)}"


def test_importing_occult_leaves_triton_and_dynamo_unimported():
    """`import occult` (and its kernels package) must not import Triton or torch._dynamo: Triton
    imported early cannot switch to its CPU interpreter later (the kernel tests set
    TRITON_INTERPRET=1 on import), and torch._dynamo costs seconds at every start."""
    import subprocess
    import sys

    code = ("import sys, occult, occult.kernels, occult.moe.layer; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
