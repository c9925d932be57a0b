"""The relay's side for rank pods: the same links as `relay.Relay`'s, over TCP on the worker's pod IP.

A rank pod has no token in its spec or environment (anyone with pods/get in its namespace reads both).
Its link is admitted by where it comes from instead: the relay takes a connection only from the IP the
API server gives a live rank pod of this node (`PodRankTable.pod_ip`; a pod cannot choose its IP, and a
TCP handshake cannot be completed from a forged source address), and a hello only for a running rank of
the attempt whose pod has that IP. On a rank's first link the relay mints its token and hands it over in
the `Welcome`; from then on a hello for that rank must also present the token, so within the pod a rank
cannot take over another rank's link (and a token seen on the wire is useless from any other address).
A restarted worker keeps the tokens (the table's file, 0600).

Bounded: at most MAX_LINKS connections at once, a connection from any other address is closed before a
byte is read, the hello must come within HELLO_TIMEOUT_S, every frame is at most MAX_FRAME_BYTES.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from pathlib import Path

from vigil import protocol as proto
from vigil.errors import MalformedMessage
from vigil_common.bus import Bus
from vigil_worker.pod_table import PodRankTable
from vigil_worker.relay import Relay, decode_rank_frame

log = logging.getLogger("vigil.worker")

MAX_LINKS = 512
HELLO_TIMEOUT_S = 10.0


class PodRelay(Relay):
    def __init__(
        self, bus: Bus, node: str, host: str, port: int, checkpoint_root: Path, table: PodRankTable
    ) -> None:
        super().__init__(bus, node, Path(f"tcp-{host}-{port}"), checkpoint_root, table.find)
        self.host, self.port, self.table = host, port, table
        self.links = 0
        self.turned_away = 0  # connections closed unread (unknown address, or too many)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    async def start(self) -> PodRelay:
        self._server = await asyncio.start_server(
            self._admit, host=self.host, port=self.port, limit=proto.MAX_FRAME_BYTES + 1
        )
        if self.port == 0:  # tests: the port the system chose
            self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer(writer)
        if self.links >= MAX_LINKS or peer not in self.table.pod_ips():
            self.turned_away += 1
            log.warning("relay: turned away a connection from %s (%d links open)", peer, self.links)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        self.links += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.links -= 1

    async def _welcome(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[proto.Hello, proto.Welcome] | None:
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
        except TimeoutError as exc:
            raise MalformedMessage(f"no hello within {HELLO_TIMEOUT_S:.0f}s") from exc
        frame = decode_rank_frame(line)
        if not isinstance(frame, proto.Hello):
            raise MalformedMessage(f"the first frame must be a hello, not {frame.frame!r}")
        record = self.find(frame.job_id, frame.attempt, frame.rank)
        peer = _peer(writer)
        minted = None
        if record is None or peer is None or self.table.pod_ip(frame.job_id, frame.attempt) != peer:
            why = "no running rank with that identity in the pod at this address"
        elif record.token and not hmac.compare_digest(record.token.encode(), frame.token.encode()):
            why = "not this rank's token"
        else:
            why = None
            if not record.token:  # its first link: the token its later hellos present
                record.token = minted = secrets.token_urlsafe(32)
                self.table.save()
        if why is not None:
            log.warning("refused a link from %s claiming to be rank %d of %s: %s", peer, frame.rank,
                        frame.job_id, why)  # fmt: skip
            writer.write(proto.encode_frame(proto.Refused(reason=why)))
            await writer.drain()
            return None
        return frame, proto.Welcome(node=self.node, token=minted)


def _peer(writer: asyncio.StreamWriter) -> str | None:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if peer else None
