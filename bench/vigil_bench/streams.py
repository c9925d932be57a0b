"""Labelled synthetic step streams for `vigil bench detectors` (pure: a seed in, numbers out).

A stream is one job: `world` ranks, `steps` steps each, and a `Label` saying what fault it holds
(or "clean"). The numbers follow a pre-training run:

- loss: a power law of the learning done so far (the integral of the LR schedule, with a linear
  warmup), times per-rank multiplicative noise (`noise`: 1 %, 3 %, 6 %);
- grad norm: one global value per step (it is all-reduced), log-normal noise and benign 2-3x bumps;
- times: per-rank compute with jitter; every rank waits in the all-reduce for the slowest, so a
  rank's comm time is the wait plus the all-reduce itself, and all ranks' step times are alike;
- benign events that must not alarm: an LR decay step (the loss drops a few percent), a data-mix
  change (the loss rises a few percent for a hundred steps), a single slow step on one rank, and a
  small single-step blip on one rank.

Faults are overlaid on a clean stream from the fault's step on. Wall-clock times (`occurred_at`)
are the bench's business: it stamps each event when it publishes it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

NOISE_LEVELS = (0.01, 0.03, 0.06)
WORLD = 4
COMPUTE_S = 0.30  # one rank's compute per step
ALLREDUCE_S = 0.05
WARMUP_STEPS = 100


@dataclass(frozen=True)
class RankStep:
    """What one rank reports for one step (the bench wraps it in a StepCompleted)."""

    step: int
    rank: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    comm_time_s: float
    skipped: bool = False
    local_finite: bool = True


@dataclass(frozen=True)
class Label:
    """The truth about a stream.

    Attributes:
        fault: "clean" or the fault's name (nan, inf, skipped, spike, multi_spike, grad_explosion,
            divergence, straggler, hang).
        expect: incident kinds that detect it (empty for a clean stream).
        step: the step the fault starts at; None for a clean stream.
        rank: the rank an incident must name; None when no rank is to blame (a global fault).
        detail: e.g. "spike 10x", "divergence 0.5%/step".
    """

    fault: str
    noise: float
    expect: frozenset[str] = frozenset()
    step: int | None = None
    rank: int | None = None
    detail: str = ""

    @property
    def row(self) -> str:
        """The evaluation table's row: the fault, or its rate or size where those are compared."""
        return self.detail if self.fault in ("divergence", "straggler") else self.fault


@dataclass
class Stream:
    name: str
    label: Label
    world: int
    steps: list[list[RankStep]] = field(default_factory=list)  # steps[k][rank]
    job_steps: int = 0  # the training run the window is cut from goes on past it: its train.steps

    @property
    def rank_steps(self) -> int:
        return sum(len(s) for s in self.steps)


def lr_at(step: int, peak: float = 3e-4, decay_at: int | None = None) -> float:
    """Linear warmup to `peak`, then constant; a step decay to 30 % at `decay_at`."""
    lr = peak * min(1.0, (step + 1) / WARMUP_STEPS)
    return lr * 0.3 if decay_at is not None and step >= decay_at else lr


def base_loss(learned: float) -> float:
    """The loss after `learned` peak-LR steps of learning: a power law falling from ~11 to ~2."""
    return 2.0 + 9.0 * (1.0 + learned / 40.0) ** -0.5


def clean(name: str, rng: random.Random, *, noise: float, steps: int, world: int = WORLD) -> Stream:
    """A fault-free stream with its benign events placed at random."""
    start = rng.randrange(0, 3000)  # where in training the window begins
    decay_at = start + rng.randrange(steps // 4, steps)
    mix = start + rng.randrange(0, max(1, steps - 100))  # data-mix change: +4 % for 100 steps
    slow = (start + rng.randrange(steps), rng.randrange(world))  # one slow step on one rank
    blip = (start + rng.randrange(20, steps), rng.randrange(world))  # a single-step blip of +5 %
    learned = sum(lr_at(s) for s in range(start)) / 3e-4
    g_level = 1.5
    out = Stream(name, Label("clean", noise), world, job_steps=2 * (start + steps))
    for step in range(start, start + steps):
        lr = lr_at(step, decay_at=decay_at)
        learned += lr / 3e-4
        loss = base_loss(learned)
        if step >= decay_at:  # the LR drop settles the loss a few percent lower within ~30 steps
            loss *= 1.0 - 0.03 * (1.0 - math.exp(-(step - decay_at) / 10.0))
        if mix <= step < mix + 100:
            loss *= 1.04
        grad = g_level * math.exp(rng.gauss(0.0, 0.15))
        if rng.random() < 1 / 150:  # a benign bump of the gradient norm
            grad *= rng.uniform(2.0, 3.0)
        compute = [COMPUTE_S * (1.0 + rng.gauss(0.0, 0.03)) for _ in range(world)]
        if step == slow[0]:
            compute[slow[1]] *= 3.0
        reduce_s = ALLREDUCE_S * (1.0 + abs(rng.gauss(0.0, 0.05)))
        slowest = max(compute)
        row = []
        for r in range(world):
            x = loss * (1.0 + noise * rng.gauss(0.0, 1.0))
            if (step, r) == blip:
                x *= 1.05
            comm = slowest - compute[r] + reduce_s
            row.append(RankStep(step, r, x, grad, lr, compute[r] + comm, comm))
        out.steps.append(row)
    return out


def _rescaled(row: list[RankStep], factors: list[float]) -> list[RankStep]:
    """The step with rank r's compute multiplied by factors[r]; the others wait for the slowest."""
    compute = [(s.step_time_s - s.comm_time_s) * f for s, f in zip(row, factors, strict=True)]
    reduce_s = min(s.comm_time_s for s in row)  # the slowest rank's wait: the all-reduce alone
    slowest = max(compute)
    out = []
    for s, c in zip(row, compute, strict=True):
        comm = slowest - c + reduce_s
        out.append(replace(s, step_time_s=c + comm, comm_time_s=comm))
    return out


def inject(stream: Stream, label: Label, rng: random.Random, **kw: float) -> Stream:
    """Overlay `label`'s fault on a clean stream, from its step (an index into the stream) on."""
    at = label.step
    assert at is not None
    first = stream.steps[0][0].step
    label = replace(label, step=first + at)
    rows = stream.steps
    k = label.fault
    if k in ("nan", "inf"):
        bad = math.nan if k == "nan" else math.inf
        rows[at] = [
            replace(
                s,
                loss=bad if s.rank == label.rank else s.loss,
                grad_norm=math.nan,
                skipped=True,
                local_finite=s.rank != label.rank,
            )
            for s in rows[at]
        ]
    elif k == "skipped":  # the gradients overflowed: every rank skips the update, every loss is finite
        rows[at] = [replace(s, grad_norm=math.inf, skipped=True) for s in rows[at]]
    elif k in ("spike", "multi_spike"):
        for i in range(at, at + int(kw.get("length", 1))):
            rows[i] = [replace(s, loss=s.loss * kw["factor"]) if s.rank == label.rank else s for s in rows[i]]
    elif k == "grad_explosion":  # the gradient norm explodes, the loss follows two steps later
        rows[at] = [replace(s, grad_norm=s.grad_norm * kw["factor"]) for s in rows[at]]
        rows[at + 1] = [replace(s, grad_norm=s.grad_norm * kw["factor"] / 2) for s in rows[at + 1]]
        rows[at + 2] = [replace(s, loss=s.loss * 3.0) for s in rows[at + 2]]
    elif k == "divergence":
        for i in range(at, len(rows)):
            f = (1.0 + kw["rate"]) ** (i - at + 1)
            rows[i] = [replace(s, loss=s.loss * f) for s in rows[i]]
    elif k == "straggler":
        factors = [kw["slower"] if r == label.rank else 1.0 for r in range(stream.world)]
        for i in range(at, len(rows)):
            rows[i] = _rescaled(rows[i], factors)
    elif k == "hang":
        del rows[at:]  # every rank goes silent (the others block in the collective)
    else:
        raise ValueError(f"unknown fault {k!r}")
    stream.label = label
    return stream


def suite(
    seed: int, *, steps: int, clean_jobs: dict[float, int], faults: bool = True, small: bool = False
) -> list[Stream]:
    """Every stream of one evaluation: `clean_jobs[noise]` clean jobs per noise level, and (with
    `faults`) the labelled faults, each in its own job, at noise levels taken in turn; `small`: only
    the last case of each table row (a quick check that the whole path works)."""
    rng = random.Random(seed)
    out: list[Stream] = []
    for noise, n in clean_jobs.items():
        out += [clean(f"clean-{round(noise * 100)}pct-{i}", rng, noise=noise, steps=steps) for i in range(n)]
    if not faults:
        return out
    cases: list[tuple[Label, dict[str, float]]] = []
    n_spike = {"nan", "inf", "skipped", "spike", "multi_spike", "grad_explosion"}
    for fault in ("nan", "inf"):
        cases += [
            (Label(fault, 0, frozenset({"nan"}), rank=r, detail=f"{fault} loss"), {}) for r in range(WORLD)
        ]
    cases += [(Label("skipped", 0, frozenset({"nan"}), detail="update skipped (overflow)"), {})] * 3
    for factor in (2.0, 3.0, 5.0, 10.0, 100.0):
        for r in (1, 3):
            cases.append(
                (
                    Label("spike", 0, frozenset({"spike"}), rank=r, detail=f"spike {factor:g}x"),
                    {"factor": factor},
                )
            )
    for factor, length in ((3.0, 3), (5.0, 5), (10.0, 3), (2.0, 4)):
        cases.append(
            (
                Label(
                    "multi_spike",
                    0,
                    frozenset({"spike"}),
                    rank=2,
                    detail=f"spike {factor:g}x for {length} steps",
                ),
                {"factor": factor, "length": length},
            )
        )
    for factor in (20.0, 50.0, 100.0):
        cases.append(
            (
                Label("grad_explosion", 0, frozenset({"spike"}), detail=f"grad norm {factor:g}x, then loss"),
                {"factor": factor},
            )
        )
    for rate in (0.002, 0.005, 0.01, 0.02):
        cases += [
            (
                Label("divergence", 0, frozenset({"divergence"}), detail=f"divergence {rate:.1%}/step"),
                {"rate": rate},
            )
        ] * 3
    for slower in (1.15, 1.30):
        for r in (0, 2, 3):
            cases.append(
                (
                    Label(
                        "straggler",
                        0,
                        frozenset({"imbalance", "straggler"}),
                        rank=r,
                        detail=f"straggler {slower - 1:.0%}",
                    ),
                    {"slower": slower},
                )
            )
    cases += [(Label("hang", 0, frozenset({"hang"}), detail="hang"), {})] * 3
    if small:
        last = {label.row: i for i, (label, _) in enumerate(cases)}
        cases = [cases[i] for i in sorted(last.values())]
    for i, (label, kw) in enumerate(cases):
        noise = NOISE_LEVELS[i % len(NOISE_LEVELS)]
        s = clean(f"{label.fault}-{i}", rng, noise=noise, steps=steps)
        # late enough for the windows to fill; divergence needs room to show
        span = steps // 3 if label.fault in n_spike or label.fault == "straggler" else steps // 4
        at = rng.randrange(max(60, span // 2), span + 60)
        if label.fault == "hang":
            at = rng.randrange(steps // 3, steps // 2)
        out.append(inject(s, replace(label, noise=noise, step=at), rng, **kw))
    return out
