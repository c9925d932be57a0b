"""The documentation: the README is the front page, docs/ the site (mkdocs.yml; scripts/test.sh builds it
with --strict), its reference pages are generated from the code, and every command printed on the
quickstart and guide pages is run by a test (or listed below as not yet)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from litestar.testing import TestClient

from tests.doc_commands import DOCS, QUICKSTART, README, ROOT, bash_blocks, guide_pages

MAX_README_LINES = 250
# The README's (and the quickstart's) two commands: CI runs the test command (.ci/run), and
# tests/integration/demo/test_demo.py runs the demo.
SETUP = ["bash scripts/install.sh", ".venv/bin/vigil demo", "bash scripts/test.sh"]
# Commands printed on a guide page (its fenced bash blocks) and the test that runs each as printed.
RUN_BY: dict[str, dict[str, str]] = {
    "alerting.md": {
        c: "tests/integration/scheduler/test_alert_routes.py"
        for c in (
            "vigil alerts add oncall https://hooks.example/vigil --kind nan --kind spike --min-severity error",
            "vigil alerts add ml-slack https://hooks.slack.com/services/T000/B000/XXXX --format slack --team ml",
            "vigil alerts add ops http://alertmanager.example:9093 --format alertmanager",
            "vigil alerts list",
        )
    },
    "gpus.md": {"bash scripts/gpu-check.sh": "tests/integration/bench/test_gpu_check.py"},
    "own-code.md": {"vigil submit job.yaml --code .": "tests/integration/byo/test_code_pack.py"},
}
# Commands printed on a guide page that no test runs as printed yet, by page. Move one to RUN_BY when a
# test runs it; a command printed on a guide and in neither place fails here.
NOT_YET_RUN: dict[str, set[str]] = {
    # issue 42 §1: the `compose` marker's test runs the stack for real (with an override file)
    "compose.md": {"cp deploy/env.example .env", "docker compose up --build -d", "docker compose ps"},
    # scripts/install.sh installs ".[test]", which holds the worker and byo extras; not this line itself
    "own-code.md": {'.venv/bin/pip install ".[worker,byo]"'},
    # tests/unit/test_k8s.py and test_helm.py render and validate these objects; no cluster applies them
    "kubernetes.md": {
        "kubectl apply -k deploy/k8s/overlays/gpu",
        "helm install vigil deploy/helm/vigil -f my-values.yaml",
    },
    # tests/integration/slurm submits vigil-job.sbatch to a real one-node Slurm with options of its own;
    # vigil-workers.sbatch is not submitted by any test
    "slurm.md": {
        "sbatch --nodes=8 --time=7-00:00:00 deploy/slurm/vigil-workers.sbatch",
        "sbatch --nodes=2 deploy/slurm/vigil-job.sbatch job.yaml",
    },
}


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    """docs/hooks/reference.py, the MkDocs hook that generates the reference pages."""
    spec = importlib.util.spec_from_file_location("vigil_docs_hooks", DOCS / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nav_pages(nav: list[object]) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    links = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert len(links) >= 15, "the README says where to go next"
    missing = sorted({link for link in links if not (ROOT / link).exists()})
    assert not missing, f"README links to pages that do not exist: {missing}"


def test_the_readme_and_the_quickstart_print_the_commands_ci_runs() -> None:
    assert bash_blocks(README)[0] == SETUP
    assert bash_blocks(QUICKSTART)[0] == SETUP
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/install.sh" in test_sh
    assert re.search(r"^[^#\n]*mkdocs build --strict", test_sh, flags=re.M), "CI builds the site strictly"
    assert '"demo"' in (ROOT / "tests" / "integration" / "demo" / "test_demo.py").read_text()


def test_every_quickstart_command_is_run_by_a_test() -> None:
    """The first block is the README's (above); the other is tests/integration/docs/test_quickstart.py's,
    which fails on a command it does not know how to run."""
    blocks = bash_blocks(QUICKSTART)
    assert len(blocks) == 2, "a new block of commands on the quickstart needs a test that runs it"
    assert blocks[1][0].startswith("vigil submit")
    assert (ROOT / "tests" / "integration" / "docs" / "test_quickstart.py").exists()


def test_every_guide_command_is_run_by_a_test_or_listed_as_not_yet() -> None:
    printed = {page.name: {c for block in bash_blocks(page) for c in block} for page in guide_pages()}
    known = {name: set(RUN_BY.get(name, {})) | NOT_YET_RUN.get(name, set()) for name in printed}
    unknown = {name: sorted(cmds - known[name]) for name, cmds in printed.items()}
    assert not {k: v for k, v in unknown.items() if v}, f"commands no test runs: {unknown}"
    listed = {name: set(RUN_BY.get(name, {})) | NOT_YET_RUN.get(name, set()) for name in RUN_BY | NOT_YET_RUN}
    stale = {name: sorted(cmds - printed.get(name, set())) for name, cmds in listed.items()}
    assert not {k: v for k, v in stale.items() if v}, f"no longer printed on the guide: {stale}"
    for runs in RUN_BY.values():
        for command, test in runs.items():
            script = command.split()[-1] if command.startswith("bash ") else command.split()[0]
            assert Path(script).name in (ROOT / test).read_text(), f"{test} does not run {command!r}"


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    on_disk = sorted(
        str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts
    )
    assert sorted(listed) == on_disk
    assert config["site_dir"].startswith("build/"), "the site is built into the git-ignored build/"
    assert "build/" in (ROOT / ".gitignore").read_text().split()


def test_the_settings_page_lists_every_setting_with_its_meaning(hooks: ModuleType) -> None:
    from vigil_common.settings import Settings

    assert hooks.SETTINGS_MARKER in (DOCS / "reference" / "settings.md").read_text()
    rows = {variable.strip("`"): meaning for variable, _, meaning in hooks.settings_rows()}
    assert set(rows) == {f"VIGIL_{name.upper()}" for name in Settings.model_fields}
    assert all(rows.values()), f"settings without a meaning: {[v for v, m in rows.items() if not m]}"
    undescribed = [name for name, info in Settings.model_fields.items() if not info.description]
    assert not undescribed, f"give these a Field(description=...) in vigil_common/settings.py: {undescribed}"
    assert "| `VIGIL_HOT_SPARES` | `0` |" in hooks.settings_table()


def test_the_http_api_page_renders_the_schema_the_gateway_serves(hooks: ModuleType) -> None:
    from vigil_common.settings import Settings
    from vigil_scheduler.app import Deps, create_app

    token = "unit-test-token-000000"
    app = create_app(Deps(Settings(api_token=token), None, None, None, token))  # type: ignore[arg-type]
    served = TestClient(app).get("/schema/openapi.json")
    assert served.status_code == 200
    built = hooks.openapi_schema()
    assert served.json() == built
    assert "/api/v1/jobs" in built["paths"]
    page = DOCS / "reference" / "http-api.md"
    (tag,) = re.findall(r"\[OAD\(([^)]+)\)\]", page.read_text())
    assert (page.parent / tag).resolve() == hooks.OPENAPI.resolve(), "the page renders what the hook writes"


def test_the_cli_page_covers_every_command(hooks: ModuleType) -> None:
    from vigil_cli.main import cli

    text = hooks.cli_reference()
    for name, command in cli.commands.items():
        assert f"## `vigil {name}`" in text
        for sub in getattr(command, "commands", {}):  # a group's own commands too
            assert f"## `vigil {name} {sub}`" in text
    assert hooks.CLI_MARKER in (DOCS / "reference" / "cli.md").read_text()
