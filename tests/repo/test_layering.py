"""The layering docs/ARCHITECTURE.md promises, read from the source: every import of ours
(at the top of a module, inside a function or for the type checker only) points down the
"stands on" column, the modules of a package import each other in no circle, a handler
never reaches the probe, the daemon or httpx, and every public exception class of ours
derives from ``GatewayCapacityError``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = (
    "shm_layout",
    "capacity_contract",
    "handler_shim",
    "gateway_config",
    "sidecar",
    "capacity_router",
)
SHELL = "gateway_capacity"
# what each package may import of ours besides itself (module prefixes)
STANDS_ON: dict[str, tuple[str, ...]] = {
    "shm_layout": (),
    "capacity_contract": ("shm_layout.errors", "shm_layout.platform"),
    "gateway_config": ("shm_layout.errors", "shm_layout.layout"),
    "handler_shim": ("shm_layout", "gateway_config"),
    "sidecar": ("shm_layout", "gateway_config", "capacity_contract"),
    "capacity_router": ("capacity_contract", "shm_layout.errors"),
    SHELL: OURS,
}
NEVER_FROM_HANDLERS = ("httpx", "sidecar.probe", "sidecar.daemon")
# Exception classes that never leave the code that raises them (caught there and said as
# a reason, an answer or an exit code), so nobody outside has to catch them by the root.
INTERNAL_ERRORS = {
    "GatewayCapacityError": "the root itself",
    "Superseded": "shm_layout.writer: control flow, the daemon stops writing",
    "LockSetupError": "shm_layout.lock: segment.py turns it into a SegmentError",
    "Refusal": "handler_shim.model_choice: answered as a 413 or 400",
    "ResolveError": "sidecar.addresses: becomes the probe's reason",
    "Unhealthy": "capacity_router.sources: becomes the worker's reason",
    "DemoFailed": "gateway_capacity.demo: becomes the demo's exit status",
    "MetricsError": "gateway_capacity.wfs_metrics: becomes wait-for-slot's reason",
    "BadMessage": "capacity_router.wire: answered as a 400, 411, 431 or 505, or a 502",
}


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports anywhere in it, absolute names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _modules(package: str) -> dict[str, set[str]]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): _imports(p)
        for p in sorted((ROOT / package).rglob("*.py"))
    }


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# the drill's modules run as scripts from drill/ and import each other by bare name
SCRIPTS = ("drill",)


def _module_graph() -> dict[str, set[str]]:
    """Every module of ours (a package's ``__init__`` by the package's name, a compiled
    one by its ``.pyi``) and the modules of ours it imports: an import of a name inside
    a module is an import of that module."""
    files: dict[str, Path] = {}
    for package in (*OURS, SHELL, *SCRIPTS):
        for path in sorted((ROOT / package).rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if path.suffix == ".py" or name not in files:
                files[name] = path
    bare = {name.split(".")[-1]: name for name in files if name.split(".")[0] in SCRIPTS}

    def module_of(name: str) -> str | None:
        name = bare.get(name.split(".")[0], name.split(".")[0]) + name[len(name.split(".")[0]) :]
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {module_of(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        [*parts[: len(parts) - node.level + 1], *([base] if base else [])]
                    )
                # ``from package import module`` imports that module, not the package's
                # other modules; ``from module import name`` imports the module
                found |= {module_of(f"{base}.{alias.name}") for alias in node.names}
        graph[name] = {m for m in found if m is not None and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        circles.append(sorted(part))
    return circles


def test_no_module_of_ours_imports_itself_through_others() -> None:
    """Inside a package too, modules read bottom-up: no circle of imports, counting
    imports inside functions and those for the type checker only (the drill's too)."""
    graph = _module_graph()
    assert {"drill.drill_rig", "shm_layout._core", "sidecar.daemon"} <= set(graph)
    assert "drill.drill_rig" in graph["drill.upgrade_drill"]  # bare script names resolve
    lines = [
        f"{' <-> '.join(part)}: "
        + "; ".join(f"{m} imports {', '.join(sorted(graph[m] & set(part)))}" for m in part)
        for part in _circles(graph)
    ]
    assert lines == [], "import circles:\n" + "\n".join(lines)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_every_import_of_ours_points_down_the_stands_on_column() -> None:
    wrong = []
    for package, allowed in STANDS_ON.items():
        for module, imported in _modules(package).items():
            for name in sorted(imported):
                top = name.split(".")[0]
                if top in (*OURS, SHELL) and top != package and not _is_under(name, allowed):
                    wrong.append(f"{module} imports {name}")
    assert wrong == [], "\n".join(wrong)


def test_no_installed_package_imports_drill_bench_examples_or_tests() -> None:
    wrong = [
        f"{module} imports {name}"
        for package in STANDS_ON
        for module, imported in _modules(package).items()
        for name in imported
        if name.split(".")[0] in ("drill", "bench", "examples", "tests", "gwtest")
    ]
    assert wrong == [], "\n".join(wrong)


def test_a_handler_reaches_neither_httpx_nor_the_probe_nor_the_daemon() -> None:
    """Followed through every module handler_shim can import, at any depth."""
    graph: dict[str, set[str]] = {}
    for package in STANDS_ON:
        graph |= _modules(package)
    seen: set[str] = set()
    todo = [m for m in graph if m.startswith("handler_shim")]
    path: dict[str, str] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in graph.get(module, set()):
            assert not _is_under(name, NEVER_FROM_HANDLERS), (
                f"{name} reached from handler_shim: {module} <- {path.get(module, '')}"
            )
            for candidate in (name, name.rsplit(".", 1)[0], f"{name}.__init__"):
                if candidate in graph and candidate not in seen:
                    path[candidate] = module
                    todo.append(candidate)
    assert "handler_shim.asgi" in seen and "shm_layout.segment" in seen  # the walk walked


def test_every_public_exception_class_of_ours_derives_from_the_root() -> None:
    """Read from the source, so that no module needs importing (nor its extras)."""
    wrong = []
    for package in (*OURS, SHELL):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                    continue
                if node.name in INTERNAL_ERRORS:
                    continue
                bases = {b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases}
                builtin = {"Exception", "ValueError", "OSError", "LookupError", "TimeoutError"}
                if bases & builtin and not bases - builtin:
                    wrong.append(f"{path.relative_to(ROOT)}: {node.name}({', '.join(bases)})")
    assert wrong == [], "not under GatewayCapacityError:\n" + "\n".join(wrong)


def test_a_cli_command_that_needs_no_http_client_starts_without_httpx() -> None:
    """Every command builds the whole parser; what it imports then, every command pays."""
    code = (
        "import sys\n"
        "from gateway_capacity.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('httpx', 'rich', 'click')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout
