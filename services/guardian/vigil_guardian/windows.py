"""The numeric detectors, and their state for one timeline of a job: what a new step is judged against.

Per rank, the recent finite losses (the spike window) and its last step; per job, the steps not yet
reported by every rank, the series judged once per complete step (the cross-rank median loss for
divergence, the global gradient norm for its spikes), the run of imbalanced steps, and recent step
times (the hang detector's p99). Pure: no I/O.

A step's time, for the hang detector, is the longest wall time any rank took from its previous step to
this one: whatever runs between two steps (a checkpoint save, an evaluation, a held step's replay) is a
silence a healthy job makes, so it counts; a rank's first step (imports, rendezvous, warm-up) gives none.
One time per step, whatever the world size, so `hang_window` is a number of steps. A rank's first step of
a timeline (an attempt, or the re-run after a rollback) is no evidence of a slow rank either: its
measured time holds its start-up or its load, which one rank may take longer over than the others.

Which rank made a NaN. After the all-reduce every rank's gradient norm is NaN and every rank skips
the update, so a rank whose own loss was finite (`local_finite` True) is a witness, not a culprit:
its event is held until the whole step is in, and the incident names the rank whose own loss was not
finite (judged at once when its event comes). A sender that does not say (`local_finite` None, a
v1 event) or a job of one rank is judged from its own event, as before.

The detectors on the numbers of a step (non-finite values, loss and gradient-norm spikes, divergence)
are pure functions of a window of values, each returning a `Verdict` or None. A loss spike is judged
per rank (a bad batch is one rank's); the gradient norm is one global value per step (it is
all-reduced), and divergence is judged on the step's cross-rank median loss, which is steadier than
any one rank's and blind to a single rank's spike.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Sequence

from vigil.events import StepCompleted
from vigil.spec import GuardianSpec
from vigil.spike_rule import ABS_SCALE_FLOOR, MAD_TO_SIGMA, LossWindows, SpikeScore, spike_score
from vigil_guardian.collective import ImbalanceTracker, StragglerScores
from vigil_guardian.hang import p99
from vigil_guardian.verdict import Verdict

# The gradient norm wanders by 2-3x in healthy training; an explosion is this many times its median
# (and a robust outlier in log space, whose spread is floored at GRAD_LOG_SCALE_FLOOR).
GRAD_SPIKE_RATIO = 8.0
GRAD_LOG_SCALE_FLOOR = 0.1
# Divergence: the least-squares trend of log(loss) over the window must be this many standard
# errors above flat (as well as rising more than the tolerance across the window).
DIVERGENCE_T = 6.0
LONG_WINDOWS = 4  # the trend is also fitted over this many windows, which sees a slow rise sooner


def non_finite(event: StepCompleted) -> Verdict | None:
    """NaN or Inf in the loss or the gradient norm, or a step the rank skipped for non-finite grads."""
    bad = {
        name: value
        for name, value in (("loss", event.loss), ("grad_norm", event.grad_norm))
        if value is not None and not math.isfinite(value)
    }
    if not bad and not event.skipped:
        return None
    what = ", ".join(f"{k}={v}" for k, v in bad.items()) or "the update was skipped"
    return Verdict(
        kind="nan",
        step=event.step,
        rank=event.rank,
        node=event.node,
        message=f"non-finite values on rank {event.rank} at step {event.step}: {what}",
        evidence={
            "loss": _json_float(event.loss),
            "grad_norm": _json_float(event.grad_norm),
            "skipped": event.skipped,
            "data_position": event.data_position,
        },
    )


def spike(
    history: Sequence[float],
    loss: float,
    *,
    zscore: float,
    warmup: int,
    step: int,
    rank: int,
    node: str,
    peer_spread: float = 0.0,
) -> Verdict | None:
    """A loss far above the rolling median of the previous finite losses (robust z-score).

    Args:
        history: the rank's previous finite losses, oldest first (the rolling window).
        loss: this step's loss.
        zscore: the threshold (GuardianSpec.spike_zscore).
        warmup: no verdict until the window holds at least this many values.
        peer_spread: the other ranks' relative spread (`relative_spread`): a floor under this rank's
            own, which a short window can badly underestimate (the ranks see the same noise).
    """
    found = spike_score(history, loss, zscore=zscore, warmup=warmup, peer_spread=peer_spread)
    return spike_verdict(found, loss, zscore, step, rank, node)


def spike_verdict(
    found: SpikeScore | None, loss: float, zscore: float, step: int, rank: int, node: str | None
) -> Verdict | None:
    """The verdict on a loss the spike rule (`vigil.spike_rule`) scored, or None."""
    if found is None:
        return None
    z, median, mad, window = found
    return Verdict(
        kind="spike",
        step=step,
        rank=rank,
        node=node,
        message=f"loss spike on rank {rank} at step {step}: {loss:.4g} vs median {median:.4g} (z={z:.1f})",
        evidence={
            "loss": loss,
            "median": median,
            "mad": mad,
            "zscore": z,
            "threshold": zscore,
            "window": window,
        },
    )


def grad_spike(
    history: Sequence[float], grad_norm: float, *, zscore: float, warmup: int, step: int
) -> Verdict | None:
    """A gradient norm that exploded: `GRAD_SPIKE_RATIO` times the rolling median of the previous
    finite norms and a robust outlier (z > `zscore`) in log space. It often precedes a loss spike.

    Args:
        history: the job's previous finite gradient norms (one per step), oldest first.
    """
    if len(history) < warmup or not math.isfinite(grad_norm) or grad_norm <= 0:
        return None
    logs = [math.log(x) for x in history if x > 0]
    if not logs:
        return None
    median = statistics.median(logs)
    mad = statistics.median([abs(x - median) for x in logs])
    z = (math.log(grad_norm) - median) / max(MAD_TO_SIGMA * mad, GRAD_LOG_SCALE_FLOOR)
    ratio = grad_norm / math.exp(median)
    if ratio < GRAD_SPIKE_RATIO or z <= zscore:
        return None
    return Verdict(
        kind="spike",
        step=step,
        message=f"gradient norm spike at step {step}: {grad_norm:.4g} is {ratio:.0f}x its median "
        f"{math.exp(median):.4g} (z={z:.1f} in log space)",
        evidence={
            "grad_norm": grad_norm,
            "median": math.exp(median),
            "ratio": ratio,
            "zscore": z,
            "threshold": zscore,
            "window": len(history),
        },
    )


def trend(values: Sequence[float]) -> tuple[float, float]:
    """(slope per step, its standard error) of the least-squares line through `values` (>= 3)."""
    n = len(values)
    mx = (n - 1) / 2
    my = sum(values) / n
    sxx = n * (n * n - 1) / 12
    slope = sum((i - mx) * (y - my) for i, y in enumerate(values)) / sxx
    resid = sum((y - my - slope * (i - mx)) ** 2 for i, y in enumerate(values))
    se = math.sqrt(resid / (n - 2) / sxx) if n > 2 else math.inf
    return slope, max(se, ABS_SCALE_FLOOR)


def divergence(
    losses: Sequence[float],
    *,
    window: int,
    tolerance: float,
    step: int,
    rank: int | None = None,
    node: str | None = None,
) -> Verdict | None:
    """The loss trends upward: a trend test on log(loss), over the last `window` values and over
    `LONG_WINDOWS` windows (a slow rise shows there first).

    It is divergence when the fitted line rises by more than `tolerance` (relative) across its span
    and its slope is `DIVERGENCE_T` standard errors above flat. A single spike barely moves the
    line and inflates its error; a benign shift of a few percent (a data-mix change) rises too little.

    Args:
        losses: finite losses, oldest first, ending with this step's (for the job: each step's
            cross-rank median); at least `window` values are needed.
    """
    for span in (window, LONG_WINDOWS * window):
        if len(losses) < span:
            return None
        ys = [math.log(max(x, ABS_SCALE_FLOOR)) for x in losses[-span:]]
        slope, se = trend(ys)
        rise = math.exp(slope * (span - 1)) - 1.0
        t = slope / se
        if rise > tolerance and t > DIVERGENCE_T:
            where = f" on rank {rank}" if rank is not None else ""
            return Verdict(
                kind="divergence",
                step=step,
                rank=rank,
                node=node,
                message=f"loss diverging{where} at step {step}: its trend rose {rise:.0%} over the last "
                f"{span} steps ({slope:.2%} per step, t={t:.1f})",
                evidence={
                    "rise": rise,
                    "slope_per_step": slope,
                    "t": t,
                    "tolerance": tolerance,
                    "window": span,
                    "latest": losses[-1],
                },
            )
    return None


def _json_float(value: float | None) -> float | str | None:
    """Evidence is JSON: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


