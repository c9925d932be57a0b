"""The delivery loop: posts the outbox's due rows (`outbox`) and records each attempt on its row (the
route's delivery log): delivered; or retried after a back-off that doubles (VIGIL_ALERT_BACKOFF_S, up to
VIGIL_ALERT_MAX_BACKOFF_S); or failed, after VIGIL_ALERT_ATTEMPTS or at once when the receiver refuses
it (a 4xx other than 408 and 429).

A row is claimed with FOR UPDATE SKIP LOCKED and leased (its `next_at` moved past the post's timeout), so
telemetry replicas share the rows and a replica that dies mid-post leaves its row to be posted again
when the lease ends: a receiver may see a delivery twice (the `Idempotency-Key` header is the same),
never none."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import asyncpg
import httpx

from vigil.alerts import SIGNATURE_HEADER, sign
from vigil_common.settings import Settings
from vigil_common.waiting import wait_any

log = logging.getLogger(__name__)

BATCH = 32  # rows posted at once
IDLE_S = 2.0  # the longest wait between looks at the outbox (other replicas' rows, a lost wake-up)
_ERROR_CHARS = 1000

_CLAIM = """
WITH due AS (
    SELECT id FROM alert_deliveries WHERE status = 'pending' AND next_at <= now()
    ORDER BY next_at LIMIT $1 FOR UPDATE SKIP LOCKED)
UPDATE alert_deliveries d
   SET attempts = d.attempts + 1, next_at = now() + make_interval(secs => $2), updated_at = now()
  FROM due, alert_routes r
 WHERE d.id = due.id AND r.id = d.route_id
RETURNING d.id, d.url, d.body, d.attempts, d.incident_id, d.phase, r.format, r.secret"""


@dataclass(frozen=True, slots=True)
class Outcome:
    error: str | None = None  # None: delivered
    final: bool = False  # a refusal that another attempt cannot change


def backoff_s(attempts: int, first_s: float, max_s: float) -> float:
    """The wait after the `attempts`-th failed attempt."""
    return min(first_s * 2 ** (attempts - 1), max_s)


def classify(status: int) -> Outcome:
    if status < 300:
        return Outcome()
    final = 400 <= status < 500 and status not in (408, 429)
    return Outcome(error=f"HTTP {status}", final=final)


class Deliverer:
    """Posts due deliveries until stopped; `wake` (set after an enqueue) makes it look at once."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings
        self.wake = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=self.settings.alert_timeout_s, follow_redirects=False) as client:
            while not stop.is_set():
                self.wake.clear()
                try:
                    if await self._round(client):
                        continue
                    wait = await self._next_due_s()
                except (asyncpg.PostgresError, OSError) as exc:  # the database away: try again shortly
                    log.warning(
                        "alert deliveries: %s: %s; trying again in %.0fs", type(exc).__name__, exc, IDLE_S
                    )
                    wait = IDLE_S
                await wait_any(stop, self.wake, timeout_s=wait)

    async def _round(self, client: httpx.AsyncClient) -> int:
        """Claim and post one batch of due rows; how many there were."""
        lease_s = self.settings.alert_timeout_s + 5.0
        rows = await self.pool.fetch(_CLAIM, BATCH, lease_s)
        if rows:
            await asyncio.gather(*(self._deliver(client, r) for r in rows))
        return len(rows)

    async def _next_due_s(self) -> float:
        due = await self.pool.fetchval(
            "SELECT extract(epoch FROM min(next_at) - now()) FROM alert_deliveries WHERE status = 'pending'"
        )
        return IDLE_S if due is None else min(max(float(due), 0.0), IDLE_S)

    async def _deliver(self, client: httpx.AsyncClient, row: asyncpg.Record) -> None:
        outcome = await self._post(client, row)
        s = self.settings
        if outcome.error is None:
            await self.pool.execute(
                """UPDATE alert_deliveries SET status = 'delivered', delivered_at = now(), updated_at = now()
                   WHERE id = $1""",
                row["id"],
            )
            return
        final = outcome.final or row["attempts"] >= s.alert_attempts
        delay = backoff_s(row["attempts"], s.alert_backoff_s, s.alert_max_backoff_s)
        log.warning(
            "alert delivery %d (%s) attempt %d: %s%s",
            row["id"],
            row["url"],
            row["attempts"],
            outcome.error,
            "; given up" if final else f"; again in {delay:.1f}s",
        )
        await self.pool.execute(
            """UPDATE alert_deliveries
                  SET status = CASE WHEN $2 THEN 'failed' ELSE 'pending' END, last_error = $3,
                      next_at = now() + make_interval(secs => $4), updated_at = now()
                WHERE id = $1""",
            row["id"],
            final,
            outcome.error[:_ERROR_CHARS],
            delay,
        )

    async def _post(self, client: httpx.AsyncClient, row: asyncpg.Record) -> Outcome:
        content = row["body"].encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "vigil-alerts",
            "Idempotency-Key": f"{row['incident_id']}-{row['phase']}",
        }
        if row["format"] == "json" and row["secret"]:
            headers[SIGNATURE_HEADER] = sign(row["secret"], content)
        try:
            response = await client.post(row["url"], content=content, headers=headers)
        except httpx.HTTPError as exc:  # refused, timed out, reset: worth another attempt
            return Outcome(error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        except (httpx.InvalidURL, ValueError) as exc:  # a URL the client cannot use: never will
            return Outcome(error=f"{type(exc).__name__}: {exc}", final=True)
        return classify(response.status_code)
