"""The package's shape, checked: every package has its tests folder, no import cycle (imports inside
functions included), every console script resolves, and the package never runs a repo-root script."""
import ast
import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "toolrl"


def packages() -> list[Path]:
    return sorted(p.parent for p in PKG.rglob("__init__.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every toolrl module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolrl"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from toolrl.x import module`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("toolrl"))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_package_has_its_tests_folder():
    missing = []
    for pkg in packages():
        rel = pkg.relative_to(PKG)
        folder = ROOT / "tests" / rel
        if not any(folder.rglob("test_*.py")):
            missing.append(f"toolrl/{rel} -> tests/{rel}/".replace("/./", "/").replace("toolrl/.", "toolrl"))
    assert not missing, f"packages without tests: {missing}"


def test_no_import_cycles_not_even_inside_functions():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


# What each package may import, besides the foundation (the top-level modules) and itself: the map in
# docs/ARCHITECTURE.md, enforced. The executor and the tasks know nothing of training; the learner
# reaches the workers only through their HTTP client.
FOUNDATION = {"toolrl", "config", "format", "protocol", "models", "logprobs", "grpo", "metrics", "net", "prompts"}
MAY_IMPORT = {
    "executor": set(),
    "tasks": {"executor"},
    "refserver": set(),
    "weightsync": set(),
    "worker": {"executor", "tasks", "refserver", "weightsync"},
    "learner": {"refserver", "weightsync", "worker.client"},
}


def test_packages_import_only_what_the_map_allows():
    bad = []
    for module, targets in import_graph().items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in MAY_IMPORT:
            continue
        allowed = MAY_IMPORT[parts[1]] | FOUNDATION | {parts[1]}
        for t in sorted(targets):
            tp = t.split(".")
            name = tp[1] if len(tp) > 1 else "toolrl"
            if name not in allowed and ".".join(tp[1:3]) not in allowed:
                bad.append(f"{module} -> {t}")
    assert not bad, bad


def test_foundation_modules_import_no_package():
    graph = import_graph()
    bad = [f"{m} -> {t}" for m in graph if m.count(".") == 1 and m.split(".")[1] in FOUNDATION
           for t in graph[m] if t.split(".")[1] in MAY_IMPORT]
    assert not bad, bad


def test_every_console_script_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts, "pyproject names no console scripts"
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), f"{name} -> {target}"


def test_the_package_runs_no_repo_root_script_by_path():
    """A command line built inside the package names `-m toolrl.<module>`, never a repo-root script:
    the scripts are the user's, and an installed package has no repo root."""
    roots = {p.name for p in ROOT.glob("*.py")} | {"launch.sh"}
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # [sys.executable, "x.py", ...] or ROOT / "x.py"
            parts = node.elts if isinstance(node, ast.List) else \
                [node.right] if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) else []
            if any(r in ast.unparse(e) for e in parts for r in roots):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, offenders
