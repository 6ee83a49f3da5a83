"""The repository's shape (DESIGN §1, §2): the compiler reaches a backend only through the
registry, and the import graph has no cycles.

The graph is built from the source with ``ast``, not by importing: one node per module of the
``attnc`` package (``compiler/x.py`` is ``attnc.compiler.x``), one edge per ``import`` naming
another of them, relative imports resolved.  ``from P import N`` is an edge to the module
``P.N`` when there is one, else to ``P``.  A package's ``__init__`` importing its own
submodules is not a cycle with them: Python runs the parent package before a submodule, but a
submodule that names its parent explicitly gets that edge, and that would be one."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("attnc", "compiler", "backends", "bench")  # compiler/ installs as attnc.compiler, and so on


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            if parts[0] != "attnc":
                parts.insert(0, "attnc")
            out[".".join(parts)] = (path, package)
    return out


MODULES = _modules()


def _targets(module: str, package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The fully qualified names ``node`` imports (modules where they are modules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]


def _imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported name, inside a function, line) for every import statement of ``module``."""
    path, package = MODULES[module]
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.extend((t, inner, child.lineno) for t in _targets(module, package, child))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def _graph(*, function_level: bool, within: str = "attnc") -> nx.DiGraph:
    g = nx.DiGraph()
    for m in MODULES:
        if not m.startswith(within):
            continue
        g.add_node(m)
        for target, in_function, _ in _imports(m):
            if target in MODULES and target != m and target.startswith(within) and (function_level or not in_function):
                g.add_edge(m, target)
    return g


def test_the_scan_sees_the_package():
    assert {"attnc", "attnc.compiler.plan", "attnc.compiler.dispatch.registry", "attnc.backends.triton.runtime",
            "attnc.compiler.analysis.pipeline", "attnc.bench.harness"} <= set(MODULES)
    g = _graph(function_level=False)
    assert g.has_edge("attnc.compiler.plan", "attnc.compiler.analysis")  # a package re-export
    assert g.has_edge("attnc.backends.triton.tune", "attnc.compiler.tune")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("attnc.compiler")))
def test_the_compiler_imports_no_backend(module):
    """Only the registry reaches a backend, by module-name string through importlib."""
    bad = [(t, line) for t, _, line in _imports(module)
           if t in ("attnc.backends", "backends") or t.startswith(("attnc.backends.", "backends."))]
    assert not bad, f"{module} imports a backend: {bad}"


def test_the_compiler_reaches_the_bench_only_from_the_bench_command():
    """attnc.bench (GPU measurements) is no part of compiling: only `attnc bench`'s handler imports
    it, when it runs; tests/e2e/test_wheel_install.py checks that the wheel ships it."""
    for m in MODULES:
        if not m.startswith("attnc.compiler"):
            continue
        for target, in_function, line in _imports(m):
            if target == "attnc.bench" or target.startswith("attnc.bench."):
                assert m == "attnc.compiler.cli" and in_function, f"{m}:{line} imports {target}"


def test_no_module_imports_a_checkout_folder_by_name():
    """`bench`, `compiler`, `backends` ... are top-level names in a checkout only: an installed wheel
    has attnc.bench, attnc.compiler, ... (a module imports them relatively or under attnc)."""
    top = {f for f in FOLDERS if f != "attnc"} | {"grammar", "templates", "examples"}
    for m in MODULES:
        for target, _, line in _imports(m):
            assert target.split(".")[0] not in top, f"{m}:{line} imports {target}, which a wheel does not have"


def test_backends_never_import_each_other():
    for m in MODULES:
        if not m.startswith("attnc.backends.") or m == "attnc.backends.common":
            continue
        own = ".".join(m.split(".")[:3])
        for target, _, line in _imports(m):
            if target.startswith("attnc.backends.") and target != "attnc.backends.common":
                assert target.startswith(own), f"{m}:{line} imports another backend's {target}"


def test_module_level_imports_have_no_cycle():
    cycles = list(nx.simple_cycles(_graph(function_level=False)))
    assert not cycles, f"module-level import cycles: {cycles[:5]}"


@pytest.mark.parametrize("within", ["attnc.compiler", "attnc.backends", "attnc"])
def test_imports_have_no_cycle_even_through_function_level_imports(within):
    """A function-level import only postpones a cycle (plan -> tune -> runtime -> plan was one;
    triton's decode -> launch -> decode and graph -> runtime -> graph were others): in the whole
    tree (compiler/, backends/, attnc/) both kinds of edge count."""
    cycles = list(nx.simple_cycles(_graph(function_level=True, within=within)))
    assert not cycles, f"import cycles within {within}: {cycles[:5]}"


MAX_LINES = 700
OVER_THE_LIMIT: set[str] = set()  # (attnc/distributed.py, 749 lines, is now the package attnc/distributed/)


@pytest.mark.parametrize("folder", ["backends", "attnc"])
def test_no_source_file_is_over_the_line_limit(folder):
    """Small readable modules: no source file of backends/ or attnc/ over MAX_LINES lines."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= OVER_THE_LIMIT, f"over {MAX_LINES} lines: {long}"


def test_the_triton_kernels_folder_holds_only_kernels():
    """backends/triton/kernels/ is @triton.jit / @gluon.jit code: every function defined at a
    module's top level is a jitted one (constants and the Gluon import may sit beside them; the
    host side that chooses, plans and launches lives one folder up)."""
    folder = ROOT / "backends" / "triton" / "kernels"
    found = 0
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                jitted = [d for d in node.decorator_list if isinstance(d, ast.Attribute) and d.attr == "jit"
                          and isinstance(d.value, ast.Name) and d.value.id in ("triton", "gluon")]
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                assert jitted, f"{where} {node.name} is not a kernel (@triton.jit / @gluon.jit)"
                found += 1
    assert found >= 40  # the scan sees the kernels (49 today)


def test_the_plan_pipeline_runs_in_its_listed_order():
    """Every step reads call inputs or results of steps listed before it, and adds a new name."""
    from attnc.compiler.analysis import PLAN_INPUTS, PLAN_PIPELINE
    known = set(PLAN_INPUTS)
    for step in PLAN_PIPELINE:
        assert set(step.reads) <= known, f"step {step.name} reads {sorted(set(step.reads) - known)} before it exists"
        assert step.name not in known, f"step {step.name} shadows an input or an earlier step"
        known.add(step.name)


def _plain_globals(tree: ast.Module) -> set[str]:
    """A kernel module's top-level names bound to plain Python values (not ``tl.constexpr(...)`` /
    ``gl.constexpr(...)``): compiled Triton refuses to read them inside a jitted function, while
    the interpreter the CPU tests run does not notice."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            constexpr = (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                         and value.func.attr == "constexpr")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not constexpr:
                out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def test_kernels_read_no_plain_python_global():
    """A @jit function reads module constants only as constexpr globals: Triton 3.6 on the H200
    failed to compile the sink join (``sink * LOG2E``) that every interpreted test had run."""
    folder = ROOT / "backends" / "triton" / "kernels"
    bad, seen = [], 0
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        plain = _plain_globals(tree)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            seen += 1
            local = {a.arg for a in node.args.args + node.args.kwonlyargs}
            local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain - local:
                    bad.append(f"{path.relative_to(ROOT)}:{n.lineno} {node.name} reads {n.id}")
    assert seen >= 40
    assert not bad, "plain globals inside kernels (make them tl.constexpr or pass them in):\n" + "\n".join(bad)
