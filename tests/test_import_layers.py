"""The packages of hybridrl import one another in one direction only (read from the source, no imports).

Every `import hybridrl.X...` and `from hybridrl.X... import ...` in `hybridrl/**/*.py`, at the top of
a file or inside a function, is an edge from the importing package to package X. `ALLOWED` is the
rule (docs/architecture.md, "What each package owns", says the same): a package imports only the
packages listed for it, each of which sits below it, so the data flows trainer -> controller ->
workers -> training / rollout / reshard -> models / parallel and never back; `hybridrl.names` and
`hybridrl.persistence` (torch-free, importing nothing of hybridrl: `BOTTOM`) are below them all. A new package, or a
new edge, is a decision: add it here and to the architecture document in the same commit.
"""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridrl"

# package -> the hybridrl packages it may import (top-level modules `cli` and `__init__` count as
# packages of their own). Bottom first.
ALLOWED: dict[str, set[str]] = {
    "names": set(),  # the shared StrEnums (Phase, Role, GroupName): every package may import it
    "persistence": set(),  # atomic files and folders, CheckpointError: every package may import it
    "user_code": set(),  # importing a user's trusted Python file: every package may import it
    "parallel": set(),  # megatron's parallel state and the device policy: knows nothing about RL
    "algorithms": set(),  # pure torch functions
    "rewards": set(),  # rule scorers and their registry
    "tool_calling": set(),  # tool-call parsing, tool schemas, the calculator and the python sandbox: pure Python
    "models": {"parallel"},
    "data": {"parallel", "rewards"},  # the demo and GSM8K datasets register / reuse their scorers
    # torch-free: algorithm names, `ModelShape`, tensor plans, the `DevicePolicy` (parallel/device_policy.py)
    # tools: built-in tool and parser names; data, rewards: what `train` reads, checked at plan (config/inputs.py)
    "config": {"algorithms", "data", "models", "parallel", "rewards", "tool_calling"},
    "controller": {"config", "data", "parallel"},
    "reshard": {"config", "models", "parallel"},
    "rollout": {"config", "data", "parallel", "tool_calling"},  # the agent loop runs the tools
    "training": {"algorithms", "config", "data", "models", "parallel"},
    "workers": {"algorithms", "config", "controller", "data", "models", "parallel", "reshard", "rollout",
                "training"},
    "trainer": {"algorithms", "config", "controller", "data", "models", "parallel", "rewards", "rollout",
                "tool_calling", "workers"},
    "cli": set(),  # names its subcommands' modules as strings (imported only when one runs)
    "__init__": set(),
}


# The modules every package may import; they themselves import no other hybridrl module.
BOTTOM = {"names", "persistence", "user_code"}


def _package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every absolute hybridrl import in a module, function-local ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "hybridrl":
                for alias in node.names:
                    yield node.lineno, f"hybridrl.{alias.name}"
            else:
                yield node.lineno, node.module


