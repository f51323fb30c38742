"""The house rules a walk of src/ can check: no import circle between the package's modules (imports inside
functions count; ``if TYPE_CHECKING:`` blocks do not, they never run), no file outside the repository cited, and
the core (everything but runtime/ and hf/) free of torch."""

import ast
import os
import re

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
ROOT = os.path.dirname(SRC)


def _modules():
    mods = {}
    for folder, _, files in os.walk(os.path.join(SRC, "longpack")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(tree):
    """Every import statement that can run: all of them but those under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _graph():
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                base = (".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                        if node.level else "")
                base = ".".join(x for x in (base, node.module or "") if x)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                targets = [a.name for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_walk_finds_a_circle_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_src():
    graph = _graph()
    assert len(graph) > 80 and graph["longpack.cli"]  # the walk saw the package
    assert _cycles(graph) == []


def test_no_file_outside_the_repository_is_cited():
    cited = re.compile(r"\b(PAPERS|ENVIRONMENT|WORKLOADS|ARCHITECTURE|STYLE)\.md\b")
    found = []
    for top in ("src", "tests", "bench", "docs", "README.md"):
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                                                      if f.endswith((".py", ".md", ".sh"))]
        for file in files:
            with open(file, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    for m in cited.finditer(line):
                        if not os.path.exists(os.path.join(ROOT, "docs", m.group(0))):
                            found.append(f"{os.path.relpath(file, ROOT)}:{n}: {m.group(0)}")
    assert found == []


@pytest.mark.parametrize("package", ["planners", "sim", "cost", "plan", "jobs", "workloads", "columns"])
def test_the_core_is_free_of_torch(package):
    mods = _modules()
    names = [m for m in mods if m == f"longpack.{package}" or m.startswith(f"longpack.{package}.")]
    for name in names:
        with open(mods[name]) as f:
            tree = ast.parse(f.read())
        heads = {(a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
                 for n in _imports(tree) for a in n.names}
        assert "torch" not in heads, name
    assert names
