"""The import graph keeps the layers of docs/design/architecture.md.

Every top-level package and module of nnrt has a rank; a module may import
only from its own package or from a lower rank, and there is no import
cycle at all, between packages or between modules. Imports inside functions
count like any other: a lazy import is still a dependency.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nnrt"

# Bottom first. A name is a top-level package of nnrt, or a module directly
# under nnrt/ (its stem); "nnrt" is the package facade (nnrt/__init__.py).
RANKS = [
    {"errors", "vlog", "_version", "wirecodec", "trace"},  # leaf modules: no nnrt imports but each other
    {"handoff"},                             # worker threads, results handed to a loop
    {"fmq", "memory", "fence"},              # the ring, shared memory, sync fences
    {"model"},                               # operand/operation types, graphs, the builder
    {"extensions"},                          # extension definitions (names, type codes)
    {"ops"},                                 # the operation registry and kernels
    {"hal"},                                 # the seam: value types, interfaces, validation
    {"burst", "tflite"},                     # the burst wire and its two ends; model import
    {"qos"},                                 # the scheduler that wraps any hal.Device
    {"service"},                             # transports that host any hal.Device: local, remote
    {"drivers"},                             # reference, samples, litert
    {"runtime"},                             # discovery, compilation, executions
    {"nnrt"},                                # the facade: the public API
    {"bench"},                               # nnrt bench: runner, stress, report, machine info
    {"demo", "testing"},                     # the camera-loop demo, the CTS runner
    {"cli"},                                 # the command line
    {"__main__"},
]
RANK = {name: k for k, names in enumerate(RANKS) for name in names}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of nnrt."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The nnrt module ``name`` names, or None for a name outside nnrt; a name
    of something inside a module (``nnrt.errors.invalid``) is that module."""
    while name:
        if name in MODULES:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


def _is_native(package: str, name: str) -> bool:
    """``package.name`` is a C extension built from ``name.c`` beside it."""
    folder = ROOT.parent.joinpath(*package.split("."))
    return (folder / f"{name}.c").exists()


def _imports(module: str, path: Path) -> set[str]:
    """The nnrt modules ``module`` imports, lazy imports included."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if _is_native(target, alias.name):
                    continue   # a C extension module: a leaf
                # `from pkg import submodule` imports the submodule.
                hit = _resolve(f"{target}.{alias.name}") if f"{target}.{alias.name}" in MODULES \
                    else _resolve(target)
                if hit:
                    found.add(hit)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                hit = _resolve(alias.name)
                if hit:
                    found.add(hit)
    found.discard(module)
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nnrt"


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_every_package_and_module_has_a_rank():
    unranked = sorted({_top(m) for m in MODULES} - set(RANK))
    assert not unranked, f"give these a rank in RANKS: {unranked}"


def test_imports_go_downward():
    problems = []
    for module, targets in GRAPH.items():
        mine = _top(module)
        for target in sorted(targets):
            theirs = _top(target)
            if theirs != mine and RANK[theirs] >= RANK[mine]:
                problems.append(f"{module} (rank {RANK[mine]}) imports {target} "
                                f"(rank {RANK[theirs]})")
    assert not problems, "\n".join(problems)


def test_no_cycle_between_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(_top(module), set()).update(
            _top(t) for t in targets if _top(t) != _top(module))
    cycles = _cycles(packages)
    assert not cycles, "package cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_ops_use_only_the_model_types_and_graph():
    for path in (ROOT / "ops").rglob("*.py"):
        text = path.read_text()
        assert "hal.validate" not in text and "model.builder" not in text, path
