"""Who sees which job, as SQL, in one place: an admin every job; anyone else the jobs they own and those of
their team. Every query that filters by the viewer (the gateway's jobs, incidents and audit pages, the
console) takes its condition from here."""

from __future__ import annotations


def sees(n: int) -> str:
    """The condition on a row of `jobs` (its `owner` and `team`) that the viewer sees it: `$n` the viewer's
    name (NULL: an admin, who sees every job), `$n+1` their team (NULL: none; a job of no team is its
    owner's alone)."""
    return f"(${n}::text IS NULL OR owner = ${n} OR (team IS NOT NULL AND team = ${n + 1}::text))"


def sees_job_of(n: int, column: str = "job_id") -> str:
    """The condition on a row whose `column` names a job that the viewer (`$n`, `$n+1` as in `sees`) sees."""
    return f"(${n}::text IS NULL OR {column} IN (SELECT id FROM jobs WHERE {sees(n)}))"
