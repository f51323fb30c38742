"""The house rules of the runtime and the CLI that a walk of the source can check (issue "The house, second
pass"): one dispatch shared by the step driver and the pipeline stage, no private name imported across modules,
small functions with few parameters in runtime/, the runtime's two rooms, the CLI in small modules, one K."""

import ast
import os
import re

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "longpack")
RUNTIME = os.path.join(SRC, "runtime")


def _files(folder):
    for root, _, files in os.walk(folder):
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(root, f)


def _tree(path):
    with open(path) as f:
        return ast.parse(f.read())


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_runtime_function_takes_more_than_seven_parameters_or_runs_over_sixty_lines():
    wide, long = [], []
    for path in _files(RUNTIME):
        for fn in _functions(_tree(path)):
            a = fn.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls", "ctx")
                     or fn.name not in ("forward", "backward") and x.arg != "ctx"]
            names = [n for n in names if n not in ("self", "cls")]
            if len(names) > 7 and fn.name not in ("forward", "backward"):  # autograd's signatures are torch's
                wide.append(f"{os.path.relpath(path, SRC)}:{fn.lineno} {fn.name} ({len(names)})")
            lines = fn.end_lineno - fn.lineno + 1
            if lines > 60:
                long.append(f"{os.path.relpath(path, SRC)}:{fn.lineno} {fn.name} ({lines} lines)")
    assert not wide, wide
    assert not long, long


def test_no_module_imports_another_modules_private_name():
    bad = []
    for path in _files(SRC):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad += [f"{os.path.relpath(path, SRC)}: {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_the_runtime_is_two_rooms_and_depends_on_the_core_not_the_cli():
    folders = sorted(d for d in os.listdir(RUNTIME) if os.path.isdir(os.path.join(RUNTIME, d)) and d[0] != "_")
    assert folders == ["kernel", "run"]
    loose = sorted(f for f in os.listdir(RUNTIME) if f.endswith(".py"))
    assert loose == ["__init__.py", "dist.py"]  # longpack.runtime.dist: public (leave), both rooms use it
    for path in _files(RUNTIME):
        text = open(path).read()
        assert not re.search(r"\bjobs\b.*import|import .*\bjobs\b|from \.+ import jobs", text), path
        if "/kernel/" in path:
            assert not re.search(r"from \.\.run\b|longpack\.runtime\.run\b", text), path  # the kernel needs no run
    assert not any("fakegpu" in p for p in _files(SRC))  # the test harness is not shipped


def test_step_and_pipeline_share_one_dispatch():
    for name in ("step.py", "pipeline.py"):
        text = open(os.path.join(RUNTIME, "kernel", name)).read()
        assert "from .dispatch import" in text, name
        assert "CPAttention(" not in text and "ChunkPass(" not in text, name  # the choice is dispatch's alone


def test_only_the_step_runner_registers_cp_groups():
    callers = [p for p in _files(SRC) if re.search(r"\bgroups\.add\(|\.add\(plan\.steps", open(p).read())]
    assert [os.path.relpath(p, SRC) for p in callers] == ["runtime/kernel/step_fn.py"]


def test_the_cli_is_small_modules_and_train_is_a_screen():
    cli = os.path.join(SRC, "cli")
    for path in _files(cli):
        assert sum(1 for _ in open(path)) <= 300, path
    fn = next(f for f in _functions(_tree(os.path.join(cli, "train_cmd.py"))) if f.name == "train")
    assert fn.end_lineno - fn.lineno + 1 <= 60


def test_one_k():
    defs = [p for p in _files(SRC) if re.search(r"^\s*K\s*=\s*1024\b", open(p).read(), re.M)]
    assert len(defs) <= 1, defs


def test_execution_doc_opens_with_the_two_rooms_and_every_name_in_it_exists():
    doc = open(os.path.join(os.path.dirname(SRC), "..", "docs", "EXECUTION.md")).read()
    picture = doc.split("```", 2)[1]
    assert "run/" in picture and "kernel/" in picture
    code = "\n".join(open(p).read() for p in _files(SRC))
    names = set(re.findall(r"\b([A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)+)\b", picture))
    missing = [n for n in sorted(names) if not all(re.search(rf"\b{part}\b", code) for part in n.split("."))]
    assert len(names) > 25 and not missing, missing
