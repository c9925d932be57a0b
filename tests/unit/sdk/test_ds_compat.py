"""DeepSpeed's internals that Vigil relies on: each name exists in the installed DeepSpeed, and no module
of Vigil but `vigil.integrations.ds_compat` (nor an example program) uses one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from vigil.integrations import ds_compat

ROOT = Path(__file__).resolve().parents[3]
# product code and the user's examples
SCANNED = ("services", "trainer", "sdk", "libs", "cli", "bench", "examples")
COMPAT = ROOT / "sdk" / "vigil" / "integrations" / "ds_compat.py"
EXEMPT: set[tuple[str, str]] = set()  # (file, name) allowed outside ds_compat: none
ATTR_CALLS = {"getattr", "setattr", "hasattr", "delattr"}
# internals of DeepSpeed's optimizers that Vigil once shadowed or set: not to come back outside ds_compat
OPTIMIZER_INTERNALS = {"overflow", "scaled_global_norm", "_get_norm_groups", "get_grads_for_norm"}
HOLDERS = {"engine", "optimizer", "opt", "ds_engine", "zero_optimizer"}  # names that hold DeepSpeed objects


def test_every_module_name_the_compat_module_uses_is_in_the_installed_deepspeed():
    for module, name in ds_compat.MODULE_NAMES:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


def test_the_modules_a_warm_rank_imports_early_are_in_the_installed_deepspeed():
    for module in ds_compat.LAZY_MODULES:  # renamed: a warm rank would silently import it late again
        importlib.import_module(module)


def _engine(stage: int) -> object:
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    config = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_every_engine_name_the_compat_module_uses_is_on_a_real_engine(one_rank, stage):
    engine = _engine(stage)
    for name in ds_compat.ENGINE_NAMES:
        assert hasattr(engine, name), f"DeepSpeedEngine.{name} is gone"
    assert isinstance(ds_compat.client_optimizer(engine), torch.optim.AdamW)
    engine.lr_scheduler.step()
    assert isinstance(engine.lr_scheduler._last_lr, list)
    if stage == 1:  # ZeRO 1-2 and BF16_Optimizer link their fragments to the optimizer state lazily
        assert isinstance(engine.optimizer._hp_optimizer_states_linked, bool)
    if stage == 3:
        assert all(hasattr(p, "ds_tensor") for p in engine.module.parameters())
    assert ds_compat.comm_backend() is not None


def _private_uses(path: Path) -> list[str]:
    """`name` for each private DeepSpeed name `path` uses: a deepspeed submodule imported, an attribute or a
    getattr of one of ds_compat's names, or any `_name` of an engine or optimizer."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed."):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("deepspeed.")]
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            holder = (isinstance(node.value, ast.Name) and node.value.id in HOLDERS) or (
                isinstance(node.value, ast.Attribute) and node.value.attr in HOLDERS
            )
            internal = private or node.attr in OPTIMIZER_INTERNALS
            if node.attr in ds_compat.PRIVATE_NAMES or (internal and holder):
                found.append(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTR_CALLS:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                text = name.value
                private = text.startswith("_") and not text.startswith("__")
                of_holder = any(isinstance(n, ast.Name) and n.id in HOLDERS for n in ast.walk(node.args[0]))
                if text in ds_compat.PRIVATE_NAMES or (private and of_holder):
                    found.append(text)  # getattr(engine, "_name")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.startswith("deepspeed.") and text.replace(".", "").replace("_", "").isalnum():
                found.append(text)  # a module path handed to importlib
            elif text in OPTIMIZER_INTERNALS - {"overflow"}:
                found.append(text)  # a method named to be shadowed
    return found


def test_no_module_but_the_compat_module_touches_deepspeed_internals():
    offenders = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == COMPAT or ".venv" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            offenders += [f"{rel}: {n}" for n in _private_uses(path) if (rel, n) not in EXEMPT]
    assert not offenders, "DeepSpeed internals outside ds_compat.py:\n" + "\n".join(offenders)


def test_the_scan_catches_what_it_is_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import importlib\n"
        "from deepspeed.runtime.zero import stage3\n"
        "def f(engine, optimizer):\n"
        "    engine._step_applied = False\n"
        "    optimizer.overflow = getattr(optimizer, '_global_grad_norm', None)\n"
        "    shadows = ('scaled_global_norm', '_get_norm_groups')\n"
        "    importlib.import_module('deepspeed.comm.torch').build_shm_op = None\n"
        "    return engine.basic_optimizer\n"
    )
    found = set(_private_uses(bad))
    assert found >= {"deepspeed.runtime.zero", "_step_applied", "_global_grad_norm", "deepspeed.comm.torch"}
    assert {"build_shm_op", "basic_optimizer", "overflow", "scaled_global_norm", "_get_norm_groups"} <= found


@pytest.mark.parametrize("stage", [0, 1])
def test_an_engine_state_taken_in_memory_loads_back_and_trains_on_as_before(one_rank, stage):
    from vigil.snapshot import deserialize, serialize, to_host

    engine = _engine(stage)
    x = torch.linspace(-1, 1, 8).reshape(2, 4)

    def step() -> dict[str, torch.Tensor]:
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    step()
    saved = serialize(to_host(ds_compat.engine_state(engine)))  # a snapshot after one step
    expected = [step(), step()]  # the two steps after it (Adam's moments matter)
    ds_compat.load_engine_state(engine, deserialize(saved, ds_compat.checkpoint_safe_globals()))
    assert engine.global_steps == 1
    again = [step(), step()]
    for want, got in zip(expected, again, strict=True):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
