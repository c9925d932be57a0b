"""A hang explained by its stacks: the ranks grouped by the call path of their main thread, and the rank
that stands apart named with its frame. Pure: dumps in, an explanation out.

In a hang, most ranks wait in a collective for the few that do not arrive; those few are somewhere else
(a data loader, a sleep, a loop). So: group the ranks by main-thread call path; a group whose path goes
through a collective (`all_reduce`, `barrier`, ... of torch.distributed or DeepSpeed's comm; autograd's
`backward`, where DDP's gradient all-reduce runs; a CUDA `synchronize`, where NCCL's is waited for) waits. The
outlier is the smallest group that waits in no collective (every group waits: the smallest, when there
is more than one: a rank in another collective); ties go to the group holding the rank the hang detector
named, then to the lowest rank. A group is named by its innermost collective frame when it waits, else by
its innermost frame outside the Python standard library (`Loader.__next__ (data.py:88)`, not
`Condition.wait (threading.py:327)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vigil.events import RankStacks, StackFrame, StacksDumped
from vigil_common.stack_frames import collective, main_thread
from vigil_guardian.verdict import Verdict

MAX_GROUPS = 16  # in the incident's evidence; the rest are counted
SUMMARY_GROUPS = 4  # in the incident's message
PATH_FRAMES = 12  # of each group's call path, innermost first


@dataclass(frozen=True)
class Group:
    """Ranks whose main threads share one call path."""

    ranks: tuple[int, ...]
    path: tuple[StackFrame, ...]  # innermost first
    collective: StackFrame | None  # the innermost collective frame it waits in; None: none

    @property
    def frame(self) -> StackFrame | None:
        """The frame that says where the group is."""
        return self.collective or where(self.path)


@dataclass(frozen=True)
class Explanation:
    groups: tuple[Group, ...]  # the outlier's first, then the largest
    outlier: Group | None
    missing: dict[int, str] = field(default_factory=dict)  # rank -> why it has no stacks

    @property
    def rank(self) -> int | None:
        """The rank to name: the outlier's lowest."""
        return self.outlier.ranks[0] if self.outlier else None

    def summary(self) -> str:
        """`rank 3 in `Loader.__next__` (data.py:88); 7 ranks wait in `all_reduce``."""
        parts = []
        for g in self.groups[:SUMMARY_GROUPS]:
            who = _ranks(g.ranks) if g is self.outlier or len(self.groups) == 1 else _count(g.ranks)
            if len(self.groups) == 1 and len(g.ranks) > 1:
                who = f"all {len(g.ranks)} ranks"
            parts.append(f"{who} {_verb(g)} {_name(g)}")
        if len(self.groups) > SUMMARY_GROUPS:
            rest = self.groups[SUMMARY_GROUPS:]
            parts.append(f"{sum(len(g.ranks) for g in rest)} more ranks in {len(rest)} other places")
        if self.missing:
            parts.append(f"no stacks from {_ranks(tuple(sorted(self.missing)))}: {_why(self.missing)}")
        return "; ".join(parts) if parts else "no stacks"

    def evidence(self) -> dict[str, Any]:
        """What the incident keeps: the groups (bounded), the outlier and the ranks without stacks."""
        shown = self.groups[:MAX_GROUPS]
        out: dict[str, Any] = {
            "outlier": list(self.outlier.ranks) if self.outlier else None,
            "groups": [
                {
                    "ranks": list(g.ranks),
                    "frame": label(g.frame) if g.frame else None,
                    "collective": g.collective.function.rsplit(".", 1)[-1] if g.collective else None,
                    "path": [label(f) for f in g.path[:PATH_FRAMES]],
                }
                for g in shown
            ],
            "missing": {str(r): why[:300] for r, why in sorted(self.missing.items())[:MAX_GROUPS]},
        }
        if len(self.groups) > len(shown):
            out["more_groups"] = len(self.groups) - len(shown)
        return out


