"""Layers only point down (docs/architecture.md): every module of ``bunshin_async`` and ``speculator`` belongs to
one of ``LAYERS`` and imports only from its own layer or lower ones, the module graph is acyclic, the runtime never
imports ``speculator`` (``APPLICATIONS`` may), and no module reaches into another module's objects' private members.
Built with the standard library only (``ast`` over the source files). Every import is an edge: a function-level
import made late to dodge a circle, and one under ``if TYPE_CHECKING:`` (an annotation naming a module above is a
dependency on it too: the reader has to know that module to know the type)."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bunshin_async", "speculator")

PRIVATE_ALLOWED = {
    # (module, ``x._name`` as written) allowed to reach into another object's private members: only into foreign
    # libraries' objects, where they offer no public way. Within Bunshin, a module uses another's interface.
    ("bunshin_async._images._docker", "docker._query"),  # aiodocker's raw request (no public equivalent)
    ("bunshin_async.integrations._openai_agents", "session._inner"),  # the Agents SDK's session internals
    ("bunshin_async.integrations._openai_agents", "inner._set_start_state_preserved"),
    ("bunshin_async.integrations._openai_agents", "copy._set_start_state_preserved"),
}


LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # (layer, its modules: a name stands for the module and its submodules; the longest match wins), lowest first.
    # Each name is a top-level module or subpackage (test_layers_are_subpackages), except the one split in SPLIT.
    ("foundation", ("_compat", "_config", "_exceptions", "_fallback", "_public")),
    ("host interface", ("_host",)),
    ("images", ("_images",)),
    ("workspace core", ("_workspace._core",)),
    ("fork", ("_fork",)),
    ("workspace facade", ("_workspace",)),
    ("services", ("_tools", "_llm", "_runtime", "_cache", "_rollout")),
    ("public modules", ("", "agent", "cache", "llm", "rollout", "speculation", "tools", "transfer")),
    ("applications", ("integrations", "_e2b", "_cli", "__main__", "speculator")),
]  # fmt: skip

SPLIT = {"_workspace._core": "the workspace core sits below the fork layer, the rest of ``_workspace`` above it"}
"""Where one subpackage spans two layers: the fork layer works on ``WorkspaceCore`` and the facade on the fork layer."""


def layer_of(mod: str) -> int | None:
    """The index in ``LAYERS`` of ``mod`` (``bunshin_async.x.y`` or ``speculator...``), None if none names it."""
    name = mod.removeprefix("bunshin_async").removeprefix(".")
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if name == n or (n and name.startswith(n + ".")) or (n == "speculator" and mod.startswith("speculator")):
                if best is None or len(n) > best[0]:
                    best = (len(n), i)
    return None if best is None else best[1]


@functools.cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ``name`` (a module, or a name inside one) among ``mods``."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(d) for m, d in _build_graph().items()}


def graph() -> dict[str, set[str]]:
    return {m: set(d) for m, d in _graph().items()}


def _build_graph() -> dict[str, set[str]]:
    """Module -> the modules of the two packages it imports (anywhere in its body)."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(_parse(path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" for a in node.names]
            for target in targets:
                dep = _resolve(target, mods)
                if dep is not None and dep != mod and not mod.startswith(dep + "."):
                    edges[mod].add(dep)  # a submodule importing its own package's __init__ is not a circle
    return edges


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def private_accesses(allowed: set[tuple[str, str]] = PRIVATE_ALLOWED) -> list[tuple[str, int, str]]:
    """``x._name`` where ``x`` is not ``self``/``cls`` and ``x._name`` is not a module (``_native.mount`` and
    ``P.Spawn`` are fine: modules are imported; ``ws._state`` is not): (module, line, expression)."""
    mods = modules()
    found = []
    for mod, path in mods.items():
        tree = _parse(path)
        own = _own_privates(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            text = ast.unparse(node)
            if attr in own and not _is_module_name(value, tree):
                continue  # a member of a class of this module: module-private, not another module's
            if _is_module_path(text, mod, mods):
                continue
            if (mod, text) not in allowed:
                found.append((mod, node.lineno, text))
    return found


def _own_privates(tree: ast.Module) -> set[str]:
    """The private members the classes of a module define (methods, ``self._x = ...``, class attributes)."""
    own: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if isinstance(node.ctx, ast.Store):
                    own.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
    return own


def _is_module_name(value: ast.expr, tree: ast.Module) -> bool:
    """Whether ``value`` is a name this module imported (``_fork`` in ``_fork._thaw``)."""
    if not isinstance(value, ast.Name):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == value.id for a in node.names):
                return True
    return False


