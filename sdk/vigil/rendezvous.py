"""The default process group from torchrun's environment, with its store listening on the rendezvous
address only.

`torch.distributed.init_process_group("env://")` makes rank 0's TCPStore listen on every interface,
without authentication, whatever MASTER_ADDR says. Here rank 0 binds the listening socket itself, to
MASTER_ADDR:MASTER_PORT, and hands it to the store (`master_listen_fd`). Frameworks that find the
default group already made (DeepSpeed's `init_distributed`, Hugging Face Accelerate, Lightning) use it
as it is: call `vigil.init_process_group()` first.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any


def init_process_group(backend: str | None = None, *, timeout_s: float = 1800.0) -> None:
    """Make the default process group (NCCL with CUDA, else gloo) unless one exists."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=timeout_s)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    store = tcp_store(addr, port, rank=rank, world_size=world, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def tcp_store(addr: str, port: int, *, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A TCPStore for `world_size` ranks; rank 0's listens on `addr`:`port` and nowhere else."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(sockaddr)
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        raise OSError(f"rank 0 cannot listen on MASTER_ADDR {addr}:{port}: {exc}") from exc
    fd = listener.detach()  # the store owns the socket from now on
    return dist.TCPStore(
        addr, port, world_size, True, timeout=timeout, master_listen_fd=fd, wait_for_workers=False
    )
