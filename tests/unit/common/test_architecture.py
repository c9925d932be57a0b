"""Services talk only through libs/common, and the SDK imports nothing of the control plane: the
import-linter contracts in pyproject.toml hold."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_services_never_import_each_other():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    result = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_source_folder_is_a_package_the_install_finds():
    """A folder of modules without `__init__.py` would be left out of the wheel (packages.find skips it),
    and each top-level folder holds one import package, so a module's path names its import."""

    for project in (ROOT, ROOT / "sdk"):  # the control plane, and the SDK's distribution
        find = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
            "find"
        ]
        _one_package_per_folder(project, find)


def _one_package_per_folder(project: Path, find: dict) -> None:
    from setuptools import find_packages

    for where in find["where"]:
        top = (project / where).resolve()
        packages = set(find_packages(str(top), include=find["include"]))
        roots = {p for p in packages if "." not in p}
        assert len(roots) == 1 and (top / roots.pop()).is_dir(), f"{where}: {sorted(packages)}"
        folders = {
            ".".join(py.parent.relative_to(top).parts)
            for py in top.rglob("*.py")
            if "__pycache__" not in py.parts
        }
        assert folders <= packages, f"{where}: add __init__.py to {sorted(folders - packages)}"


def test_services_call_the_bus_never_raw_jetstream():
    """Outside the bus package no code under services/ or libs/common reaches past the bus's API into
    nats-py's JetStream context (`bus.js`, `nc.jetstream()`)."""
    import re

    raw = re.compile(r"\.js\.(?!errors\b|api\b)|\.js\b(?!\.)|\.jetstream\(")
    bus = ROOT / "libs" / "common" / "vigil_common" / "bus"
    found = [
        f"{py.relative_to(ROOT)}:{n}: {line.strip()}"
        for top in (ROOT / "services", ROOT / "libs" / "common")
        for py in top.rglob("*.py")
        if bus not in py.parents
        for n, line in enumerate(py.read_text().splitlines(), start=1)
        if raw.search(line.split("#")[0]) and not line.lstrip().startswith(("import ", "from "))
    ]
    assert not found, "call the bus's API instead:\n" + "\n".join(found)