def _is_module_path(text: str, mod: str, mods: dict[str, Path]) -> bool:
    """Whether ``text`` (``_host._snapstore``, ``bunshin_async._native``) names a module: a submodule of one of the
    packages or a compiled extension beside them."""
    tail = text.split(".")[-1]
    if tail in ("_native",):  # bunshin_async._native, the C extension (native/)
        return True
    package = mod.rpartition(".")[0]
    for base in (mod, package, "bunshin_async"):
        if any(m == f"{base}.{text}" or m.endswith("." + text) for m in mods):
            return True
    return False


def test_module_graph_is_acyclic() -> None:
    assert cycles(graph()) == []


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports of a module of a higher layer than the importer's: ``a (layer) -> b (layer)``."""
    out = []
    for mod, deps in sorted(edges.items()):
        for dep in sorted(deps):
            a, b = layer_of(mod), layer_of(dep)
            if a is not None and b is not None and b > a:
                out.append(f"{mod} ({LAYERS[a][0]}) -> {dep} ({LAYERS[b][0]})")
    return out


def test_every_module_has_a_layer_and_imports_only_down() -> None:
    edges = graph()
    assert [m for m in edges if layer_of(m) is None] == [], "a new module: put it in its layer in LAYERS"
    assert upward(edges) == []


APPLICATIONS = ("bunshin_async._cli", "bunshin_async.__main__")
"""Shipped inside the package but above both packages: the ``bunshin`` command (also ``python -m bunshin_async``).
It may import speculator; the runtime imports neither it nor speculator. The latency-hiding experiment, which compares
speculator's predictors, is no part of the package: ``bench/experiment`` (``python -m bench.experiment``)."""


def test_layers_are_subpackages() -> None:
    """A reader sees the layers in the tree: each layer is a set of top-level modules and subpackages of
    ``bunshin_async`` (one concern each), the only exception being ``SPLIT``; no private module sits flat at the top
    level except the foundation's, which every layer imports."""
    names = [n for _, ns in LAYERS for n in ns if n not in ("", "speculator")]
    assert [n for n in names if "." in n and n not in SPLIT] == []
    top = {m.split(".")[1] for m in modules() if m.startswith("bunshin_async.")}
    assert top <= set(names) | {"__main__"}
    flat = sorted(p.stem for p in (ROOT / "bunshin_async").glob("_*.py") if p.stem not in ("__init__", "__main__"))
    assert flat == sorted(LAYERS[0][1]), "a flat private module: put it in the subpackage of its layer"
    core = [m.rpartition(".")[2] for m in modules() if (layer_of(m) or 0) <= layer_of("bunshin_async._workspace")]
    assert sorted({b for b in core if core.count(b) > 1} - {""}) == [], "two modules of the SDK's core share a name"


