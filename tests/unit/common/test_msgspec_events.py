"""The msgspec decoder of StepCompleted agrees with pydantic: it is derived from the model (one definition
of the fields), accepts only what pydantic accepts, with the same values, and leaves the rest (an older
version, a wrong field) to pydantic, which names the field."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.common.samples import SAMPLES
from vigil import events as ev
from vigil.errors import MalformedMessage
from vigil_common import subjects
from vigil_common.bus.decoding import decode_message, fast_decoder
from vigil_common.bus.streams import Stored
from vigil_common.msgspec_events import struct_of

STEP = SAMPLES[ev.StepCompleted]
DECODER = fast_decoder(ev.StepCompleted)


def payload(**changes: Any) -> bytes:
    raw = json.loads(STEP.to_bytes())
    for name, value in changes.items():
        if value is _MISSING:
            raw.pop(name, None)
        else:
            raw[name] = value
    return json.dumps(raw).encode()


_MISSING = object()


def test_the_struct_has_the_models_fields_defaults_and_required_ones() -> None:
    struct = struct_of(ev.StepCompleted)
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    assert list(fields) == list(ev.StepCompleted.model_fields)
    required = {n for n, f in fields.items() if f.required}
    assert required == {n for n, f in ev.StepCompleted.model_fields.items() if f.is_required()}
    for name, info in ev.StepCompleted.model_fields.items():
        if not info.is_required() and info.default_factory is None:
            assert fields[name].default == info.default, name


def test_a_step_decodes_to_the_same_event_pydantic_gives() -> None:
    fast = DECODER.decode(STEP.to_bytes())
    assert isinstance(fast, ev.StepCompleted)
    assert fast == STEP
    assert fast.to_bytes() == STEP.to_bytes()
    with pytest.raises(pydantic.ValidationError):  # built frozen, as validated ones are
        fast.loss = 1.0  # type: ignore[misc]
    # built as model_construct builds (pydantic's names, which `built` sets itself, exist and agree)
    constructed = ev.StepCompleted.model_construct(**STEP.__dict__)
    assert fast.__getstate__() == constructed.__getstate__()
    assert fast.model_fields_set == constructed.model_fields_set


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_as_the_events_write_them(value: float) -> None:
    data = ev.StepCompleted(**{**STEP.__dict__, "loss": value, "grad_norm": value}).to_bytes()
    fast = DECODER.decode(data)
    assert fast is not None
    assert fast.to_bytes() == data
    assert math.isnan(fast.loss) if math.isnan(value) else fast.loss == value


@pytest.mark.parametrize(
    "changes",
    [
        {"schema_version": 2},  # an older version: pydantic upgrades it
        {"job_id": "j1\n"},  # Python's `$` would let the newline through; pydantic's regex does not
        {"node": "n\x00"},
        {"rank": ev.MAX_RANKS},
        {"step": -1},
        {"tokens": 2**63},
        {"mfu": -0.5},
        {"mfu": "NaN"},  # bounded: not finite is out of bounds (pydantic decides)
        {"surprise": 1},
        {"local_finite": _MISSING},
        {"occurred_at": "2026-01-02T03:04:05"},  # naive
        {
            "occurred_at": "2026-01-02T03:04:05.1234567Z"
        },  # msgspec would round the 7th digit, pydantic cuts it
        {"occurred_at": "2026-01-02 03:04:05Z"},
        {"occurred_at": "2026-13-02T03:04:05Z"},
        {"loss": "1.5"},  # pydantic's lax mode takes it; the fast path leaves it to pydantic
        {"rank": 1.0},
    ],
)
def test_what_the_fast_path_refuses_is_left_to_pydantic(changes: dict[str, Any]) -> None:
    assert DECODER.decode(payload(**changes)) is None


def test_a_bad_field_is_still_named_through_the_bus_decoder() -> None:
    subject = subjects.step(STEP.job_id or "", "n1")
    bad = Stored(stream=subjects.JOBS.name, seq=1, subject=subject, data=payload(rank=-3))
    with pytest.raises(MalformedMessage, match="rank"):
        decode_message(bad)
    good = Stored(stream=subjects.JOBS.name, seq=2, subject=subject, data=STEP.to_bytes())
    assert decode_message(good) == STEP
    v1 = SAMPLES[ev.StepCompletedV1]
    old = Stored(stream=subjects.JOBS.name, seq=3, subject=subject, data=v1.to_bytes())
    assert decode_message(old) == v1.upgraded()


def test_a_model_the_struct_could_not_follow_is_refused() -> None:
    with pytest.raises(TypeError, match="validators"):
        struct_of(ev.StepReplayed)
    with pytest.raises(TypeError, match="throttle_reasons"):
        struct_of(ev.GpuSampled)

    class Strict(ev.Message):
        type: str = "x"
        schema_version: int = 1
        n: int = pydantic.Field(0, multiple_of=2)

    with pytest.raises(TypeError, match=r"Strict\.n"):
        struct_of(Strict)


# --- generated messages: whatever the fast path accepts, pydantic accepts, with the same values ---------

_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, ev.MAX_RANKS, 10**30]),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1.5, 1e308, 5e-324, 3.0]),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "nan", "inf", "1.5", "", "x", "x\n", "\x00", "true"]),
    st.text(max_size=8),
    st.sampled_from(
        [
            "2026-01-02T03:04:05Z",
            "2026-01-02T03:04:05.123456+02:00",
            "2026-01-02T03:04:05.1234567Z",
            "2026-01-02 03:04:05Z",
            "2026-01-02T03:04:05",
            "2026-01-02",
            "2026-01-02T03:04:05z",
            "2026-01-02T24:00:00Z",
        ]
    ),
    st.just([1]),
    st.just({"a": 1}),
)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    raw: dict[str, Any] = json.loads(STEP.to_bytes())
    for name in draw(st.lists(st.sampled_from(sorted(raw)), max_size=4, unique=True)):
        choice = draw(st.integers(0, 9))
        if choice == 0:
            raw.pop(name)
        else:
            raw[name] = draw(_ANY)
    if draw(st.integers(0, 19)) == 0:
        raw["extra"] = 1
    return json.dumps(raw).encode()


def test_the_fast_path_accepts_only_what_pydantic_accepts_with_the_same_values() -> None:
    accepted: list[bytes] = []

    @settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(messages())
    def check(data: bytes) -> None:
        fast = DECODER.decode(data)
        if fast is None:
            return
        accepted.append(data)
        slow = ev.StepCompleted.model_validate_json(data)  # raises if pydantic would have refused it
        if "event_id" not in json.loads(data) or "occurred_at" not in json.loads(data):
            return  # a default factory: a fresh id or time on each side
        assert fast.to_bytes() == slow.to_bytes()
        assert fast.occurred_at == slow.occurred_at
        assert fast.occurred_at.utcoffset() == slow.occurred_at.utcoffset()

    check()
    # the same test, whatever the order or selection: the generated messages tried the fast path
    assert len(accepted) > 100, len(accepted)
