"""The import layering of README "Architecture", enforced by walking every module's AST.

Every `import` counts: module level, inside functions (lazy imports) and under `TYPE_CHECKING`,
because an upward edge is a dependency whichever way Python happens to resolve it. A module may
import its own layer or the layers below it, never above; and no two modules import each other,
directly or through a chain.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("radixrt", "tokenizer_proc", "detok_proc")

# Lowest first. The longest matching prefix decides a module's layer. This table is the one in
# README.md ("Architecture"); change both together.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("config", ("radixrt.config",)),
    ("core", ("radixrt.core",)),
    ("mem", ("radixrt.mem",)),
    ("routing", ("radixrt.routing",)),
    ("compute", ("radixrt.model", "radixrt.attention", "radixrt.sampling", "radixrt.grammar")),
    ("processes", ("radixrt.sched", "tokenizer_proc", "detok_proc")),
    ("frontend", ("radixrt.frontend",)),
    ("doors", ("radixrt.server", "radixrt.router", "radixrt.cli", "radixrt.__main__",
               "radixrt")),  # `radixrt/__init__.py`: the public facade, lazily re-exporting
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for idx, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[0]:
                    best = (len(p), idx)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of our own modules that `path` imports (relative imports resolved)."""
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` may name a submodule: record both candidates.
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                found.add(name)
    return found


def all_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[module_name(path)] = path
    return mods


def resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module `name` refers to: itself, or its parent when it names an attribute."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = all_modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        targets = {resolve(n, mods) for n in imports_of(path)}
        # Importing a submodule runs its package's __init__, but that is no dependency of ours.
        graph[mod] = {t for t in targets if t is not None and t != mod}
    return graph


def test_every_module_has_a_layer():
    missing = [m for m in all_modules() if layer_of(m) is None]
    assert not missing, f"modules outside every layer (add them to LAYERS and the README): {missing}"


def test_imports_never_run_upward():
    bad = []
    for mod, targets in import_graph().items():
        lm = layer_of(mod)
        for t in targets:
            lt = layer_of(t)
            if lm is not None and lt is not None and lt > lm:
                bad.append(f"{mod} ({LAYERS[lm][0]}) imports {t} ({LAYERS[lt][0]})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    # A package's __init__ re-exporting its own submodules is not a cycle of dependencies.
    pruned = {m: {t for t in ts if not (m.startswith(t + ".") and all_modules()[t].name ==
                                        "__init__.py")} for m, ts in graph.items()}
    cycles = _cycles(pruned)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module,upward", [
    ("radixrt.mem.radix_cache", "radixrt.sched.req"),
    ("radixrt.core.messages", "radixrt.frontend.engine"),
])
def test_checker_catches_an_upward_import(module, upward):
    """The check itself can fail: an upward edge is reported."""
    lm, lt = layer_of(module), layer_of(upward)
    assert lm is not None and lt is not None and lt > lm


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