def test_the_experiment_is_outside_the_package() -> None:
    """Nothing in the two packages imports the experiment (or any of ``bench/``), which a wheel does not ship."""
    found = []
    for mod, path in modules().items():
        for node in ast.walk(_parse(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{mod}: {n}" for n in names if n == "bench" or n.startswith("bench.")]
    assert found == []
    assert not list((ROOT / "bunshin_async").glob("_experiment/**/*.py"))  # a stale __pycache__ may stay
    assert (ROOT / "bench" / "experiment" / "__main__.py").is_file()


def test_runtime_does_not_import_speculator() -> None:
    edges = graph()

    def under(m: str, tops: tuple[str, ...]) -> bool:
        return any(m == t or m.startswith(t + ".") for t in tops)

    runtime = [m for m in edges if under(m, ("bunshin_async",)) and not under(m, APPLICATIONS)]
    above = ("speculator", *APPLICATIONS)
    assert {m: sorted(d for d in edges[m] if under(d, above)) for m in runtime} == {m: [] for m in runtime}


SEAMS = {
    "bunshin_async._public": "``publish``: speculator's exported names carry its public module as the SDK's do",
}
"""The private modules of ``bunshin_async`` that ``speculator`` may import, each with the reason. Everything else it
takes from the public modules (``bunshin_async.speculation`` exports the turn's planning for its offline replays)."""


def private_reaches(edges: dict[str, set[str]]) -> list[str]:
    """Imports by a ``speculator`` module of a private module of ``bunshin_async`` (a ``_`` part in its path) that
    ``SEAMS`` does not name: ``speculator`` builds on the SDK's public surface, so the SDK may change its insides."""
    return [
        f"{mod} -> {dep}"
        for mod, deps in sorted(edges.items())
        if mod == "speculator" or mod.startswith("speculator.")
        for dep in sorted(deps)
        if dep.startswith("bunshin_async.") and any(p.startswith("_") for p in dep.split(".")) and dep not in SEAMS
    ]


def test_speculator_imports_only_the_public_sdk() -> None:
    assert private_reaches(graph()) == []


def test_no_module_touches_private_members_of_another_object() -> None:
    assert private_accesses() == []
    # and the allow-list holds nothing stale: each entry still occurs
    assert {(m, text) for m, _line, text in private_accesses(allowed=set())} >= PRIVATE_ALLOWED


MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def sizes() -> dict[str, int]:
    """Lines of every module (``path``) and class (``path:Class``) of the two packages."""
    out: dict[str, int] = {}
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        out[rel] = len(path.read_text().splitlines())
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ClassDef):
                out[f"{rel}:{node.name}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return out


def test_modules_and_classes_stay_small() -> None:
    """No module over ``MAX_MODULE_LINES``, no class over ``MAX_CLASS_LINES`` (one concern each: a reader can hold
    one in their head; split along a seam, not by squeezing lines); the allow-list of private accesses stays short
    (foreign libraries' internals only)."""
    over = {name: n for name, n in sizes().items() if n > (MAX_CLASS_LINES if ":" in name else MAX_MODULE_LINES)}
    assert over == {}
    assert len(PRIVATE_ALLOWED) <= 5


def native_at_import() -> list[str]:
    """Modules that import the C extension (``_native``) when they are imported, not when first used: an import
    outside every function and class body."""
    found = []
    for mod, path in modules().items():
        for top in _parse(path).body:
            if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or "", *(a.name for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(n.rpartition(".")[2] == "_native" for n in names):
                    found.append(mod)
    return found


def test_the_package_imports_without_the_native_extension() -> None:
    """The unit tier runs from a clone that was never built (``make test-unit`` as any user): every module loads the
    C extension where it first needs it (a function-level import), so ``import bunshin_async`` works without it."""
    assert native_at_import() == []


def test_checks_see_what_they_must() -> None:
    """The checks would catch a circle and a private access: the graph has edges, including function-level ones."""
    edges = graph()
    assert "bunshin_async._host._kernel" in edges["bunshin_async._workspace._facade"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert "bunshin_async._workspace._facade" in edges["bunshin_async._tools._tools"]  # an import under TYPE_CHECKING
    assert (
        layer_of("bunshin_async._host._snapstore")
        < layer_of("bunshin_async._workspace._core")
        < layer_of("bunshin_async._fork")
    )
    assert private_reaches({"speculator._x": {"bunshin_async._runtime._calls", "bunshin_async.speculation"}}) == [
        "speculator._x -> bunshin_async._runtime._calls"
    ]
    assert upward({"bunshin_async._workspace._core": {"bunshin_async._workspace._facade"}}) == [
        "bunshin_async._workspace._core (workspace core) -> bunshin_async._workspace._facade (workspace facade)"
    ]


if __name__ == "__main__":  # measurement: python tests/test_architecture.py
    edges = graph()
    print("modules", len(edges), "edges", sum(len(v) for v in edges.values()))
    for comp in cycles(edges):
        print("cycle", comp)
    for line in upward(edges):
        print("upward", line)
    acc = private_accesses()
    print("private accesses", len(acc))
    for m, line, text in acc:
        print(f"  {m}:{line} {text}")
