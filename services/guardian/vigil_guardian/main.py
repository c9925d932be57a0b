"""The guardian service: judges every job's launch, status and step events, and every GPU sample.

Lifecycle: connect; hear the GPU samples; hold shares, each: restore (saved state, then a quiet re-feed of
each active job's steps that its input has acknowledged) and consume its input, with a hang check on a
timer, until given up; the webhook notifier; drain and close on `stop`.

What each part is: a share's input, how it is taken up and its judging (`service.GuardianService`), the
shares (`shares`), the detectors (`core`, `watch`, `policy`), the saved state (`store`).
"""

from __future__ import annotations

import asyncio
import logging

from vigil.events import (
    GpuSampled,
    Message,
)
from vigil_common import credentials, subjects
from vigil_common.bus import Bus
from vigil_common.lease import instance
from vigil_common.service import connect as service_connect
from vigil_common.settings import Settings
from vigil_guardian import store
from vigil_guardian.core import Guardian
from vigil_guardian.devices import Devices
from vigil_guardian.notifier import Notifier
from vigil_guardian.service import GuardianService
from vigil_guardian.shares import Shares, route

log = logging.getLogger(__name__)


async def run(settings: Settings, stop: asyncio.Event) -> None:
    """Connect; hear the GPU samples; judge the shares this guardian holds (`Shares`) until `stop`;
    drain and close."""
    async with service_connect(settings, "guardian") as conn:
        bus, pool = conn.bus, conn.pool
        notifier = Notifier(settings.webhook_urls)
        judging: dict[int, tuple[GuardianService, asyncio.Event]] = {}
        devices = Devices()  # every device's health, judged once for all the shares held

        async def judge_share(share: int, until: asyncio.Event) -> None:
            core = Guardian(idle_devices=share == 0, devices=devices)
            service = GuardianService(core, bus, pool, notifier, share=share, stacks_s=settings.hang_stacks_s)
            # its epoch, holding the share's lock and before loading the share's state
            service.fence = await store.take_epoch(pool, share, instance())
            judging[share] = (service, until)
            try:
                await service.run_share(settings.guardian_replay_s, until)
            except* store.Fenced as fenced:
                # Another guardian took the share (this one's lock lapsed: paused, cut off): it judges
                # no more, and waits for its lease to notice and give the share up.
                log.error("guardian: %s; judging it no more", fenced.exceptions[0])
                until.set()
            finally:
                judging.pop(share, None)

        async def on_gpu(batch: list[Message]) -> None:
            held = dict(judging)
            handed = route(devices, [e for e in batch if isinstance(e, GpuSampled)], held)
            for share, (service, until) in held.items():
                try:
                    await service.on_device_verdicts(handed.get(share, []), until)
                except store.Fenced as exc:
                    log.error("guardian: %s; judging it no more", exc)
                    until.set()
                except Exception as exc:  # a share being given up, Postgres away: the next samples come
                    log.warning("guardian: share %d: GPU samples not judged: %s", service.share, exc)

        await _drop_legacy_consumers(bus)
        hearing = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(bus.listen(subjects.ALL_GPU, on_gpu, stop, hearing=hearing))
            await hearing.wait()  # a share's consumer existing says its guardian hears the samples
            tasks.create_task(
                Shares(settings.database_url or "", settings.takeover_s).hold(judge_share, stop)
            )
            tasks.create_task(notifier.run(stop))
        log.info(
            "guardian stopped (webhooks: %d delivered, %d failed, %d dropped)",
            notifier.delivered,
            notifier.failed,
            notifier.dropped,
        )


async def _drop_legacy_consumers(bus: Bus) -> None:
    """Delete the consumers of the guardian before shares (one input for all jobs, one for GPU samples):
    left alone, the server would keep VIGIL_JOBS's messages pending for them."""
    for stream, name in credentials.LEGACY_GUARDIAN:
        if await bus.delete_consumer(stream, name):
            log.info("guardian: deleted the consumer %s of %s (before shares)", name, stream)
