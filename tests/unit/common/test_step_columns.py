"""The step columns are written once: `step_columns.STEP_COLUMNS` (what a StepCompleted is stored as) and
`step_columns.BUCKET_COLUMNS` (the console's downsampled curves). The event, the migrations' tables, the
telemetry writer and the read model all agree with them, so a column added in one place alone fails
here. (tests/integration/telemetry/test_ingest.py checks the same against a migrated Postgres.)"""

from __future__ import annotations

import itertools
import re

from vigil.events import StepCompleted
from vigil_common import readmodel, step_columns
from vigil_common.db import load_migrations
from vigil_common.step_columns import STEP_COLUMNS, STEP_FIELDS, STEP_NOT_STORED
from vigil_telemetry import store

SQL_TYPES = {
    "text": "text",
    "integer": "int",
    "bigint": "int8",
    "double precision": "float8",
    "boolean": "bool",
    "timestamptz": "timestamptz",
}
_COLUMN = re.compile(r"^\s*(\w+)\s+(text|integer|bigint|double precision|boolean|timestamptz)\b", re.M)


def table_columns(table: str) -> dict[str, str]:
    """A table's columns and types as the migrations leave it: its newest CREATE TABLE, then every
    ADD COLUMN and ALTER COLUMN ... TYPE after it (types in STEP_COLUMNS' spelling)."""
    columns: dict[str, str] = {}
    for migration in load_migrations():
        created = re.search(rf"CREATE TABLE {table} \((.*?)\n\)", migration.sql, re.S)
        if created:
            columns = {name: SQL_TYPES[t] for name, t in _COLUMN.findall(created.group(1))}
        for altered in re.finditer(rf"ALTER TABLE {table}\s+(ADD COLUMN .*?);", migration.sql, re.S):
            for name, t in re.findall(
                r"ADD COLUMN\s+(\w+)\s+(text|integer|bigint|double precision|boolean|timestamptz)",
                altered.group(1),
            ):
                columns[name] = SQL_TYPES[t]
        for altered in re.finditer(rf"ALTER TABLE {table}\s+(ALTER COLUMN .*?);", migration.sql, re.S):
            for name, t in re.findall(
                r"ALTER COLUMN\s+(\w+)\s+TYPE\s+(text|integer|bigint|double precision|boolean)\b",
                altered.group(1),
            ):
                columns[name] = SQL_TYPES[t]
    return columns


def test_every_field_of_the_event_is_stored_or_named_as_not_stored() -> None:
    fields = set(StepCompleted.model_fields)
    assert set(STEP_FIELDS) | STEP_NOT_STORED == fields
    assert not set(STEP_FIELDS) & STEP_NOT_STORED
    assert len(set(STEP_FIELDS)) == len(STEP_FIELDS)


def test_the_steps_table_has_exactly_the_step_columns() -> None:
    columns = table_columns("telemetry_steps")
    seq = columns.pop("seq")  # its arrival order, set by the table
    assert seq == "int8"
    assert columns == dict(STEP_COLUMNS)


def test_the_buckets_table_has_exactly_the_bucket_columns() -> None:
    assert table_columns("telemetry_step_buckets") == dict(step_columns.BUCKET_COLUMNS)
    metrics = {name.rsplit("_", 1)[0] for name, _ in step_columns.BUCKET_COLUMNS[6:]}
    assert metrics == set(step_columns.SERIES_METRICS) <= set(STEP_FIELDS)


def test_the_writer_and_the_readers_take_their_lists_from_the_one_place() -> None:
    assert store.STEP_COLUMNS is STEP_COLUMNS and store.STEP_FIELDS is STEP_FIELDS
    assert f"({', '.join(STEP_FIELDS)})" in store.MOVE_STAGE
    assert all(f"{n} {t}" in store.CREATE_STAGE for n, t in STEP_COLUMNS)
    assert f"({', '.join(n for n, _ in step_columns.BUCKET_COLUMNS)})" in store.ADD_TO_BUCKETS
    # a job's page of steps: every stored column but the two the query itself filters on
    read = [c.strip() for c in readmodel._STEP_FIELDS.split(",")]
    assert read == [f for f in STEP_FIELDS if f not in ("event_id", "job_id")]


def test_every_bucket_width_is_a_multiple_of_the_finest_the_writer_groups_by_first() -> None:
    assert min(step_columns.BUCKET_WIDTHS) == store.FINEST
    assert all(w % store.FINEST == 0 for w in step_columns.BUCKET_WIDTHS)


def test_a_shown_width_is_served_by_at_most_two_stored_rows_a_point() -> None:
    widest = step_columns.BUCKET_WIDTHS[-1]
    for wanted in [*range(1, 5000), *range(5000, 600_000, 997)]:
        shown = readmodel.shown_width(wanted)
        assert wanted <= shown <= 2 * wanted, wanted  # at most the points asked for, at least half
        stored = readmodel._stored_width(shown)
        if shown <= 2:
            assert stored is None  # from the raw rows: at most 2 a point
        elif shown <= 2 * widest:
            assert stored is not None and shown // stored <= 2, wanted
        else:
            assert stored == widest  # past the widest: a multiple of it


def test_bucket_widths_nest() -> None:
    widths = step_columns.BUCKET_WIDTHS
    assert all(b % a == 0 for a, b in itertools.pairwise(widths))
    sql = next(m.sql for m in load_migrations() if "CREATE TABLE telemetry_step_buckets" in m.sql)
    backfilled = re.search(r"unnest\(ARRAY\[([\d, ]+)\]\)", sql)
    assert backfilled and tuple(int(w) for w in backfilled.group(1).split(",")) == widths
