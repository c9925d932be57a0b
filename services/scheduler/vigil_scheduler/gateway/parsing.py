"""Request bodies parsed off the event loop: a spec or a form of up to `VIGIL_MAX_BODY_BYTES` costs up
to a few hundred milliseconds of CPU, so it is parsed in a thread, a few at a time (`Deps.parsing`),
and a burst of large bodies cannot hold up heartbeats or /healthz."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from litestar import Request

T = TypeVar("T")


async def off_loop(request: Request[Any, Any, Any], parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    async with request.app.state.parsing:
        return await asyncio.to_thread(parse, *args, **kwargs)
