"""A hostile job's rank program: from inside its rank it tries to reach the control plane's secrets and a
victim job beside it, notes each attempt and its outcome in `findings.json` in its own checkpoint folder,
leaves a double-forked child behind, and waits to be cancelled.

Argument: a JSON object naming the targets (data dir, node, victim job id and pid)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

targets = json.loads(sys.argv[1])
data = Path(targets["data_dir"])
victim, victim_pid = targets["victim_job"], int(targets["victim_pid"])
findings: dict[str, str] = {}


def attempt(name: str, action: Callable[[], object]) -> None:
    """Run one attack: "denied: <error>" when the system refused it, "SUCCEEDED: <what>" when it worked."""
    try:
        got = action()
    except OSError as exc:
        findings[name] = f"denied: {type(exc).__name__} errno {exc.errno}"
    else:
        findings[name] = f"SUCCEEDED: {str(got)[:200]}"


def read(path: Path) -> Callable[[], str]:
    return lambda: path.read_text()


def fds_of(pid: int) -> list[str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    return [os.readlink(fd_dir / name) for name in os.listdir(fd_dir)]


def relay_with_a_guessed_token() -> str:
    """Claim to be the victim's rank 0 on the agent's socket, with this rank's own token's shape."""
    with socket.socket(socket.AF_UNIX) as link:
        link.connect(os.environ["VIGIL_AGENT_SOCKET"])
        hello = {"frame": "hello", "job_id": victim, "attempt": 1, "rank": 0, "token": "A" * 43}
        link.sendall(json.dumps(hello).encode() + b"\n")
        answer = link.makefile().readline()
    if '"refused"' in answer:
        raise PermissionError(13, f"the relay refused: {answer.strip()[:120]}")
    return answer


def write_into_victims_checkpoints() -> str:
    (data / "checkpoints" / victim / "planted").write_text("x")
    return "planted"


# --- secrets --------------------------------------------------------------------------------------------
attempt("read credentials.json", read(data / "credentials.json"))
attempt("read nats.conf", read(data / "nats.conf"))
attempt("read endpoints.json", read(data / "endpoints.json"))
attempt("read ranks.json", read(data / "worker" / targets["node"] / "ranks.json"))
attempt("list the data dir", lambda: os.listdir(data))
attempt("read the victim's environ", read(Path(f"/proc/{victim_pid}/environ")))
attempt("list the victim's open files", lambda: fds_of(victim_pid))
attempt("read the victim's launch.json", read(data / "runs" / victim / "attempt-1" / "launch.json"))
attempt("list the victim's logs", lambda: os.listdir(data / "logs" / victim))
attempt("relay hello as the victim", relay_with_a_guessed_token)
secrets_here = [k for k in os.environ if ("TOKEN" in k and k != "VIGIL_RANK_TOKEN_FD") or "PASSWORD" in k]
findings["a secret in this rank's environment"] = (
    f"SUCCEEDED: {secrets_here}" if secrets_here else "denied: none there"
)
# --- the victim's files and processes -------------------------------------------------------------------
attempt("list the checkpoint root", lambda: os.listdir(data / "checkpoints"))
attempt("list the victim's checkpoints", lambda: os.listdir(data / "checkpoints" / victim))
attempt("write into the victim's checkpoints", write_into_victims_checkpoints)
attempt("list the runs folder", lambda: os.listdir(data / "runs"))
attempt("kill the victim's rank", lambda: os.kill(victim_pid, signal.SIGKILL))
attempt("kill the victim's process group", lambda: os.killpg(victim_pid, signal.SIGKILL))

# --- a child meant to outlive the job's cancel ------------------------------------------------------------
read_end, write_end = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(write_end, str(os.getpid()).encode())
        while True:
            time.sleep(3600)
    os._exit(0)
findings["escapee pid"] = os.read(read_end, 32).decode()
findings["uid"] = str(os.getuid())
findings["groups"] = ",".join(str(g) for g in os.getgroups())

out = Path(os.environ["VIGIL_CHECKPOINT_ROOT"]) / os.environ["VIGIL_JOB_ID"] / "findings.json"
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps(findings, indent=1))
tmp.rename(out)
while True:  # until the job is cancelled
    time.sleep(3600)
