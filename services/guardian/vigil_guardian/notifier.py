"""Webhooks: every incident POSTed as JSON to each configured URL, with retries and back-off.

The guardian only ever calls `notify`, which never waits: each URL has a bounded queue and its
own task, so a slow or dead webhook delays nothing but its own deliveries. When a queue is full
the incident is dropped for that URL, counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from vigil.events import IncidentRaised
from vigil_common.waiting import STOPPED, unless_stopped, wait_any

log = logging.getLogger(__name__)


class Notifier:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        queue_size: int = 1000,
        attempts: int = 5,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.urls = list(urls)
        self.queues: dict[str, asyncio.Queue[IncidentRaised]] = {
            u: asyncio.Queue(queue_size) for u in self.urls
        }
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.delivered = 0
        self.failed = 0
        self.dropped = 0

    def notify(self, incident: IncidentRaised) -> None:
        """Queue an incident for every URL; never blocks."""
        for url, queue in self.queues.items():
            try:
                queue.put_nowait(incident)
            except asyncio.QueueFull:
                self.dropped += 1
                log.warning(
                    "webhook %s is behind: incident %s dropped (%d dropped so far)",
                    url,
                    incident.event_id,
                    self.dropped,
                )

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until `stop` is set (what is still queued then is given up, and logged)."""
        if not self.urls:
            return
        async with httpx.AsyncClient(timeout=self.timeout_s) as client, asyncio.TaskGroup() as tasks:
            for url in self.urls:
                tasks.create_task(self._deliver(client, url, stop))

    async def _deliver(self, client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> None:
        queue = self.queues[url]
        while not stop.is_set():
            incident = await unless_stopped(queue.get(), stop)
            if incident is STOPPED:
                break
            await self._post(client, url, incident, stop)
        if queue.qsize():
            log.warning("webhook %s: %d incidents not delivered at shutdown", url, queue.qsize())

    async def _post(
        self, client: httpx.AsyncClient, url: str, incident: IncidentRaised, stop: asyncio.Event
    ) -> None:
        body = incident.model_dump_json()
        headers = {"Content-Type": "application/json", "Idempotency-Key": incident.event_id}
        for attempt in range(1, self.attempts + 1):
            try:
                response = await unless_stopped(client.post(url, content=body, headers=headers), stop)
                if response is STOPPED:
                    break  # stopping: a slow hook does not hold up the shutdown
                if response.status_code < 300:
                    self.delivered += 1
                    return
                if response.status_code < 500 and response.status_code != 429:
                    log.error(
                        "webhook %s refused incident %s: HTTP %d",
                        url,
                        incident.event_id,
                        response.status_code,
                    )
                    self.failed += 1
                    return
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt == self.attempts:
                break
            delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
            log.warning("webhook %s: %s; retry %d in %.1fs", url, problem, attempt, delay)
            if await wait_any(stop, timeout_s=delay):  # back-off, cut short by stop
                break
        self.failed += 1
        log.error(
            "webhook %s: incident %s not delivered after %d attempts", url, incident.event_id, self.attempts
        )
