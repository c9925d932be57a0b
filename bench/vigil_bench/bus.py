"""`vigil bench bus`: Vigil's bus client against raw nats-py, same server, same run.

Two workloads, each run through both clients, interleaved in rounds so drift on a busy
machine hits both alike:
- request/reply round trips on core NATS (latency p50/p99);
- JetStream publishes, each waiting for its ack (rate).
Vigil's side does everything a service does: pydantic encoding, `Nats-Msg-Id`, trace
headers, decoding the reply. The raw side sends pre-encoded bytes: a strict floor.
`value` is Vigil's total time for the workload, `floor` the raw client's; the ratio is
Vigil's cost over raw. Target: ratio <= 1.15.
"""

from __future__ import annotations

import statistics
import time
import uuid

import nats

from vigil import events as ev
from vigil_bench import measure_on_servers, percentile, request_reply, result
from vigil_common import subjects
from vigil_common.bus import Bus
from vigil_common.settings import Settings

ROUNDS = 5
RR_PER_ROUND = 400
PUB_PER_ROUND = 300


async def _measure(url: str) -> dict[str, object]:
    bus = await Bus.connect(url, "bench-bus")
    raw = await nats.connect(url, name="bench-raw")
    raw_js = raw.jetstream()
    await bus.ensure_streams()
    job = "bench-" + uuid.uuid4().hex[:8]
    probe = subjects.probe(f"{job}-vigil")
    raw_probe = subjects.probe(f"{job}-raw")
    pub_subject = subjects.cmd(job)
    template = ev.ResumeJob(job_id=job, attempt=1, reason="bench")
    payload = template.to_bytes()

    async def echo(message: ev.Message) -> ev.Message:
        return message

    async def raw_echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(msg.data)

    served = await request_reply.serve(bus, probe, echo)
    raw_served = await raw.subscribe(raw_probe, cb=raw_echo)

    vigil_rr: list[float] = []
    raw_rr: list[float] = []
    vigil_pub = raw_pub = 0.0
    for _ in range(ROUNDS):
        for _ in range(RR_PER_ROUND):
            t = time.perf_counter()
            await request_reply.request(bus, probe, template)
            vigil_rr.append(time.perf_counter() - t)
            t = time.perf_counter()
            await raw.request(raw_probe, payload, timeout=5)
            raw_rr.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(PUB_PER_ROUND):
            await bus.publish(pub_subject, template.model_copy(update={"event_id": uuid.uuid4().hex}))
        vigil_pub += time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(PUB_PER_ROUND):
            await raw_js.publish(pub_subject, payload, headers={"Nats-Msg-Id": uuid.uuid4().hex})
        raw_pub += time.perf_counter() - t

    await served.unsubscribe()
    await raw_served.unsubscribe()
    await bus.js.purge_stream(subjects.COMMANDS.name, subject=pub_subject)
    await raw.close()
    await bus.close()

    n_pub = ROUNDS * PUB_PER_ROUND
    vigil_total = sum(vigil_rr) + vigil_pub
    raw_total = sum(raw_rr) + raw_pub
    return result(
        "bus",
        value=vigil_total,
        floor=raw_total,
        unit="s for the workload",
        target="ratio <= 1.15",
        request_reply={
            "n": len(vigil_rr),
            "vigil_p50_us": round(statistics.median(vigil_rr) * 1e6, 1),
            "vigil_p99_us": round(percentile(vigil_rr, 0.99) * 1e6, 1),
            "raw_p50_us": round(statistics.median(raw_rr) * 1e6, 1),
            "raw_p99_us": round(percentile(raw_rr, 0.99) * 1e6, 1),
        },
        jetstream_publish={
            "n": n_pub,
            "vigil_per_s": round(n_pub / vigil_pub, 1),
            "raw_per_s": round(n_pub / raw_pub, 1),
        },
    )


async def run(settings: Settings) -> dict[str, object]:
    async def measure(s: Settings) -> dict[str, object]:
        assert s.nats_url
        return await _measure(s.nats_url)

    return await measure_on_servers(measure, settings, database=False)
