"""The rank SDK without a network: inert outside Vigil, data windows, the command receiver, checkpoints
through the manifest, the link's frames, and an import that pulls in no control plane."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from vigil import events as ev
from vigil import manifest
from vigil import protocol as proto
from vigil.boundary import Boundary
from vigil.errors import MalformedMessage
from vigil.link import NullLink
from vigil.recovery import Inbox, act
from vigil.run import Identity, Restart, Run, init, parse_windows, spec_from_env


def test_outside_vigil_init_is_inert_and_says_so_once(monkeypatch, caplog):
    for name in (proto.AGENT_SOCKET_ENV, proto.JOB_ID_ENV, proto.RANK_TOKEN_FD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("vigil.run._current", None)
    with caplog.at_level(logging.WARNING, logger="vigil"):
        run = init()
        assert init() is run
    assert not run.active
    assert [r.message for r in caplog.records if "not running under Vigil" in r.message] != []
    assert len([r for r in caplog.records if r.name == "vigil"]) == 1
    run.report(0, loss=1.0)  # nothing to send to, nothing raised
    assert run.after_step(1, run.agree(True)) == 1


def test_data_windows_are_parsed_and_skipped():
    assert parse_windows("10:12, 40:41") == [(10, 12), (40, 41)]
    assert parse_windows("") == []
    for bad in ("10", "12:10", "a:b", "5:5"):
        with pytest.raises(ValueError, match=proto.SKIP_DATA_ENV):
            parse_windows(bad)
    run = Run(Identity("j", 1, 0, 1, 0, "n"), NullLink(), skip_windows=[(3, 5), (5, 6)])
    assert [run.position(s) for s in (2, 3, 4, 5, 6)] == [2, 6, 6, 6, 6]


class Commands:
    """A link that holds a fixed list of commands (numbered from 1) and keeps what the rank sends."""

    def __init__(self, *commands: ev.Message) -> None:
        self.commands = list(commands)
        self.sent: list[ev.Message] = []

    def emit(self, event: ev.Message) -> None:
        self.sent.append(event)

    @property
    def latest_seq(self) -> int:
        return len(self.commands)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass

    def command(self, seq: int, timeout_s: float) -> ev.Message:
        if seq > len(self.commands):
            raise TimeoutError(f"command #{seq}")
        return self.commands[seq - 1]

    def arrival(self, seq: int) -> float | None:
        return None  # no bus: no arrival time


class Handler:
    def __init__(self) -> None:
        self.did: list[str] = []

    def halt(self, command: ev.HaltJob) -> None:
        self.did.append("halt")

    def rollback(self, command: ev.RollbackJob, seq: int) -> None:
        self.did.append(f"rollback to {command.step} (#{seq})")

    def resume(self, command: ev.ResumeJob) -> None:
        self.did.append("resume")


def test_commands_are_acted_on_in_order_and_a_halt_waits_for_the_next_one():
    halt = ev.HaltJob(job_id="j", attempt=2, reason="nan")
    old = ev.HaltJob(job_id="j", attempt=1, reason="an older attempt's")
    back = ev.RollbackJob(job_id="j", attempt=2, checkpoint="/c/j/step_00000010", step=10, reason="nan")
    link, inbox, handler = Commands(old, halt, back), Inbox(), Handler()
    act(link, inbox, agreed_seq=2, attempt=2, handler=handler)  # halted at #2: goes on to #3 by itself
    assert handler.did == ["halt", "rollback to 10 (#3)"]
    assert (inbox.handled_seq, inbox.halted) == (3, False)


def test_a_resume_ends_a_halt_and_a_second_halt_or_stray_resume_changes_nothing():
    commands = [ev.ResumeJob(job_id="j", attempt=1), ev.HaltJob(job_id="j", attempt=1, reason="a"),
                ev.HaltJob(job_id="j", attempt=1, reason="b"), ev.ResumeJob(job_id="j", attempt=1)]  # fmt: skip
    link, inbox, handler = Commands(*commands), Inbox(), Handler()
    act(link, inbox, agreed_seq=2, attempt=1, handler=handler)
    assert handler.did == ["halt", "resume"] and inbox.handled_seq == 4 and not inbox.halted


def test_an_agreed_command_that_never_arrives_is_an_error():
    with pytest.raises(TimeoutError):
        act(Commands(), Inbox(), agreed_seq=1, attempt=1, handler=Handler())


def test_without_a_loader_a_rollback_stops_the_rank_to_be_relaunched(tmp_path):
    back = ev.RollbackJob(
        job_id="j", attempt=1, checkpoint=str(tmp_path / "j" / "step_00000002"), step=2, reason="x"
    )
    run = Run(Identity("j", 1, 0, 1, 0, "n"), Commands(back), checkpoint_root=tmp_path)
    with pytest.raises(Restart) as stop:
        run.after_step(5, Boundary(True, 1))
    assert stop.value.code == 5


def test_with_a_loader_a_rollback_loads_in_place_and_returns_the_checkpoints_step(tmp_path):
    target = str(manifest.step_dir(tmp_path, "j", 4))
    link = Commands(
        ev.RollbackJob(job_id="j", attempt=1, checkpoint=target, step=4, skip_data=(4, 5), reason="x")
    )
    run = Run(Identity("j", 1, 0, 1, 0, "n"), link, checkpoint_root=tmp_path, keep=2)
    for step in (2, 4, 6):
        run.save_checkpoint(step, lambda path, s=step: (path / "model.txt").write_text(f"weights {s}"))
    assert [s for s, _ in manifest.checkpoints(tmp_path, "j")] == [4, 6], "keeps the newest two"
    loaded: list[str] = []
    run.on_rollback(lambda path: loaded.append((path / "model.txt").read_text()))
    sent = link.sent
    run.report(6, loss=2.0)
    assert run.after_step(7, Boundary(True, 1)) == 4
    assert loaded == ["weights 4"] and run.skip_windows == [(4, 5)] and run.position(4) == 5
    run.report(4, loss=1.5)  # step 4 again: the re-run is the attempt's next generation of it
    steps = [e for e in sent if isinstance(e, ev.StepCompleted)]
    assert [(e.step, e.generation) for e in steps] == [(6, 0), (4, 1)]
    assert any(isinstance(e, ev.RollbackCompleted) and e.to_step == 4 for e in sent)


def test_an_agent_frame_that_is_not_one_is_refused():
    with pytest.raises(MalformedMessage):
        proto.decode_agent_frame(b'{"frame": "delivered", "seq": 1, "command": {"type": "job.cancel"}}')


def test_importing_the_sdk_pulls_in_no_control_plane():
    code = (
        "import sys, vigil, vigil.run, vigil.link, vigil.manifest, vigil.client, vigil.api; vigil.init; vigil.Client; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('nats', 'asyncpg', 'litestar', 'torch', 'vigil_scheduler',"
        " 'vigil_worker', 'vigil_guardian', 'vigil_telemetry', 'vigil_cli', 'opentelemetry')]; "
        "assert not bad, bad"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    assert done.returncode == 0, done.stderr


def test_the_jobs_spec_is_read_only_and_none_without_one(monkeypatch):
    assert spec_from_env({}) is None
    spec = spec_from_env({proto.JOB_SPEC_ENV: '{"name": "own", "checkpoint": {"every": 7, "keep": 2}}'})
    assert spec is not None and spec.checkpoint.every == 7
    with pytest.raises(ValidationError):
        spec.checkpoint.every = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match=proto.JOB_SPEC_ENV):
        spec_from_env({proto.JOB_SPEC_ENV: '{"name": "own", "train": {"steps": "many"}}'})
    for name in (proto.AGENT_SOCKET_ENV, proto.JOB_ID_ENV, proto.JOB_SPEC_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("vigil.run._current", None)
    assert init().spec is None  # alone: the program falls back to its own values


def test_a_halt_on_the_programs_own_account_waits_in_after_step_until_resumed(tmp_path):
    link = Commands(ev.ResumeJob(job_id="j", attempt=1))
    run = Run(Identity("j", 1, 0, 1, 0, "n"), link, checkpoint_root=tmp_path)
    assert run.after_step(7, Boundary(True, 0)) == 7
    run.halt("out of memory", "oom-j-1-7")
    (halted,) = [e for e in link.sent if isinstance(e, ev.RanksHalted)]
    assert (halted.step, halted.command_id) == (6, "oom-j-1-7")
    # halted: it waits for the next command (the resume, #1) though no rank has seen one at the boundary
    assert run.after_step(7, Boundary(True, 0)) == 7
    assert [e for e in link.sent if isinstance(e, ev.RanksHalted)] == [halted]  # resumed: not halted again


def test_a_rollback_to_a_step_every_rank_holds_in_memory_loads_it_from_there(tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv(proto.SNAPSHOT_DIR_ENV, raising=False)  # this process only: no files
    target = str(manifest.step_dir(tmp_path, "j", 2))
    link = Commands(
        ev.RollbackJob(job_id="j", attempt=1, checkpoint=target, step=2, skip_data=(2, 3), reason="x")
    )
    run = Run(Identity("j", 1, 0, 1, 0, "n"), link, checkpoint_root=tmp_path)
    w = torch.zeros(2)
    loaded: list[tuple[str, float]] = []
    run.on_rollback(lambda path: loaded.append(("disk", 0.0)))
    run.snapshot(
        lambda: {"w": w}, load=lambda state: loaded.append(("memory", float(state["w"][0]))), every=1
    )
    w += 2
    run.save_checkpoint(2, lambda path: (path / "w.txt").write_text("2"))  # its step stays in memory
    w += 3  # steps 2..4 train on
    assert run.after_step(5, Boundary(True, 1)) == 2
    assert loaded == [("memory", 2.0)]  # the state of step 2, not the live one (5.0), and no disk read
    rolled = run.last_rollback
    assert rolled is not None and rolled.from_memory and (rolled.from_step, rolled.to_step) == (4, 2)
    assert rolled.checkpoint == target and run.skip_windows == [(2, 3)] and run.generation == 1