PENDING_MAX = 64  # incomplete steps kept for the detectors judging a whole step


class Windows:
    def __init__(self, spec: GuardianSpec) -> None:
        self.losses = LossWindows(spec.spike_window, spec.spike_warmup)  # per rank: the spike rule's window
        self.pending: dict[int, dict[int, StepCompleted]] = {}  # step -> rank -> event
        self.step_times: deque[float] = deque(maxlen=spec.hang_window)  # one per step: the slowest rank's
        self.save_times: deque[float] = deque(maxlen=spec.hang_window)  # the same, of gaps that held a save
        self._timed: tuple[str, int] | None = None  # which window's last entry is which step's
        self.checkpoint_every: int | None = None  # the spec's checkpoint.every: which gaps hold a save
        self.held: deque[int] = deque(maxlen=PENDING_MAX)  # steps the ranks held and replayed
        self.progress: dict[int, tuple[float, int | None]] = {}  # rank -> (time of its last step, step)
        self.first_steps: dict[int, int] = {}  # rank -> its first step of this timeline (attempt or rollback)
        self.step_losses: deque[tuple[int, float]] = deque()  # (step, cross-rank median loss)
        self.grad_norms: deque[tuple[int, float]] = deque()  # (step, global gradient norm)
        self.resize(spec)

    def resize(self, spec: GuardianSpec) -> None:
        """Apply a (new) policy's window sizes and thresholds, keeping what has been seen."""
        self.spec = spec
        self.step_times = deque(self.step_times, maxlen=spec.hang_window)
        self.save_times = deque(self.save_times, maxlen=spec.hang_window)
        self.losses.resize(spec.spike_window, spec.spike_warmup)
        keep_job = LONG_WINDOWS * spec.divergence_window
        self.step_losses = deque(self.step_losses, maxlen=keep_job)
        self.grad_norms = deque(self.grad_norms, maxlen=spec.spike_window)
        self.tracker = ImbalanceTracker(spec.imbalance_threshold, spec.imbalance_steps)
        self.scores = StragglerScores()

    def _step_time(self, step: int, seconds: float) -> None:
        """One time per step, the slowest rank's (the ranks of a step come together: a straggler of the
        previous step after a faster rank's next one opens a second entry, which a p99 bears). A gap
        that held a checkpoint save goes to its own window; a held and replayed step's, to none."""
        kind = self.gap(step)
        if kind == "held":
            return
        times = self.save_times if kind == "save" else self.step_times
        if times and self._timed == (kind, step):
            times[-1] = max(times[-1], seconds)
        else:
            times.append(seconds)
            self._timed = (kind, step)

    def gap(self, step: int) -> str:
        """What the wait before `step` holds: "save" (the checkpoint of `step` is written before it runs,
        every `checkpoint.every` steps), "held" (the ranks held and replayed it) or "step"."""
        if step in self.held:
            return "held"
        if self.checkpoint_every and step > 0 and step % self.checkpoint_every == 0:
            return "save"
        return "step"

    def keep_times(self, previous: Windows) -> None:
        """A relaunch on as many ranks: the step and save times of the attempt before stay in the hang
        window (the model and its placement's size are the same). A window that started empty at each
        relaunch held under 100 steps for a while, whose p99 is their slowest (its first steps')."""
        self.step_times.extend(previous.step_times)
        self.save_times.extend(previous.save_times)

    def forget_times(self) -> None:
        """A relaunch on another number of ranks: its step time is its own."""
        self.step_times.clear()
        self.save_times.clear()

    def p99_step_s(self) -> float | None:
        """The p99 of the recent step times (the hang detector's measure), None before any."""
        return p99(self.step_times)

    def p99_wait_s(self) -> float | None:
        """The p99 a silence is judged against now: the saves' where some rank's next step comes after a
        checkpoint save (None before a save is seen: the timeout alone), else the steps'. So a save's
        long gap neither stretches every step's limit nor is judged against it."""
        if any(last is not None and self.gap(last + 1) == "save" for _, last in self.progress.values()):
            return p99(self.save_times)
        return self.p99_step_s()

    def observe(self, event: StepCompleted, world_size: int | None, nodes: dict[int, str]) -> list[Verdict]:
        """Add one rank's step; the verdicts it brings: at most one numeric, and a collective one for
        each complete step judged now."""
        spec, rank, step = self.spec, event.rank, event.step
        t, last = event.occurred_at.timestamp(), self.progress.get(rank)
        self.first_steps.setdefault(rank, step)
        if last is not None and last[1] is not None and step == last[1] + 1 and t > last[0]:
            self._step_time(step, t - last[0])
        self.progress[rank] = (t, step)

        verdicts = []
        verdict = non_finite(event)
        if verdict is not None:
            if not (event.local_finite and world_size and world_size >= 2):
                verdicts.append(verdict)  # its own loss, or nobody to ask: this rank
            # else a witness of another rank's NaN: judged with its whole step (`_whole_step`)
        else:
            found = self.losses.judge(rank, event.loss, spec.spike_zscore)
            self.losses.add(rank, step, event.loss)
            verdict = spike_verdict(found, event.loss, spec.spike_zscore, step, rank, event.node)
            if verdict is not None:
                verdicts.append(verdict)

        # Held even before the world size is known (a launch can be judged after the first steps):
        # every step complete by then is judged, in order, as soon as it is.
        self.pending.setdefault(step, {})[rank] = event
        if world_size:
            for s in sorted(self.pending):
                group = self.pending.get(s)
                if group is None or len(group) < world_size:
                    continue
                for older in [o for o in self.pending if o < s]:  # incomplete older steps: given up
                    verdicts += self._lone_witnesses(self.pending.pop(older))
                del self.pending[s]
                verdicts += self._whole_step(s, list(group.values()), nodes)
        while len(self.pending) > PENDING_MAX:
            verdicts += self._lone_witnesses(self.pending.pop(min(self.pending)))
        return verdicts

    def _whole_step(self, step: int, events: list[StepCompleted], nodes: dict[int, str]) -> list[Verdict]:
        """The verdicts on one complete step: a NaN only witnessed, a gradient-norm spike,
        divergence of the cross-rank median loss, and an imbalance across ranks."""
        spec = self.spec
        out = self._lone_witnesses({e.rank: e for e in events}) if len(events) >= 2 else []
        norms = [e.grad_norm for e in events if e.grad_norm is not None and math.isfinite(e.grad_norm)]
        if norms:
            g = statistics.median(norms)
            history = [x for _, x in self.grad_norms]
            found = grad_spike(history, g, zscore=spec.spike_zscore, warmup=spec.spike_warmup, step=step)
            self.grad_norms.append((step, g))
            if found is not None:
                out.append(found)
        losses = [e.loss for e in events if math.isfinite(e.loss)]
        if len(losses) == len(events):
            self.step_losses.append((step, statistics.median(losses)))
            found = divergence(
                [x for _, x in self.step_losses],
                window=spec.divergence_window,
                tolerance=spec.divergence_tolerance,
                step=step,
                rank=events[0].rank if len(events) == 1 else None,
                node=events[0].node if len(events) == 1 else None,
            )
            if found is not None:
                out.append(found)
        if any(self.first_steps.get(e.rank) == step for e in events):
            return out  # a rank's first step times its start-up (imports, a load, a compile), not a slow rank
        return out + self._slow_rank(events, nodes)

    def _slow_rank(self, events: list[StepCompleted], nodes: dict[int, str]) -> list[Verdict]:
        """An imbalance or straggler from this step's spread (`tracker`, one per run of imbalanced
        steps) and a straggler from the ranks' scores over a window (`scores`). One slow rank is one
        incident: whichever names it first reports it, and neither again until its score is back."""
        scored = self.scores.observe(events, nodes)
        found = self.tracker.observe(events, nodes)
        if found is not None and found.kind == "imbalance":
            if scored is not None and scored.rank == found.rank:
                scored = None  # both name it at this step: the per-step verdict says it
            elif found.rank in self.scores.reported:
                found = None  # a persistent straggler, already reported: not once per run again
            else:
                self.scores.mark(found.rank)
        return [v for v in (found, scored) if v is not None]

    @staticmethod
    def _lone_witnesses(group: dict[int, StepCompleted]) -> list[Verdict]:
        """A non-finite step that no rank owned (every `local_finite` True: the gradients, not the
        loss, overflowed, or the culprit's event never came): named after the lowest such rank."""
        bad = [e for _, e in sorted(group.items()) if non_finite(e) is not None]
        if not bad or any(e.local_finite is False or e.local_finite is None for e in bad):
            return []  # the culprit (or a rank that could not tell) was judged from its own event
        v = non_finite(bad[0])
        assert v is not None
        return [
            dataclasses.replace(
                v,
                evidence={
                    **v.evidence,
                    "culprit": "unknown: every rank's own loss was finite",
                    "ranks": sorted(group),
                },
            )
        ]

    def rewind(self, to_step: int, at: float, ranks: list[int]) -> None:
        """A rollback to checkpoint `to_step` at time `at`: forget the steps from `to_step` on."""
        self.losses.rewind(to_step)
        self.step_losses = deque(
            ((s, x) for s, x in self.step_losses if s < to_step), maxlen=self.step_losses.maxlen
        )
        self.grad_norms = deque(
            ((s, x) for s, x in self.grad_norms if s < to_step), maxlen=self.grad_norms.maxlen
        )
        self.pending.clear()
        self.tracker.reset()
        self.scores.reset()
        self.first_steps.clear()
        self.progress = {r: (at, to_step - 1 if to_step else None) for r in ranks}