def explained(
    v: Verdict,
    dumps: Iterable[StacksDumped],
    ranks: Iterable[int],
    nodes: Mapping[int, str],
    *,
    error: str | None = None,
) -> Verdict:
    """The hang verdict `v` with its stacks: the outlier (when there is one) becomes the verdict's rank,
    the summary joins its message and the groups its evidence (`stacks`); with no dump at all, the message
    says why (`error`)."""
    dumps = list(dumps)
    if not dumps:
        why = error or "no dump came"
        return dataclasses.replace(
            v, message=f"{v.message}; no stacks: {why}", evidence={**v.evidence, "stacks": {"error": why}}
        )
    e = explain(dumps, ranks, hint=v.rank, nodes=nodes)
    rank = e.rank if e.rank is not None else v.rank
    return dataclasses.replace(
        v,
        rank=rank,
        node=nodes.get(rank, v.node) if rank is not None else v.node,
        message=f"{v.message}: {e.summary()}",
        evidence={**v.evidence, "silent_rank": v.rank, "stacks": e.evidence()},
    )


def explain(
    dumps: Iterable[StacksDumped],
    ranks: Iterable[int],
    hint: int | None = None,
    nodes: Mapping[int, str] | None = None,
) -> Explanation:
    """Group the main-thread stacks of `ranks` (the job's live ranks) from the nodes' dumps; a rank in no
    dump, or dumped with an error, is missing. `hint`: the rank the hang detector named. `nodes` (rank ->
    node, the placement): a node's dump speaks for the ranks placed on it only (a worker cannot speak
    for another node's ranks)."""
    by_rank: dict[int, RankStacks] = {}
    for d in dumps:
        for r in d.ranks:
            if nodes is None or nodes.get(r.rank) == d.node:
                by_rank[r.rank] = r
    missing: dict[int, str] = {}
    paths: dict[tuple[StackFrame, ...], list[int]] = {}
    for rank in sorted(set(ranks)):
        r = by_rank.get(rank)
        thread = main_thread(r) if r is not None and r.error is None else None
        if r is None:
            missing[rank] = "its node sent no dump"
        elif r.error is not None:
            missing[rank] = r.error
        elif thread is None or not thread.frames:
            missing[rank] = "no Python frame in its main thread"
        else:
            paths.setdefault(tuple(thread.frames), []).append(rank)
    groups = [Group(tuple(rs), path, collective(path)) for path, rs in paths.items()]
    outlier = pick_outlier(groups, hint)
    ordered = sorted(groups, key=lambda g: (g is not outlier, -len(g.ranks), g.ranks))
    return Explanation(tuple(ordered), outlier, missing)


def pick_outlier(groups: list[Group], hint: int | None) -> Group | None:
    """The group that stands apart (see the module's docstring); None when every rank is in one."""
    if len(groups) < 2:
        return None
    free = [g for g in groups if g.collective is None]
    candidates = free or groups
    return min(candidates, key=lambda g: (len(g.ranks), hint not in g.ranks, g.ranks))


def where(path: tuple[StackFrame, ...]) -> StackFrame | None:
    """The innermost frame outside the Python standard library (the innermost, if all are in it)."""
    return next((f for f in path if not stdlib(f.file)), path[0] if path else None)


def stdlib(file: str) -> bool:
    """Whether a frame's file is the standard library's (`.../lib/python3.11/threading.py`)."""
    return "/lib/python3" in file and "-packages/" not in file


def label(f: StackFrame) -> str:
    """`Loader.__next__ (data.py:88)`."""
    line = "" if f.line is None else f":{f.line}"
    return f"{f.function} ({f.file.rsplit('/', 1)[-1]}{line})"


def _verb(g: Group) -> str:
    if g.collective is not None:
        return "waits in" if len(g.ranks) == 1 else "wait in"
    return "in"


def _name(g: Group) -> str:
    if g.collective is not None:
        return f"`{g.collective.function.rsplit('.', 1)[-1]}`"
    f = g.frame
    if f is None:
        return "no frame"
    line = "" if f.line is None else f":{f.line}"
    return f"`{f.function}` ({f.file.rsplit('/', 1)[-1]}{line})"


def _ranks(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def _count(ranks: tuple[int, ...]) -> str:
    return "1 rank" if len(ranks) == 1 else f"{len(ranks)} ranks"


def _why(missing: dict[int, str]) -> str:
    reasons = sorted(set(missing.values()))
    return reasons[0][:200] if len(reasons) == 1 else f"{reasons[0][:200]} (and {len(reasons) - 1} more)"
