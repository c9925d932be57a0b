"""Safe retries of a submit: the `Idempotency-Key` header.

A key is the caller's (`actor`), kept for a day (`KEEP`). The first submit with a key claims it for the
job it is making, in the same transaction; a retry with the same key and the same body gets that job
back (200, not 201), with another body a 409 naming the header. Two submits racing with one key are
serialised by the key's primary key: the second waits for the first to commit, then reads its job.
"""

from __future__ import annotations

import hashlib
import re

import asyncpg

from vigil.errors import Conflict, SpecError

HEADER = "Idempotency-Key"
KEEP = "1 day"
_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no space


def checked(value: str | None) -> str | None:
    """The header's value, or None when absent; SpecError naming the header when it is not a key."""
    if value is None:
        return None
    if not _KEY.match(value):
        raise SpecError([{"field": HEADER, "message": f"{HEADER} must be 1-255 printable ASCII characters"}])
    return value


def body_digest(body: bytes, content_type: str | None) -> str:
    return hashlib.sha256((content_type or "").encode() + b"\0" + body).hexdigest()


async def claim(conn: asyncpg.Connection, actor: str, key: str, digest: str, job_id: str) -> str | None:
    """None when `key` is now `job_id`'s (the caller makes that job in this transaction); otherwise the
    job an earlier submit with the key made. Conflict when that submit's body was another."""
    claimed = await conn.fetchval(
        f"""INSERT INTO idempotency_keys (actor, key, body_sha256, job_id) VALUES ($1, $2, $3, $4)
            ON CONFLICT (actor, key) DO UPDATE
                SET body_sha256 = EXCLUDED.body_sha256, job_id = EXCLUDED.job_id, created_at = now()
                WHERE idempotency_keys.created_at < now() - interval '{KEEP}'
            RETURNING job_id""",
        actor,
        key,
        digest,
        job_id,
    )
    if claimed is not None:
        return None
    earlier = await conn.fetchrow(
        "SELECT job_id, body_sha256 FROM idempotency_keys WHERE actor = $1 AND key = $2", actor, key
    )
    if earlier["body_sha256"] != digest:
        raise Conflict(f"{HEADER} {key!r} was used for another body (job {earlier['job_id']}): use a new key")
    return str(earlier["job_id"])


async def forget_expired(conn: asyncpg.Connection) -> None:
    await conn.execute(f"DELETE FROM idempotency_keys WHERE created_at < now() - interval '{KEEP}'")
