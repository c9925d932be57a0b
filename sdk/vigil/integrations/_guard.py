"""What the framework callbacks share: this rank's loss over one optimizer step, kept on its device until
the step boundary's one sync; the finiteness verdict that goes into the boundary; and how a non-finite
update is skipped (a torch optimizer leaves alone a parameter without a gradient)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class StepLoss:
    """This rank's losses and tokens since the last optimizer step (no sync: tensors stay where they are)."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self.count = 0
        self.tokens = 0

    def add(self, loss: torch.Tensor, tokens: int = 0) -> None:
        loss = loss.detach().float().reshape(())
        self._sum = loss if self._sum is None else self._sum + loss
        self.count += 1
        self.tokens += tokens

    def peek(self) -> torch.Tensor | None:
        """The sum so far (None: no loss yet), kept."""
        return self._sum

    def take(self) -> tuple[torch.Tensor | None, int, int]:
        """(sum of the losses or None, how many, tokens), and start over."""
        got = (self._sum, self.count, self.tokens)
        self._sum, self.count, self.tokens = None, 0, 0
        return got


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The 2-norm of the gradients these parameters hold (None when none holds one), on their device."""
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def verdict(loss: torch.Tensor | None, norm: torch.Tensor | None) -> torch.Tensor | bool:
    """This rank's 'is the step finite' for `Run.agree`: a 0-d tensor on the loss's device (no sync)."""
    import torch

    flag: torch.Tensor | None = None
    for value in (loss, norm):
        if value is None:
            continue
        ok = torch.isfinite(value).float()
        flag = ok if flag is None else flag * ok.to(flag.device)
    return True if flag is None else flag


def drop_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Make the coming optimizer step a no-op: torch's optimizers skip a parameter whose grad is None
    (no moment update, no weight decay)."""
    for p in params:
        p.grad = None
