"""Fixtures for unit tests that need a real DeepSpeed engine on one CPU rank (no network)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A process group of one (gloo), as DeepSpeed needs one: one per test module, torn down through
    DeepSpeed so that it lets go of the groups it derived from it (the next module starts clean)."""
    import deepspeed.comm
    import torch.distributed as dist

    from vigil.integrations import ds_compat

    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "DS_ACCELERATOR": "cpu",
        }.items():
            mp.setenv(name, value)
        ds_compat.skip_shm_build()
        store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            if deepspeed.comm.is_initialized():  # an engine was built: DeepSpeed holds the group
                deepspeed.comm.destroy_process_group()
            else:
                dist.destroy_process_group()
