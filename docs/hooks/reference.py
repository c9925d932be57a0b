"""MkDocs hooks: the reference pages generated from the code they describe, at build time.

- `reference/http-api.md`: the OpenAPI document the gateway app serves at `/schema`, built from
  `create_app` (no server, database or bus) and written to `build/docs/openapi.json`, where the page's
  `[OAD(...)]` tag has neoteroi-mkdocs render it; the same file is published as `reference/openapi.json`.
- `reference/settings.md`: one row per `Settings.model_fields` entry, its description included.
- `reference/cli.md`: every `vigil` command's help, from the click command tree.

Each page holds a marker comment that the hook replaces, so the text around it stays hand-written.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import click
from mkdocs.structure.files import File, Files
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
OPENAPI = ROOT / "build" / "docs" / "openapi.json"
SETTINGS_MARKER = "<!-- vigil-settings-table -->"
CLI_MARKER = "<!-- vigil-cli-reference -->"
ENV_PREFIX = "VIGIL_"


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI document of the gateway app, as `GET /schema/openapi.json` serves it."""
    from vigil_common.settings import Settings
    from vigil_scheduler.app import Deps, create_app
    from vigil_scheduler.gateway.openapi import with_pydantic_schemas

    token = "docs-build-token-0000"
    # The lifespan alone uses the pool, bus and scheduler; the schema is built without starting it.
    deps = Deps(settings=Settings(api_token=token), pool=None, bus=None, scheduler=None, api_token=token)  # type: ignore[arg-type]
    return with_pydantic_schemas(create_app(deps).openapi_schema.to_schema())


def write_openapi(path: Path = OPENAPI) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n")
    return path


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return f"`{json.dumps(value)}`" if isinstance(value, list | dict) else "computed at start"
    if info.default is PydanticUndefined:
        return "required"
    if info.default is None:
        return "unset"
    value = info.default
    return f"`{str(value).lower()}`" if isinstance(value, bool) else f"`{value}`"


def settings_rows() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting, in the order `Settings` declares them."""
    from vigil_common.settings import Settings

    rows = []
    for name, info in Settings.model_fields.items():
        meaning = html.escape(info.description or "", quote=False).replace("|", "\\|")
        rows.append((f"`{ENV_PREFIX}{name.upper()}`", _default(info), meaning))
    return rows


def settings_table() -> str:
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| {v} | {d} | {m} |" for v, d, m in settings_rows()]
    return "\n".join(lines)


def _command_help(name: str, command: click.Command, parent: click.Context | None) -> list[str]:
    ctx = click.Context(command, info_name=name, parent=parent, terminal_width=100, max_content_width=100)
    out = [f"## `{ctx.command_path}`", "", "```text", command.get_help(ctx).rstrip(), "```", ""]
    if isinstance(command, click.Group):
        for sub in sorted(command.list_commands(ctx)):
            child = command.get_command(ctx, sub)
            if child is not None and not child.hidden:
                out += _command_help(sub, child, ctx)
    return out


def cli_reference() -> str:
    from vigil_cli.main import cli

    root = click.Context(cli, info_name="vigil", terminal_width=100, max_content_width=100)
    out = ["```text", cli.get_help(root).rstrip(), "```", ""]
    for name in cli.list_commands(root):
        command = cli.get_command(root, name)
        if command is not None and not command.hidden:
            out += _command_help(name, command, root)
    return "\n".join(out)


# MkDocs event hooks


def on_pre_build(config: Any, **_: Any) -> None:
    write_openapi()


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, settings_table())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown


def on_files(files: Files, config: Any, **_: Any) -> Files:
    # published beside the rendered page, so that a reader (or a client generator) gets the same document
    files.append(File.generated(config, "reference/openapi.json", abs_src_path=str(OPENAPI)))
    return files
