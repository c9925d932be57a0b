"""Vigil's SDK: what a training program and a notebook import.

For a rank of a job Vigil launched, a few lines added to an existing loop::

    import vigil

    run = vigil.init()  # connects to this node's Vigil agent; inert outside Vigil (one log line)
    ...
    run.report(step, loss=loss.item(), lr=lr, tokens=tokens)

For scripts and notebooks that drive Vigil from outside, the HTTP client::

    client = vigil.Client("http://127.0.0.1:8000", token)
    job = client.submit(spec)

Importing `vigil` is light: it pulls in neither the control plane nor a bus client (a rank talks to
its own worker agent over a local socket). Framework integrations live in `vigil.integrations`
(`hf`, `lightning`, `deepspeed`), each imported only when used; a plain `torch.distributed` (DDP) loop
needs none: it calls `vigil.init()` and its `Run` directly.

The SDK is its own distribution (`sdk/pyproject.toml`, `pip install ./sdk`), a leaf the control plane
depends on: it also holds the wire contract both sides share (`events`, `protocol`, `errors`,
`jobstates`, `spec`) and the HTTP API's models (`api`), and imports nothing of the control plane.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vigil.client import Client as Client
    from vigil.client import VigilError as VigilError
    from vigil.rendezvous import init_process_group as init_process_group
    from vigil.run import Run as Run
    from vigil.run import init as init

__all__ = ["Client", "Run", "VigilError", "init", "init_process_group"]

_LAZY = {
    "init": "vigil.run",
    "Run": "vigil.run",
    "Client": "vigil.client",
    "VigilError": "vigil.client",
    "init_process_group": "vigil.rendezvous",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (`import vigil` itself stays cheap)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vigil' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
