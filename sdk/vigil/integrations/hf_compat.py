"""What `vigil.integrations.hf` reads of the Hugging Face Trainer beyond its callback API, all here, each
name checked by tests/unit/sdk/test_integrations.py against the installed transformers.

A callback is handed the model (unwrapped), the optimizer and the arguments, not the Trainer. Two things
of the Trainer save the callback a pass over the gradients each: its DDP-wrapped model
(`Trainer.model_wrapped`, where the step boundary rides in DDP's all-reduce) and the gradients' norm it
computes every step through `Trainer.accelerator.clip_grad_norm_` (before clipping them, when
`max_grad_norm` is set), which it does not pass on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def calling_trainer() -> Any:
    """The Trainer whose callback is running: the nearest caller whose `self` is a `transformers.Trainer`
    (the Trainer calls its callbacks from its own methods); None where there is none."""
    from transformers import Trainer

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def wrapped_model(trainer: Any) -> Any:
    """The model as the Trainer trains it: DDP, a DeepSpeed engine, or the model itself."""
    return getattr(trainer, "model_wrapped", None)


def watch_grad_norm(trainer: Any, sink: Callable[[Any], None]) -> Callable[[], None]:
    """Hand `sink` every norm the Trainer's accelerator computes (`clip_grad_norm_`'s result, before
    clipping); returns the undo."""
    accelerator = trainer.accelerator
    clip, own = accelerator.clip_grad_norm_, "clip_grad_norm_" in vars(accelerator)

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        norm = clip(*args, **kwargs)
        sink(norm)
        return norm

    accelerator.clip_grad_norm_ = clip_grad_norm_

    def undo() -> None:
        if vars(accelerator).get("clip_grad_norm_") is not clip_grad_norm_:
            return
        if own:
            accelerator.clip_grad_norm_ = clip
        else:
            del accelerator.clip_grad_norm_  # the class's method again

    return undo
