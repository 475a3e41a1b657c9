"""DESIGN section 3's direction of imports, over every module of the package, read with ast: module-level imports,
those under TYPE_CHECKING and those inside functions alike (a type or a lazy import that ran up would still tie a
lower part to a higher one)."""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve

PACKAGE = Path(deltaserve.__file__).parent
# the ground floor: data-only leaves that import nothing of the package but each other
LEAVES = {"config", "sampling_params", "request", "forward_batch", "scheduler_output", "runner_output", "cache_spec",
          "kernel_options"}
# parts that import only leaves, and that any part above the leaves may use
GROUND = {"cache", "tokenizer", "distributed"}
# the one-way order, lowest first: each part imports only parts before it (and itself); structured (the grammars
# of structured outputs) uses kernels and serves core and the entrypoints
ORDER = ["kernels", "layers", "models", "loader", "runner", "structured", "core", "entrypoints", "parity", "__init__"]
# the CLI alone dispatches to parity (DESIGN section 3); (importing module, imported part)
ALLOWED_UPWARD = {("deltaserve.entrypoints.cli", "parity")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The part a dotted module of the package belongs to: its first name below `deltaserve` ('__init__' for the
    package itself, whose __init__ re-exports the offline API)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted module of the package, line) for every import in the tree, wherever it stands."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "deltaserve"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "deltaserve":
                continue
            for alias in node.names:  # `from deltaserve.x import y`: y may be a submodule, which is what is imported
                sub = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists()
                found.append((sub if is_module else base, node.lineno))
    return found


def _allowed(importer: str, imported: str) -> bool:
    mine, theirs = _part(importer), _part(imported)
    if theirs in LEAVES or mine == theirs or (importer, theirs) in ALLOWED_UPWARD:
        return True
    if mine in LEAVES or mine in GROUND:
        return False
    if theirs in GROUND:
        return True
    return mine in ORDER and theirs in ORDER and ORDER.index(theirs) < ORDER.index(mine)


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        for imported, line in _imported(tree, module, path.name == "__init__.py"):
            if not _allowed(module, imported):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {imported}")
    return bad


def test_every_part_is_known():
    """A new top-level module or folder must be placed in the order (or among the leaves) here and in DESIGN."""
    parts = {_part(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts <= LEAVES | GROUND | set(ORDER), sorted(parts - LEAVES - GROUND - set(ORDER))


def test_imports_point_one_way():
    assert _violations() == []


def test_the_check_sees_upward_imports_of_every_kind():
    """The rule catches a type-only import and a function-local one, not only those at the top of a module."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from deltaserve.runner.x import A\n"
              "def f():\n    from deltaserve.core import y\n")
    found = _imported(ast.parse(source), "deltaserve.layers.kda", False)
    assert [imported for imported, _ in found] == ["deltaserve.runner.x", "deltaserve.core"]
    assert not any(_allowed("deltaserve.layers.kda", imported) for imported, _ in found)
    assert _allowed("deltaserve.layers.kda", "deltaserve.kernels.norm")
    assert not _allowed("deltaserve.config", "deltaserve.kernels.norm")


def test_our_environment_variables_are_read_only_by_the_command_line():
    """DELTASERVE_* may set a command-line option's default, never steer code below the CLI (DESIGN section 4)."""
    readers = {_module_name(p) for p in PACKAGE.rglob("*.py") if "DELTASERVE_" in p.read_text()}
    assert readers <= {"deltaserve.entrypoints.cli", "deltaserve.entrypoints.openai.command"}, sorted(readers)
