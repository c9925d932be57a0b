"""What a rank reports is bounded field by field, and each refusal names the field."""

from __future__ import annotations

import json

import pytest

from tests.unit.common.samples import SAMPLES
from vigil import events as ev
from vigil import protocol as proto
from vigil.errors import MalformedMessage
from vigil_worker.relay import EventRefused, decode_rank_frame

REPLAYED = SAMPLES[ev.StepReplayed]
STEP = SAMPLES[ev.StepCompleted]


def decoded(event: ev.Message, **changes: object) -> ev.Message:
    raw = json.loads(event.to_bytes()) | changes
    return ev.decode(json.dumps(raw).encode())


@pytest.mark.parametrize(
    ("event", "changes", "field"),
    [
        (REPLAYED, {"culprits": [1, 1]}, "culprits"),
        (REPLAYED, {"culprits": list(range(ev.MAX_CULPRITS + 1))}, "culprits"),
        (REPLAYED, {"culprits": [ev.MAX_RANKS]}, "culprits.0"),
        (REPLAYED, {"evidence": {"x": "y" * ev.MAX_EVIDENCE_BYTES}}, "evidence"),
        (REPLAYED, {"step": 2**63}, "step"),
        (REPLAYED, {"skip_data": [0, 2**63]}, "skip_data.1"),
        (
            REPLAYED,
            {"values": [{"rank": 1, "first": 1.0, "replay": 1.0}, {"rank": 1, "first": 1.0, "replay": 1.0}]},
            "values",
        ),
        (STEP, {"step": 2**63}, "step"),
        (STEP, {"data_position": -1}, "data_position"),
        (STEP, {"tokens": 2**63}, "tokens"),
        (STEP, {"node": "n" * 257}, "node"),
        (STEP, {"node": "n\x001"}, "node"),
        (STEP, {"attempt": 2**31}, "attempt"),
        (STEP, {"micro_batch": 2**31}, "micro_batch"),
        (SAMPLES[ev.CheckpointSaved], {"path": "/c/" + "x" * 5000}, "path"),
        (SAMPLES[ev.OutOfMemoryHalted], {"message": "m" * 5000}, "message"),
        (SAMPLES[ev.RankExited], {"log_tail": "t" * 20_000}, "log_tail"),
    ],
)
def test_a_field_out_of_bounds_is_refused_by_name(event: ev.Message, changes: dict, field: str) -> None:
    with pytest.raises(MalformedMessage, match=rf"\b{field.split('.')[0]}\b"):
        decoded(event, **changes)


def test_steps_past_2_31_and_up_to_2_63_are_valid() -> None:
    for k in (2**31, 2**62, 2**63 - 1):
        assert decoded(STEP, step=k, data_position=k).step == k


def test_a_publish_frame_with_an_event_out_of_bounds_is_answered_not_fatal() -> None:
    frame = json.loads(proto.Publish(id=7, event=REPLAYED).model_dump_json())
    frame["event"]["culprits"] = list(range(5000))
    with pytest.raises(EventRefused) as refused:
        decode_rank_frame(json.dumps(frame).encode())
    assert refused.value.id == 7 and refused.value.field == "culprits"
    assert refused.value.report == "ranks.step_replayed"
    assert "at most 1024 items" in refused.value.reason


def test_a_frame_over_the_rank_bound_is_malformed() -> None:
    with pytest.raises(MalformedMessage, match="exceeds"):
        decode_rank_frame(b'{"frame": "bye", "x": "' + b"y" * proto.MAX_RANK_FRAME_BYTES + b'"}\n')
