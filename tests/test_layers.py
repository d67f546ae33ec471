"""The layer map of docs/development.md, kept true by reading every import in hpc_verl/ with ast.

Every import counts, also those inside functions (they run, just later), except under
``if TYPE_CHECKING:`` for the layers; the circle rule counts those too (a circle hidden from the
runtime is still one). Rules: no import circle between modules; a package imports only
packages below it in ``LAYERS``; inside launch/, ``spec`` runs nothing and never imports a
backend; nothing below cli/ imports cli/; cli/ names no backend (it calls the interface in
``hpc_verl.launch.backends`` and branches on nothing). Inside trainer/, the sub-packages form
layers too (``TRAINER_LAYERS``); config/ and driver/ import no torch, transformers or vLLM at a
module's top, and a trainer module imports inside a function only an optional heavy package
(``HEAVY``) or with a reason in a comment on the line.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hpc_verl"

# Lowest first: a package may import its own modules and those of lower rows. The rows are
# the map in docs/development.md ("Layers"); a new package gets a row there and here.
LAYERS: list[tuple[str, ...]] = [
    ("hpc_verl._version", "hpc_verl.errors"),
    ("hpc_verl.util",),
    ("hpc_verl.profiles", "hpc_verl.data", "hpc_verl.dataflow"),
    ("hpc_verl.testbed",),
    ("hpc_verl.trainer",),
    ("hpc_verl.bootstrap",),
    ("hpc_verl.verl_upstream",),
    ("hpc_verl.launch",),
    ("hpc_verl.ops",),
    ("hpc_verl.cli",),
    ("hpc_verl.__main__", "hpc_verl"),
]
# Inside launch/, lowest first (the modules not named here sit on the top row).
LAUNCH_LAYERS: list[tuple[str, ...]] = [
    ("hpc_verl.launch.registry",),
    ("hpc_verl.launch.spec",),
    ("hpc_verl.launch.backends",),
]

# Inside trainer/, lowest first (docs/development.md, "Layers"; each sub-package's __init__ says
# which process runs it).
TRAINER_LAYERS: list[tuple[str, ...]] = [
    ("hpc_verl.trainer.core_algos",),
    ("hpc_verl.trainer.config",),
    ("hpc_verl.trainer.models",),
    ("hpc_verl.trainer.observe",),
    ("hpc_verl.trainer.engine",),
    ("hpc_verl.trainer.rollout",),
    ("hpc_verl.trainer.roles",),
    ("hpc_verl.trainer.driver",),
    ("hpc_verl.trainer.main", "hpc_verl.trainer"),
]
# Packages a driver-side module must not import at its top: seconds of import (and a GPU stack)
# the driver and the login node do not need.
NO_TOP_IMPORT = ("torch", "transformers", "vllm")
NO_TOP_IMPORT_IN = ("hpc_verl.trainer.config", "hpc_verl.trainer.driver")
# Optional or heavy packages a trainer module may import inside a function without a comment.
HEAVY = ("torch", "transformers", "vllm", "ray", "tokenizers", "matplotlib", "wandb", "mlflow", "tensorboard",
         "numpy", "safetensors", "rich")

# Import circles that may stay until the code they are in is rewritten. Each entry: the modules
# of one circle and why it is tolerated. The dataflow runtime and the trainer are being rewritten
# elsewhere: circles there go here (with a comment) until that rewrite removes them, and then
# this list is emptied again. A listed circle that no longer exists fails the test (so it is
# removed here too).
ALLOWED_CYCLES: list[frozenset[str]] = []


@dataclass(frozen=True)
class Import:
    src: str
    dst: str
    line: int


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The project module ``name`` denotes (a package's ``__init__`` for a package), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(module: str, type_checking: bool = False) -> list[Import]:
    """``module``'s imports of project modules (``type_checking``: also those under TYPE_CHECKING)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_checking else _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            dst = _known(target)
            if dst and dst != module:
                out.append(Import(module, dst, node.lineno))
    return out


GRAPH = {m: imports_of(m) for m in MODULES}
GRAPH_WITH_TYPE_CHECKING = {m: imports_of(m, type_checking=True) for m in MODULES}


def _rank(module: str, layers: list[tuple[str, ...]], default: int | None = None) -> int | None:
    best = None
    for i, row in enumerate(layers):
        for prefix in row:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return best[0] if best else default


def _cycles() -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in {i.dst for i in GRAPH_WITH_TYPE_CHECKING[v]}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_imports():
    """Guards the test itself: known imports, function-level ones included, are found."""
    dsts = {i.dst for i in GRAPH["hpc_verl.cli.jobs"]}
    assert {"hpc_verl.launch.backends", "hpc_verl.launch.registry"} <= dsts  # both inside functions
    assert "hpc_verl.launch.backends.base" in {i.dst for i in GRAPH["hpc_verl.launch.backends"]}
    assert len(MODULES) > 80 and all(_rank(m, LAYERS) is not None for m in MODULES), \
        [m for m in MODULES if _rank(m, LAYERS) is None]


def test_no_import_circle():
    cycles = _cycles()
    unexpected = [sorted(c) for c in cycles if c not in ALLOWED_CYCLES]
    assert not unexpected, f"import circles: {unexpected}; break them (see docs/development.md, Layers)"
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in cycles]
    assert not stale, f"ALLOWED_CYCLES lists circles that are gone: {stale}; remove them from the list"


