#!/usr/bin/env python3
"""The NATS users of compose.yaml and deploy/k8s, rendered from `vigil_common.credentials` (the one
place that says what each role may publish and read) into two checked-in files:

    deploy/nats/authorization.conf            compose's, included by deploy/nats/nats.conf
    deploy/k8s/base/nats-authorization.yaml   Kubernetes', a ConfigMap beside nats.yaml's

    python deploy/nats/authorization.py                      # render both again (credentials.py changed)
    python deploy/nats/authorization.py --k8s-nodes a,b,c    # Kubernetes: your worker nodes' names
    python deploy/nats/authorization.py --check              # exit 1 when a file is not what it renders

(with the Python Vigil is installed in, `.venv/bin/python`: it imports vigil_common).

Rendered and checked in rather than rendered at deploy time: neither `docker compose` nor
`kubectl apply -k` can run a step of ours before NATS starts, and the nats image has no Python. A
checked-in file is reviewed like code, and tests/unit/test_nats_authorization.py fails when it
differs from what credentials.py says. The files hold no secret: each password is a
`$NATS_<ROLE>_PASSWORD` variable, read by nats-server from its environment (compose: `.env`;
Kubernetes: the vigil-secrets Secret).

Workers: compose's two nodes (COMPOSE_NODES) each get their own user and password. On Kubernetes the
workers are a DaemonSet, whose pods cannot each be handed a different Secret, so every listed node
gets its own user `worker-<node>` (the server still confines its heartbeat and GPU subjects to that
node) and all of them one password, NATS_WORKER_PASSWORD. A node left out of the list gets no worker
login: list it here, render, apply, and restart NATS (`kubectl rollout restart statefulset/nats`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vigil_common import credentials

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "nats" / "authorization.conf"
K8S_FILE = ROOT / "deploy" / "k8s" / "base" / "nats-authorization.yaml"
COMPOSE_NODES = ("worker-cpu", "worker-gpu")  # compose.yaml's VIGIL_NODE_NAMEs
K8S_WORKER_PASSWORD = "NATS_WORKER_PASSWORD"
EXAMPLE_K8S_NODES = ("CHANGE-ME-node-1", "CHANGE-ME-node-2")

_HEADER = """\
# Rendered by deploy/nats/authorization.py from vigil_common/credentials.py: do not edit, render.
# One NATS user per role; each password is a variable nats-server reads from its environment.
"""
_USERS = re.compile(r"^  users: (\[.*?^\])$", re.M | re.S)
_PASSWORD_VARIABLE = re.compile(r'("password": )\$([A-Z_][A-Z0-9_]*)')


def password_variable(role: str) -> str:
    """The variable holding `role`'s password: NATS_ADMIN_PASSWORD, NATS_WORKER_<NODE>_PASSWORD."""
    return f"NATS_{role.upper().replace('-', '_')}_PASSWORD"


def compose_authorization() -> str:
    return _HEADER + credentials.authorization_template(_variables(COMPOSE_NODES, shared_worker=False))


def k8s_authorization(nodes: Iterable[str]) -> str:
    """The ConfigMap `nats-authorization`, its `authorization.conf` for these worker nodes."""
    conf = credentials.authorization_template(_variables(nodes, shared_worker=True))
    body = "".join(f"    {line}\n" if line else "\n" for line in conf.splitlines())
    return (
        _HEADER
        + "# Worker nodes: python deploy/nats/authorization.py --k8s-nodes <your nodes, comma-separated>\n"
        + "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: nats-authorization\n"
        + "data:\n  authorization.conf: |\n"
        + body
    )


def _variables(nodes: Iterable[str], *, shared_worker: bool) -> dict[str, str]:
    own = {role: password_variable(role) for role in credentials.roles(nodes)}
    if len(set(own.values())) != len(own):
        raise ValueError(f"two roles would share a password variable: {sorted(own)}")
    if shared_worker:
        return {role: K8S_WORKER_PASSWORD if role.startswith("worker-") else v for role, v in own.items()}
    return own


def users(conf: str) -> dict[str, dict[str, Any]]:
    """The users of a rendered `authorization` block: name -> {"password": "$VARIABLE", "permissions"}."""
    found = _USERS.search(conf)
    if found is None:
        raise ValueError("no `users: [...]` list in this authorization block")
    entries = json.loads(_PASSWORD_VARIABLE.sub(r'\1"$\2"', found.group(1)))
    return {e["user"]: {k: v for k, v in e.items() if k != "user"} for e in entries}


def k8s_conf(manifest: str) -> str:
    """The nats-server configuration inside the rendered ConfigMap."""
    _, marker, rest = manifest.partition("  authorization.conf: |\n")
    if not marker:
        raise ValueError("no authorization.conf in this ConfigMap")
    return textwrap.dedent(rest)


def k8s_nodes(manifest: str) -> list[str]:
    return sorted(u.removeprefix("worker-") for u in users(k8s_conf(manifest)) if u.startswith("worker-"))


def rendered(nodes: Sequence[str] | None = None) -> dict[Path, str]:
    """Each file as it should read; the Kubernetes nodes default to those the file lists now."""
    if nodes is None:
        nodes = k8s_nodes(K8S_FILE.read_text()) if K8S_FILE.exists() else list(EXAMPLE_K8S_NODES)
    return {COMPOSE_FILE: compose_authorization(), K8S_FILE: k8s_authorization(nodes)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k8s-nodes", help="comma-separated names of the Kubernetes worker nodes")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    nodes = None
    if args.k8s_nodes:
        try:  # each a node name Vigil accepts (letters, digits, '-', '_')
            nodes = [
                credentials.worker_role(n.strip()).removeprefix("worker-") for n in args.k8s_nodes.split(",")
            ]
        except ValueError as exc:
            parser.error(f"--k8s-nodes: {exc}")
    stale = []
    for path, text in rendered(nodes).items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if args.check and stale:
        print("not as rendered (run python deploy/nats/authorization.py):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