@functools.cache
def package_imports(root: Path = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> ["file:line", ...] (edges to itself left out)."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        source = _package_of(path)
        edges.setdefault(source, {})
        for line, name in _imported_modules(ast.parse(path.read_text(), filename=str(path))):
            parts = name.split(".")
            if parts[0] != "hybridrl" or len(parts) < 2 or parts[1] == source:
                continue
            edges[source].setdefault(parts[1], []).append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as [a, b, ..., a], or None when it has none."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return stack[stack.index(successor):] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_package_has_a_place_in_the_rule():
    packages = {_package_of(path) for path in PACKAGE.rglob("*.py")}
    assert packages == set(ALLOWED), (
        f"unplaced: {sorted(packages - set(ALLOWED))}; gone: {sorted(set(ALLOWED) - packages)}")


def test_the_rule_is_a_layering():
    assert find_cycle(ALLOWED) is None
    assert all(target in ALLOWED for targets in ALLOWED.values() for target in targets)


def test_packages_import_only_the_packages_below_them():
    forbidden = [
        f"{source} -> {target} ({', '.join(where)})"
        for source, targets in package_imports().items()
        for target, where in sorted(targets.items())
        if target not in ALLOWED.get(source, set()) | (set() if source in BOTTOM else BOTTOM)
    ]
    assert not forbidden, "imports against tests/test_import_layers.py ALLOWED:\n" + "\n".join(forbidden)


def test_no_import_cycle_between_packages():
    graph = {source: set(targets) for source, targets in package_imports().items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


_IMPORT = re.compile(r"^\s*(?:from|import)\s+(hybridrl(?:\.\w+)*)", re.MULTILINE)


def test_every_hybridrl_import_names_an_existing_module():
    """A moved module leaves no stale import behind, not even inside a function nobody ran."""
    missing = []
    for folder in ("hybridrl", "tests", "bench", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            for match in _IMPORT.finditer(text):
                if not _module_exists(match.group(1)):
                    line = text.count("\n", 0, match.start()) + 1
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {match.group(1)}")
    assert not missing, "\n".join(missing)


# Inside `hybridrl.config` the modules import in one line: each may import only those before it
# (`errors`, `meshes` and `estimates` are helpers below `resolve`; `docs` and `plan_cli` sit on top).
CONFIG_LINE = ("errors", "yaml_load", "megatron_fields", "schema", "hardware", "verl_keys", "verl_default_values",
               "verl_interpolation", "verl_defaults", "loader", "meshes",
               "estimates", "megatron_verdict", "resolve", "model_shapes", "checker", "refusals", "megatron_rules",
               "moe_rules", "rollout_rules", "lora_rules", "distillation_rules", "validate", "resume", "inputs",
               "plan", "internode", "step_time", "search", "report", "docs", "plan_cli", "hardware_cli", "__init__")


def config_module_imports(root: Path = PACKAGE / "config") -> dict[str, dict[str, list[str]]]:
    """config module -> the config modules it imports -> ["file:line", ...]."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(root.glob("*.py")):
        for line, name in _imported_modules(ast.parse(path.read_text(), filename=str(path))):
            parts = name.split(".")
            if parts[:2] == ["hybridrl", "config"] and len(parts) > 2:
                edges.setdefault(path.stem, {}).setdefault(parts[2], []).append(f"{path.name}:{line}")
    return edges


def test_config_modules_import_in_a_line():
    modules = {path.stem for path in (PACKAGE / "config").glob("*.py")}
    assert modules == set(CONFIG_LINE), f"place {sorted(modules - set(CONFIG_LINE))} in CONFIG_LINE"
    backwards = [
        f"{source} -> {target} ({', '.join(where)})"
        for source, targets in config_module_imports().items()
        for target, where in sorted(targets.items())
        if CONFIG_LINE.index(target) >= CONFIG_LINE.index(source)
    ]
    assert not backwards, "config imports against CONFIG_LINE:\n" + "\n".join(backwards)


# The CPU stand-ins' room: code that serves both devices imports it only inside the branch a CPU job takes.
CPU_ROOM = "hybridrl.parallel.cpu"


def test_the_cpu_stand_ins_are_imported_only_inside_functions_outside_their_room():
    at_module_level = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "parallel" / "cpu"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:  # the module's own statements (a function's body is not among them)
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name == CPU_ROOM or name.startswith(CPU_ROOM + ".") for name in names):
                at_module_level.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not at_module_level, "import the CPU stand-ins inside the CPU branch:\n" + "\n".join(at_module_level)


def test_importing_every_module_outside_the_room_loads_no_cpu_stand_in():
    """A fresh process imports every hybridrl module but the CPU room's (as a GPU job's processes import theirs):
    none of the stand-ins comes along."""
    program = f"""
import importlib, pkgutil, sys
import hybridrl
for module in pkgutil.walk_packages(hybridrl.__path__, "hybridrl."):
    if not module.name.startswith({CPU_ROOM!r}):
        importlib.import_module(module.name)
print(sorted(name for name in sys.modules if name.startswith({CPU_ROOM!r} + ".")))
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:]


def test_no_test_module_is_imported_by_another_module():
    """Helpers shared between test modules (and with the benches and tools) live in tests/support/: a test module
    imported by another runs its module-level code twice and hides who owns the helper."""
    importers = []
    for folder in ("tests", "bench", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, name in _imported_modules(tree):
                if name.startswith("tests.test_") or name.startswith("test_"):
                    importers.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not importers, "move the shared helper into tests/support/:\n" + "\n".join(importers)
