"""The rank link's frames: what a rank reports reaches the agent as it was measured."""

from __future__ import annotations

import math

import pytest

from vigil import events as ev
from vigil import protocol as proto
from vigil_worker.relay import EventRefused, decode_rank_frame


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf, 2.5])
def test_a_non_finite_loss_crosses_the_link_as_itself(loss: float) -> None:
    step = ev.StepCompleted(
        job_id="j", attempt=1, rank=1, node="n", step=7, loss=loss, grad_norm=math.nan, lr=1e-3,
        tokens=8, tokens_per_s=1.0, step_time_s=0.1, local_finite=False,
    )  # fmt: skip
    frame = decode_rank_frame(proto.encode_frame(proto.Publish(id=1, event=step)))
    assert isinstance(frame, proto.Publish)
    got = frame.event
    assert isinstance(got, ev.StepCompleted)
    assert (math.isnan(got.loss) and math.isnan(loss)) or got.loss == loss
    assert math.isnan(got.grad_norm)


def test_a_bad_frame_names_the_field() -> None:
    with pytest.raises(Exception, match=r"publish\.id"):
        decode_rank_frame(b'{"frame": "publish", "id": 0, "event": {}}\n')


def test_an_older_sdks_step_crosses_the_link_as_the_current_version() -> None:
    """A training image with an older SDK sends StepCompleted v2: read as v3, its generation 0."""
    from tests.unit.common.samples import SAMPLES

    old = SAMPLES[ev.StepCompletedV2]
    line = b'{"frame": "publish", "id": 3, "event": ' + old.to_bytes() + b"}\n"
    frame = decode_rank_frame(line)
    assert isinstance(frame, proto.Publish) and isinstance(frame.event, ev.StepCompleted)
    assert (
        frame.event.generation == 0 and frame.event.loss == old.loss and frame.event.event_id == old.event_id
    )
    bad = line.replace(b'"rank":1', b'"rank":-1')
    assert bad != line
    with pytest.raises(EventRefused, match="rank"):
        decode_rank_frame(bad)


def test_rank_frames_name_what_is_wrong():
    from vigil.errors import MalformedMessage

    with pytest.raises(MalformedMessage, match="token"):
        decode_rank_frame(b'{"frame": "hello", "job_id": "j", "attempt": 1, "rank": 0, "token": "short"}')
    with pytest.raises(MalformedMessage, match="exceeds"):
        decode_rank_frame(b"x" * (proto.MAX_FRAME_BYTES + 1))
