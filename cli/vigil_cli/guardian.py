"""`vigil guardian set JOB key=value ...`: change a running job's guardian settings (`vigil guardian` alone
runs the service, `vigil_cli.services`).

vigil guardian set j-0123abcd spike_zscore=4 spike=halt
vigil guardian set j-0123abcd hang_floor_s=null --json
"""

from __future__ import annotations

from typing import Any

import click
import yaml

from vigil_cli.jobs import as_json, connect, json_option, url_option


def setting(text: str) -> tuple[str, Any]:
    """`key=value` as (key, value): the value read as a YAML scalar (`4` a number, `true` a boolean, `null`
    none, `halt` a string), as it would be in the spec's `guardian:` section."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise click.BadParameter(f"{text!r} is not key=value (spike_zscore=4)", param_hint="SETTINGS")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"{key}: {raw!r} is not a value: {exc}", param_hint="SETTINGS") from exc
    if isinstance(value, dict | list):
        raise click.BadParameter(f"{key}: one value, not {type(value).__name__}", param_hint="SETTINGS")
    return key.strip(), value


@click.command("set")
@click.argument("job_id", metavar="JOB")
@click.argument("settings", nargs=-1, required=True)
@url_option
@json_option
def set_settings(job_id: str, settings: tuple[str, ...], url: str | None, json_out: bool) -> None:
    """Change JOB's guardian settings: SETTINGS are key=value pairs of the spec's `guardian:` section
    (spike_zscore=4 spike=halt hang_timeout_s=120). Validated as the spec is, audited, and applied from
    the next step the guardian judges; the job's next attempts keep them."""
    fields = dict(setting(s) for s in settings)
    done = connect(url).set_guardian(job_id, **fields)
    if json_out:
        click.echo(as_json(done))
        return
    what = ", ".join(f"{k}={v}" for k, v in done.changed.items())
    click.echo(f"job {done.job_id}: guardian settings revision {done.revision} ({what}), from its next step")
