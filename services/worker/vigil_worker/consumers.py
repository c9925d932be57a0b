"""A worker's durable consumers on the bus: its launches and its commands, under the names its NATS user
owns (`vigil_common.credentials.worker_consumers`)."""

from __future__ import annotations

import asyncio
import time

from vigil.errors import RetryableError
from vigil_common import credentials, subjects
from vigil_common.bus import Bus, ConsumerSpec


def consumers(node: str) -> tuple[ConsumerSpec, ConsumerSpec]:
    """This node's durable consumers: launches, and commands (cancel is the agent's; the rest, the ranks')."""
    launches_name, commands_name = credentials.worker_consumers(node)  # the names its NATS user owns
    launches = ConsumerSpec(
        stream=subjects.JOBS,
        durable=launches_name,
        filter_subject=subjects.ALL_LAUNCHES,
        deliver_new=True,  # a new worker starts with new launches, not the stream's history
    )
    commands = ConsumerSpec(
        stream=subjects.COMMANDS,
        durable=commands_name,
        filter_subject=subjects.ALL_CMDS,
        deliver_new=True,
    )
    return launches, commands


async def consumers_ready(bus: Bus, specs: tuple[ConsumerSpec, ...], timeout_s: float = 30.0) -> None:
    """Return once every consumer in `specs` exists on the server; RetryableError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for spec in specs:
        while await bus.consumer_state(spec) is None:
            if time.monotonic() > deadline:
                raise RetryableError(f"consumer {spec.durable} not created within {timeout_s}s")
            await asyncio.sleep(0.05)  # polling the server for the consumer to exist
