"""Running a service: settings built once, a stop event set by SIGINT/SIGTERM, a clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from vigil_common.settings import Settings

ServiceMain = Callable[[Settings, asyncio.Event], Awaitable[None]]


def setup_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set `stop` (a second Ctrl-C still interrupts, via the default handler)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        logging.getLogger("vigil").info("%s received: stopping", sig.name)
        stop.set()
        loop.remove_signal_handler(sig)  # a second signal gets the default behaviour

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


def run_service(main: ServiceMain, settings: Settings) -> None:
    """Run `main(settings, stop)` until it returns; signals set `stop`."""
    setup_logging(settings)

    async def runner() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await main(settings, stop)

    asyncio.run(runner())
