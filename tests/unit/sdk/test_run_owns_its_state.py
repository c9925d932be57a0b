"""`Run` owns its state and its command handling (issue 43): no file but `sdk/vigil/run.py` reads or writes
a private name of `Run` (`run._state`, `run._link`, ...). Its command handling gets a `RunState`, not the run.
Checked on the syntax trees of every Python file of the repository, tests included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUN = ROOT / "sdk" / "vigil" / "run.py"
OWN = ("self", "cls")  # a class's own private names, whatever it is
TREES = ("sdk", "services", "trainer", "libs", "cli", "bench", "examples", "tests")


def run_private_names() -> set[str]:
    """The private methods of `Run` and the private attributes it sets or reads on itself."""
    tree = ast.parse(RUN.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    names |= {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def reaches_into(path: Path, names: set[str]) -> list[str]:
    """Each `x._name` in `path` with `_name` one of `names` and `x` not `self` or `cls`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in OWN
        if isinstance(node, ast.Attribute) and node.attr in names and not own:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_file_but_run_py_touches_a_private_name_of_run():
    names = run_private_names()
    assert {"_state", "_link", "_commands"} <= names, names  # the rule reads the class it guards
    files = [f for tree in TREES for f in (ROOT / tree).rglob("*.py") if f != RUN and ".venv" not in f.parts]
    assert len(files) > 300, len(files)
    found = [f"{f.relative_to(ROOT)}: {hit}" for f in files for hit in reaches_into(f, names)]
    assert found == [], "\n".join(found)


def test_the_rule_finds_a_reach_into_a_run(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(run, ctx):\n    return run._state.next_step, ctx.run._link, self._link\n")
    assert sorted(reaches_into(bad, run_private_names())) == [
        "bad.py:2: ctx.run._link",
        "bad.py:2: run._state",
    ]
