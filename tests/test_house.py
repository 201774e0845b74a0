"""The house rules, checked on the source as written: every module says its job in its first
line and stays short enough to read in one sitting, imports form no cycle (function-level
imports included), user-facing code depends on no benchmark, and no private name crosses a
module boundary."""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "nostall"
MAX_LINES = 800


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


@functools.cache  # (every test here reads the same parse of each module: parsed once)
def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


@functools.cache
def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """``(module imported, names taken from it, line)`` for every import in ``name``, at any
    depth (function-level ones included); relative imports resolved."""
    tree = _tree(name)
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [a.name for a in node.names]
            # ``from pkg import sub`` imports the module ``pkg.sub``
            subs = [n for n in names if f"{base}.{n}" in MODULES]
            if subs:
                out += [(f"{base}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                out.append((base, rest, node.lineno))
    return [(m, names, line) for m, names, line in out if m.split(".")[0] == "nostall"]


def _target(module: str) -> str | None:
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def test_every_module_says_its_job_in_its_first_line():
    missing = [n for n in MODULES if not (ast.get_docstring(_tree(n)) or "").strip()]
    assert not missing, f"modules without a docstring: {missing}"


def test_no_module_is_too_long_to_read_in_one_sitting():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    long = {n: k for n, k in long.items() if k > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {n: set() for n in MODULES}
    for name in MODULES:
        for module, _, _ in _imports(name):
            target = _target(module)
            if target and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_imports_form_no_cycle_function_level_imports_included():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The folders (and top-level modules) in the order data flows through them: a folder
# imports only from folders of a lower layer. Store → host memory → device → module /
# pipeline → cache → serve → cli, with the tools (synthetic stores, the demo, the
# benchmarks) above what they drive.
LAYERS = [
    {"errors", "logs"},
    {"store"},  # where weights live: formats, readers, object storage, the catalog
    {"memory"},  # host memory: pinned pools, the shared tier
    {"transfer"},  # host → device
    {
        "assemble",
        "video",
        "stream",
    },  # modules built on device weights; blocks streamed in; frames out
    {"quant"},
    {"api"},  # load_state_dict / load_model
    {"adapters", "verify"},
    {"cache"},
    {"nostall"},  # the package's public surface
    {"serve", "synthetic"},
    {"demo", "bench"},
    {"cli"},
]


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nostall"


def _upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    rank = {f: i for i, layer in enumerate(layers) for f in layer}
    bad = []
    for name, targets in sorted(graph.items()):
        a = _folder(name)
        for target in sorted(targets):
            b = _folder(target)
            if a != b and rank.get(b, len(layers)) >= rank.get(a, -1):
                bad.append(f"{name} ({a}) imports {target} ({b})")
    return bad


def test_every_folder_has_a_layer():
    assert {_folder(n) for n in MODULES} - set().union(*LAYERS) == set()


def test_folders_form_layers_each_importing_only_from_below():
    assert _upward_imports(_graph(), LAYERS) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"nostall.store.a": {"nostall.cache.b"}, "nostall.cache.b": {"nostall.store.a"}}
    assert _upward_imports(graph, [{"store"}, {"cache"}]) == [
        "nostall.store.a (store) imports nostall.cache.b (cache)"
    ]


def test_import_nostall_stays_light():
    code = "import sys, nostall; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_user_facing_code_imports_no_benchmark():
    allowed = ("nostall.bench", "nostall.cli.bench")
    bad = [
        f"{name}:{line} imports {module}"
        for name in MODULES
        if not name.startswith(allowed)
        for module, _, line in _imports(name)
        if (_target(module) or "").startswith("nostall.bench")
    ]
    assert not bad


def test_tests_outside_tests_bench_import_no_benchmark():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT / "tests")
        if rel.parts[0] == "bench" or (rel.parts[0] == "cli" and "bench" in rel.name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mod = getattr(node, "module", None) if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [mod or ""]
            bad += [f"{rel}:{node.lineno}" for n in names if n.startswith("nostall.bench")]
    assert not bad


def test_no_private_name_crosses_a_module_boundary():
    bad = [
        f"{name}:{line} takes {n} from {module}"
        for name in MODULES
        for module, names, line in _imports(name)
        if _target(module) != name
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not bad


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    "record", sorted((ROOT / "docs" / "bench" / "runs").glob("*.json")), ids=lambda p: p.name
)
def test_every_recorded_run_names_a_real_commit(record):
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone does not hold every recorded commit")
    commit = json.loads(record.read_text()).get("commit")
    assert isinstance(commit, str) and commit, f"{record.name} names no commit"
    found = _git("cat-file", "-e", f"{commit}^{{commit}}")
    assert found.returncode == 0, f"{record.name}: commit {commit!r} is not in this repository"


def test_no_two_test_files_share_a_name():
    # pytest imports test files by basename (rootdir imports, no __init__.py): a second
    # test_kernels.py stops the whole collection, and did, on the GPU machine only
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}


def test_no_module_names_a_path_under_docs():
    # The library is installed without the repository's documents: a path under docs/ in
    # src/ (a help string, a docstring, a comment) names nothing on a user's machine, and
    # goes stale when the docs move. What publishes records lives in tools/.
    import re

    under_docs = re.compile(r"(?<![\w./-])docs/")
    bad = [
        f"{name}:{i}: {line.strip()}"
        for name, path in MODULES.items()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if under_docs.search(line)
    ]
    assert not bad, "\n".join(bad)
