"""The shape of the code, checked: dependencies point one way (workers and gateway -> zkqueue,
never back), no import cycle, the library core needs only kazoo and the standard library, every
multi is built in zkqueue/protocol/claims.py, no module is over the size limit, and README's Layout
section names every module. Each rule is also run on a small bad tree to show it can fail."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What each shipped package may import from the project.
LAYERS = {
    "zkqueue": {"zkqueue"},
    "workers": {"zkqueue", "workers"},
    "gateway": {"zkqueue", "gateway"},
}
#: What each sub-package of the library may import from the others (plumbing <- protocol <-
#: {producer, dispatch} <- operations; the CLI above them all). ``zkqueue.errors`` and
#: ``zkqueue.defaults`` sit below every one of them and import none.
SUBLAYERS = {
    "zkqueue.plumbing": set(),
    "zkqueue.protocol": {"zkqueue.plumbing"},
    "zkqueue.dispatch": {"zkqueue.plumbing", "zkqueue.protocol"},
    "zkqueue.producer": {"zkqueue.plumbing", "zkqueue.protocol"},
    "zkqueue.operations": {
        "zkqueue.plumbing",
        "zkqueue.protocol",
        "zkqueue.dispatch",
        "zkqueue.producer",
    },
    "zkqueue.errors": set(),
    "zkqueue.defaults": set(),
}
#: The project's top-level packages (imports of these are project imports).
PROJECT = {*LAYERS, "scripts", "tests"}
#: Third-party packages the library core may import: kazoo alone. Optional concerns are allowed
#: only in the modules named here, which the extras that install them serve.
CORE_THIRD_PARTY = {"kazoo"}
OPTIONAL = {
    "zkqueue.cli": {"click", "rich"},
    "zkqueue.operations.top": {"rich"},
    "zkqueue.operations.topview": {"rich"},
    "zkqueue.operations.exporter": {"prometheus_client"},
    "zkqueue.operations.serving": {"prometheus_client"},
    # Imported on first use; without them streams come through claims (every extra brings
    # both: aiohttp for AsyncJob, httpx for Job).
    "zkqueue.producer.direct": {"httpx", "aiohttp"},
}
#: The one module that builds ZooKeeper multis.
TRANSITIONS = "zkqueue.protocol.claims"
#: Modules of zkq that ``import zkqueue`` loads in a row at most (the longest chain of
#: module-level imports from the package's face, faces not counted): a reader follows the public
#: API down to its bottom in a few files, and the library loads only what it needs.
MAX_IMPORT_CHAIN = 6
#: Lines of code a module holds at most: docstrings, comments and blank lines do not count, so
#: the limit guides how much a module does and never costs a sentence of documentation.
MAX_CODE_LINES = 500


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def package(self) -> str:
        return self.name.split(".", 1)[0]


def modules(root: Path, packages: set[str]) -> Iterator[Module]:
    for package in sorted(packages):
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield Module(name, path, ast.parse(path.read_text(), str(path)))


def imports(module: Module) -> Iterator[str]:
    """Every name this one imports, at any depth (function-local and type-only too): for
    ``from a import b``, both ``a`` and ``a.b`` (one of them is a module)."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.name.split(".")[: -node.level or None]
                if module.path.name == "__init__.py":
                    parent = module.name.split(".")[: len(module.name.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def project_edges(root: Path, mods: list[Module]) -> dict[str, set[str]]:
    """Module -> project modules it imports. ``from pkg import mod`` is an edge to ``pkg.mod``
    alone (the package's __init__ runs first, but that is how packages work, not a cycle)."""
    known = {m.name for m in mods}
    edges = {}
    for m in mods:
        names = {n for n in imports(m) if n in known and n != m.name}
        edges[m.name] = {n for n in names if not any(o.startswith(n + ".") for o in names)}
    return edges


def upward_imports(mods: list[Module]) -> list[str]:
    bad = []
    for m in mods:
        allowed = LAYERS.get(m.package)
        if allowed is None:
            continue
        for name in imports(m):
            top = name.split(".", 1)[0]
            if top in PROJECT and top not in allowed:
                bad.append(f"{m.name} imports {name}")
    return bad


def sideways_imports(mods: list[Module]) -> list[str]:
    """Imports from one sub-package of the library into another that its layer does not allow."""
    bad = []
    for m in mods:
        own = next((s for s in SUBLAYERS if m.name == s or m.name.startswith(s + ".")), None)
        if own is None:
            continue
        for name in imports(m):
            other = next((s for s in SUBLAYERS if name == s or name.startswith(s + ".")), None)
            below_all = other in ("zkqueue.errors", "zkqueue.defaults") and own != other
            if other is None or other == own or below_all:
                continue
            if other not in SUBLAYERS[own]:
                bad.append(f"{m.name} imports {name}")
    return sorted(set(bad))


def third_party_in_core(mods: list[Module]) -> list[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for m in mods:
        if m.package != "zkqueue":
            continue
        extra = next(
            (v for k, v in OPTIONAL.items() if m.name == k or m.name.startswith(k + ".")), set()
        )
        for name in imports(m):
            top = name.split(".", 1)[0]
            if top and top not in stdlib | PROJECT | CORE_THIRD_PARTY | extra:
                bad.append(f"{m.name} imports {name}")
    return sorted(set(bad))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def multis_outside_transitions(mods: list[Module]) -> list[str]:
    bad = []
    for m in mods:
        if m.name == TRANSITIONS:
            continue
        for node in ast.walk(m.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "transaction"
            ):
                bad.append(f"{m.name}:{node.lineno}")
    return bad


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not only a comment, not inside a docstring."""
    tree = ast.parse(source)
    docs: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docs
    )


def oversized(root: Path, packages: set[str]) -> list[str]:
    return [
        f"{path.relative_to(root)}: {n} lines of code"
        for package in sorted(packages)
        for path in sorted((root / package).rglob("*.py"))
        if (n := code_lines(path.read_text())) > MAX_CODE_LINES
    ]


def layout_lines(readme: str) -> set[str]:
    """Module paths listed in README's Layout section (one per line in its code block)."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\s{4}([\w/]+\.py)\b", section, re.MULTILINE))


def load_time_edges(mods: list[Module]) -> dict[str, set[str]]:
    """Module -> project modules it imports when it loads: module-level imports only (not
    function-local ones, nor those under ``if TYPE_CHECKING:``), package faces resolved to
    the modules they name."""
    known = {m.name for m in mods}
    edges: dict[str, set[str]] = {}
    for m in mods:
        names = set()
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:  # ``from pkg import mod`` loads mod
                    name = f"{node.module}.{alias.name}"
                    names.add(name if name in known else node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        edges[m.name] = {n for n in names if n in known and n != m.name}
    return edges


def longest_chain(edges: dict[str, set[str]], start: str) -> list[str]:
    """The longest import path from ``start`` (the graph has no cycle: checked apart)."""
    memo: dict[str, list[str]] = {}

    def walk(name: str) -> list[str]:
        if name not in memo:
            below = [walk(n) for n in sorted(edges.get(name, ()))]
            memo[name] = [name, *max(below, key=len, default=[])]
        return memo[name]

    return walk(start)


def faces(chain: list[str], mods: list[Module]) -> list[str]:
    """The chain without package faces (``__init__`` modules)."""
    packages = {m.name for m in mods if m.path.name == "__init__.py"}
    return [name for name in chain if name not in packages]


def shipped(root: Path) -> list[Module]:
    return list(modules(root, {p for p in LAYERS if (root / p).is_dir()}))


# -- the project ------------------------------------------------------------------------------


def test_dependencies_point_one_way() -> None:
    assert upward_imports(shipped(ROOT)) == []


def test_sub_packages_import_only_the_layers_below() -> None:
    assert sideways_imports(shipped(ROOT)) == []


def test_library_core_needs_only_kazoo_and_the_standard_library() -> None:
    assert third_party_in_core(shipped(ROOT)) == []


def test_no_import_cycle() -> None:
    mods = list(modules(ROOT, {p for p in PROJECT if (ROOT / p).is_dir()}))
    assert cycles(project_edges(ROOT, mods)) == []


def test_every_multi_is_built_in_the_transitions_module() -> None:
    assert multis_outside_transitions(shipped(ROOT)) == []


def test_import_zkqueue_loads_a_short_chain() -> None:
    mods = shipped(ROOT)
    chain = faces(longest_chain(load_time_edges(mods), "zkqueue"), mods)
    assert len(chain) <= MAX_IMPORT_CHAIN, " -> ".join(chain)


def test_no_module_over_the_size_limit() -> None:
    assert oversized(ROOT, {p for p in PROJECT if (ROOT / p).is_dir()}) == []


def test_readme_layout_names_every_module_and_nothing_else() -> None:
    listed = layout_lines((ROOT / "README.md").read_text())
    present = {
        str(path.relative_to(ROOT))
        for package in sorted({*LAYERS, "scripts"})
        if (ROOT / package).is_dir()
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    }
    assert sorted(present - listed) == [], "modules missing from README's Layout section"
    assert sorted(listed - present) == [], "README's Layout section names missing modules"


# -- each rule fails on a tree that breaks it -------------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def bad_tree(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        {
            "zkqueue/__init__.py": "",
            "zkqueue/a.py": "from zkqueue import b\nimport torch\n",
            "zkqueue/b.py": "from zkqueue.a import x\nfrom workers.loop import Worker\n",
            "zkqueue/c.py": '"""Doc."""\n# why\ndef f(zk):\n    return zk.transaction()\n'
            + "x = 1\n" * 500,
            "zkqueue/protocol/__init__.py": "",
            "zkqueue/protocol/claims.py": "from zkqueue.dispatch.line import Line\n",
            "zkqueue/dispatch/__init__.py": "",
            "zkqueue/dispatch/line.py": "",
            "zkqueue/errors.py": "from zkqueue.protocol import claims\n",
            "workers/__init__.py": "",
            "workers/loop.py": "from zkqueue import a\n",
        },
    )


def test_rules_catch_a_bad_tree(bad_tree: Path) -> None:
    mods = shipped(bad_tree)
    assert upward_imports(mods) == [
        "zkqueue.b imports workers.loop",
        "zkqueue.b imports workers.loop.Worker",
    ]
    assert "zkqueue.a imports torch" in third_party_in_core(mods)
    assert cycles(project_edges(bad_tree, mods)) == [["workers.loop", "zkqueue.a", "zkqueue.b"]]
    assert multis_outside_transitions(mods) == ["zkqueue.c:4"]
    assert sideways_imports(mods) == [
        "zkqueue.errors imports zkqueue.protocol",
        "zkqueue.errors imports zkqueue.protocol.claims",
        "zkqueue.protocol.claims imports zkqueue.dispatch.line",
        "zkqueue.protocol.claims imports zkqueue.dispatch.line.Line",
    ]
    assert oversized(bad_tree, {"zkqueue", "workers"}) == ["zkqueue/c.py: 502 lines of code"]


def test_the_chain_rule_counts_load_time_imports_only(tmp_path: Path) -> None:
    tree = write(
        tmp_path,
        {
            "zkqueue/__init__.py": "from zkqueue.a import A\n",
            "zkqueue/a.py": "from zkqueue import b\n",
            "zkqueue/b.py": "from zkqueue.c import C\nif TYPE_CHECKING:\n    import zkqueue.d\n",
            "zkqueue/c.py": "def f():\n    from zkqueue import d\n",
            "zkqueue/d.py": "",
        },
    )
    mods = shipped(tree)
    chain = longest_chain(load_time_edges(mods), "zkqueue")
    assert chain == ["zkqueue", "zkqueue.a", "zkqueue.b", "zkqueue.c"]
    assert faces(chain, mods) == ["zkqueue.a", "zkqueue.b", "zkqueue.c"]


def test_code_lines_leave_out_docstrings_comments_and_blanks() -> None:
    source = '"""Module.\n\nMore."""\n\n# why\ndef f() -> int:\n    """Doc."""\n    return 1\n'
    assert code_lines(source) == 2


def test_layout_section_is_read_line_by_line() -> None:
    readme = "## Layout\n\n    zkqueue/a.py   what a does\n    workers/b.py   b\n\n## Next\n"
    assert layout_lines(readme) == {"zkqueue/a.py", "workers/b.py"}
