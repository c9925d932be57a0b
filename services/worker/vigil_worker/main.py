"""The worker service, one per node: `run(settings, stop)` is its lifecycle.

Connect to NATS, find ranks a previous run of this worker started (report the truth about each), open
the relay (the ranks' Unix socket: their only way to the bus), then in a TaskGroup: durable consumers
of launches and commands, and once they exist, heartbeats, device samples, the rank monitor and the
preemption watch. On stop the consumers drain and the bus closes; running ranks are left running, so a
restarted worker picks them up again (unless VIGIL_WORKER_END_RANKS_ON_STOP, as under `vigil up`). A
preemption notice (SIGTERM with VIGIL_PREEMPT_ON_SIGTERM, or VIGIL_PREEMPTION_NOTICE_FILE appearing)
first has the ranks checkpoint and exit, then stops the worker. What the worker does is
`agent.Worker`'s; how a launch becomes processes, `launch`'s; the ranks' link, `relay`'s.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack

from vigil_common import subjects
from vigil_common.addresses import advertised_address
from vigil_common.bus import Bus
from vigil_common.service import require_urls
from vigil_common.settings import Settings
from vigil_worker import workdirs
from vigil_worker.agent import Worker
from vigil_worker.consumers import consumers, consumers_ready
from vigil_worker.inventory import Inventory
from vigil_worker.job_preemption import Commands
from vigil_worker.runtime import choose_runtime
from vigil_worker.warm import WarmRanks

log = logging.getLogger("vigil.worker")


async def run(settings: Settings, stop: asyncio.Event) -> None:
    require_urls(settings, "worker", database=False)
    assert settings.nats_url
    # where the other nodes' ranks reach this one's: the rendezvous address and gloo's interface
    address = advertised_address(settings.node_address, settings.nats_url)
    settings = settings.model_copy(update={"node_address": address})
    inventory = Inventory.discover(settings.cpu_slots, settings.node_name, settings.gpu_backend)
    async with AsyncExitStack() as stack:
        # --- connect --------------------------------------------------------------------------------------
        bus = await Bus.connect(
            settings.nats_url,
            name=f"worker-{settings.node_name}",
            tls_ca=settings.nats_tls_ca,
            connect_timeout_s=settings.connect_timeout_s,
        )
        stack.push_async_callback(bus.close)
        stack.callback(inventory.close)
        await bus.ensure_streams(
            manage=False, replicas=settings.stream_replicas
        )  # its NATS role may not change them

        # --- recover: the truth about ranks a previous run started; their links ---------------------------
        worker = Worker(settings, bus, inventory, choose_runtime(settings, bus, inventory.kind))
        await worker.recover()
        await worker.relay.start()  # ranks still running from a previous run reconnect here
        stack.push_async_callback(worker.relay.close)
        if settings.rank_runtime == "process":  # built-in trainer ranks kept warm for the next launches
            devices = [d.index for d in inventory.devices]
            running = worker.table.running  # a parked rank (waiting for its job's next attempt) is idle
            busy = lambda: sum(r.parked_at is None for r in running())  # noqa: E731
            worker.warm = await WarmRanks(settings, inventory.kind, devices, busy).start()
            stack.push_async_callback(worker.warm.close)
        kinds = {d.kind for d in inventory.devices}
        log.info(
            "worker %s: %d %s device(s)", settings.node_name, len(inventory.devices), "/".join(sorted(kinds))
        )

        # --- subscribe and run until stop (the consumers drain on the way out) ------------------------------
        launches, commands = consumers(settings.node_name)
        notice = asyncio.Event()
        if settings.preempt_on_sigterm:  # SIGTERM is the cloud's notice, not a plain stop (SIGINT still is)
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, notice.set)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bus.consume(launches, worker.on_launch, stop))
            # cancel is the agent's, a job's preemption `job_preemption`'s, the rest the ranks'
            tg.create_task(bus.consume(commands, Commands(worker).on_command, stop))
            answering = asyncio.Event()  # the scheduler's quick check that this node is still there
            tg.create_task(bus.answer_pings(subjects.ping(settings.node_name), stop, answering))
            # heartbeats make the scheduler place work here: only once the launch consumer exists, and the
            # ping is answered
            await consumers_ready(bus, (launches, commands))
            await answering.wait()
            tg.create_task(worker.heartbeat_loop(stop))
            tg.create_task(worker.sample_loop(stop))
            tg.create_task(worker.monitor_loop(stop))
            tg.create_task(worker.preemption_loop(notice, stop))
            if worker.pods is not None:  # Kubernetes: the rank pods' API calls
                tg.create_task(worker.pods.run(stop))

        # --- on the way out: ranks stay unless told otherwise; the bus closes with the stack ----------------
        if settings.worker_end_ranks_on_stop and (ranks := worker.table.running()):
            log.info("worker %s: ending %d rank(s) on the way out", settings.node_name, len(ranks))
            await worker.end_ranks(ranks)
        if not worker.table.running():
            worker.tenancy.close()  # this node's cgroup folders, now empty
            workdirs.release_all(settings)  # and the overlays of attempts that ended
        log.info(
            "worker %s stopped; %d rank(s) left running", settings.node_name, len(worker.table.running())
        )