@pytest.mark.parametrize("layers", [LAYERS, LAUNCH_LAYERS, TRAINER_LAYERS], ids=["packages", "launch", "trainer"])
def test_imports_go_down_the_layers(layers):
    top = len(layers)
    bad = []
    inside = {id(LAUNCH_LAYERS): "hpc_verl.launch", id(TRAINER_LAYERS): "hpc_verl.trainer"}.get(id(layers))
    for imports in GRAPH.values():
        for i in imports:
            if inside and not (i.src.startswith(inside) and i.dst.startswith(inside)):
                continue
            src, dst = _rank(i.src, layers, top), _rank(i.dst, layers, top)
            same_row_other_package = src == dst and _owner(i.src, layers) != _owner(i.dst, layers)
            if dst > src or same_row_other_package:
                bad.append(f"{i.src} imports {i.dst} (line {i.line})")
    assert not bad, "imports up (or sideways) the layer map of docs/development.md:\n" + "\n".join(bad)


def _owner(module: str, layers: list[tuple[str, ...]]) -> str:
    names = [p for row in layers for p in row if module == p or module.startswith(p + ".")]
    return max(names, key=len) if names else "(top)"


def test_nothing_below_the_cli_imports_it():
    bad = [f"{i.src} imports {i.dst} (line {i.line})" for imports in GRAPH.values() for i in imports
           if i.dst.startswith("hpc_verl.cli") and not i.src.startswith("hpc_verl.cli")
           and i.src != "hpc_verl.__main__"]
    assert not bad, bad


def test_cli_has_no_backend_branch():
    """The CLI chooses no backend: no comparison with a scheduler name or a record's scheduler, and
    no import of one backend's module (only the interface package ``hpc_verl.launch.backends``)."""
    from hpc_verl.launch.backends import BACKENDS

    names = set(BACKENDS)
    bad = []
    for module, path in MODULES.items():
        if not module.startswith("hpc_verl.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Compare, ast.Match)):
                parts = [node.left, *node.comparators] if isinstance(node, ast.Compare) else [node.subject]
                for sub in (n for p in parts for n in ast.walk(p)):
                    if isinstance(sub, ast.Constant) and sub.value in names or \
                            isinstance(sub, ast.Attribute) and sub.attr == "scheduler":
                        bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        bad += [f"{module}:{i.line}: imports {i.dst}" for i in GRAPH[module]
                if i.dst.startswith("hpc_verl.launch.backends.")]
    assert not bad, "backend branches in the CLI:\n" + "\n".join(bad)


def _trainer_modules() -> dict[str, Path]:
    return {m: p for m, p in MODULES.items() if m.startswith("hpc_verl.trainer.")}


def test_the_trainer_layers_name_every_sub_package():
    """Every module of trainer/ sits in a row of TRAINER_LAYERS, and trainer/ holds no module
    outside a sub-package but main and the algorithms."""
    mods = _trainer_modules()
    assert mods and all(_rank(m, TRAINER_LAYERS) is not None for m in mods)
    loose = sorted(p.name for p in (PKG / "trainer").glob("*.py"))
    assert loose == ["__init__.py", "core_algos.py", "main.py"], loose


def _top_statements(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import: the module's body, into if/try/with blocks (not functions)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
    return out


def _imported_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module or ""]
    return []


def test_no_heavy_import_at_the_top_of_config_and_driver():
    bad = []
    for module, path in _trainer_modules().items():
        if not module.startswith(NO_TOP_IMPORT_IN):
            continue
        for node in _top_statements(ast.parse(path.read_text())):
            bad += [f"{module}:{node.lineno}: imports {name} at its top" for name in _imported_names(node)
                    if name.split(".")[0] in NO_TOP_IMPORT]
    assert not bad, "config/ and driver/ run in the driver, without torch:\n" + "\n".join(bad)


def test_trainer_imports_inside_functions_are_heavy_or_give_a_reason():
    """A file's top says what it depends on: an import inside a function is an optional heavy
    package, or its line says why (``# lazy: ...``)."""
    bad = []
    for module, path in _trainer_modules().items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        top = {id(n) for n in _top_statements(tree)}
        for node in ast.walk(tree):
            names = _imported_names(node) if isinstance(node, ast.stmt) and id(node) not in top else []
            if isinstance(node, ast.ImportFrom) and node.level and id(node) not in top:
                names = ["(relative)"]
            if not names or all(n.split(".")[0] in HEAVY for n in names):
                continue
            if _type_checking_lines(tree) & {node.lineno}:
                continue
            if not any("#" in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
                bad.append(f"{module}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "move these imports to the top, or say why they wait (a comment on the line):\n" + \
        "\n".join(bad)


def test_the_driver_package_imports_no_torch():
    """``import hpc_verl.trainer.driver`` (and the modules the driver runs) load no torch."""
    import subprocess
    import sys

    code = ("import sys; import hpc_verl.trainer.driver, hpc_verl.trainer.driver.ppo_trainer, "
            "hpc_verl.trainer.driver.ray_runner, hpc_verl.trainer.driver.inline_runner, hpc_verl.trainer.main; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
