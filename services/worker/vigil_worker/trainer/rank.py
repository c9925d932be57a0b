"""The rank program: `python -m vigil_worker.trainer --launch launch.json --checkpoint-root DIR ...`.

Started by the worker (or by hand) with the torch.distributed environment: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Builds the process group, the model, the DeepSpeed engine, the
data and the telemetry sink, resumes or saves the step-0 checkpoint, then runs `loop.train`.
Without `--nats-url` the rank runs alone: events go nowhere and no command arrives.

Exit codes: 0 done; 2 bad spec or arguments; 3 no usable checkpoint; 1 anything else (traceback in the log).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

EXIT_SPEC, EXIT_CHECKPOINT = 2, 3
log = logging.getLogger("vigil.rank")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vigil_worker.trainer", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--launch", type=Path, help="a LaunchJob event as JSON (what the worker writes)")
    src.add_argument("--spec", type=Path, help="a job spec (YAML or JSON), to run without a scheduler")
    p.add_argument("--job-id", help="with --spec: the job id (default: the spec's name)")
    p.add_argument("--attempt", type=int, default=1, help="with --spec: the attempt number")
    p.add_argument("--checkpoint-root", type=Path, required=True)
    p.add_argument(
        "--cache-dir", type=Path, help="tokenized data cache (default: <checkpoint root>/../cache)"
    )
    p.add_argument("--node", default=os.environ.get("VIGIL_NODE_NAME", "local"))
    p.add_argument("--nats-url", help="publish events and take commands over this NATS; unset: run alone")
    p.add_argument("--resume-from", help="checkpoint directory (overrides the launch's)")
    p.add_argument(
        "--skip-data", type=int, nargs=2, metavar=("START", "END"), help="[start, end) data positions"
    )
    p.add_argument("--bare", action="store_true", help="no Vigil instrumentation: the overhead baseline")
    p.add_argument("--timings", type=Path, help="append timing records (JSON lines) here")
    p.add_argument("--final-weights", type=Path, help="rank 0 saves the full trained weights here at the end")
    return p.parse_args(argv)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    _setup_logging(rank)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from vigil_common.errors import CheckpointError, SpecError
    from vigil_worker.trainer.loop import write_exit_file

    code = 1
    try:
        code = _run(args, rank, world, local_rank, cuda)
    except SpecError as exc:
        log.error("bad job spec: %s", exc)
        code = EXIT_SPEC
    except CheckpointError as exc:
        log.error("checkpoint: %s", exc)
        code = EXIT_CHECKPOINT
    finally:
        write_exit_file(code)  # 1 when an exception escapes (its traceback follows in the log)
    return code


def _run(args: argparse.Namespace, rank: int, world: int, local_rank: int, cuda: bool) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from vigil_common import events as ev
    from vigil_common.spec import parse_spec
    from vigil_worker.trainer import checkpoint as ckpt
    from vigil_worker.trainer.comm import CommTimer
    from vigil_worker.trainer.data import first_position, load_tokens
    from vigil_worker.trainer.ds_config import Hardware, build_config
    from vigil_worker.trainer.faults import FaultInjector
    from vigil_worker.trainer.loop import (
        GuardedAdamW,
        RankContext,
        TrainState,
        choose_checkpoint,
        load_checkpoint,
        record_timing,
        save_checkpoint,
        train,
    )
    from vigil_worker.trainer.model import GPT
    from vigil_worker.trainer.telemetry import BusSink, NullSink, Sink

    # --- what to run --------------------------------------------------------------------------------------
    if args.launch:
        launch = ev.decode(args.launch.read_bytes(), (ev.LaunchJob,))
        assert isinstance(launch, ev.LaunchJob)
        spec, job_id, attempt = launch.spec, str(launch.job_id), launch.attempt
        resume_from, skip_data = launch.resume_from, launch.skip_data
        if launch.world_size != world:
            raise SystemExit(f"WORLD_SIZE={world} but the launch places {launch.world_size} ranks")
    else:
        spec = parse_spec(args.spec.read_text())
        job_id, attempt, resume_from, skip_data = args.job_id or spec.name, args.attempt, None, None
    resume_from = args.resume_from or resume_from
    skip_data = tuple(args.skip_data) if args.skip_data else skip_data
    dims = spec.model.resolved()
    root = args.checkpoint_root.resolve()

    # --- process group ------------------------------------------------------------------------------------
    if cuda:
        index = 0 if torch.cuda.device_count() == 1 else local_rank  # the worker shows each rank one GPU
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        # DeepSpeed's shared-memory op serves inference all-reduces only; skip its JIT build on CPU
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    comm = None if args.bare else CommTimer().install()
    sink: Sink = NullSink()
    if args.nats_url and not args.bare:
        sink = BusSink(args.nats_url, job_id, name=f"rank-{job_id}-{rank}").start()

    # --- model and engine ---------------------------------------------------------------------------------
    torch.manual_seed(spec.train.seed)  # same initial weights on every rank
    model = GPT(dims)
    if cuda:
        props = torch.cuda.get_device_properties(device)
        hw = Hardware("cuda", props.total_memory, bf16_supported=torch.cuda.is_bf16_supported())
    else:
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        hw = Hardware("cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_here)
    plan = build_config(spec.train, world_size=world, n_params=model.num_params(), hw=hw)
    if rank == 0:
        log.info("%s: %.2fM parameters, world %d", job_id, model.num_params() / 1e6, world)
        for reason in plan.reasons:
            log.info("%s", reason)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = GuardedAdamW(
        [
            {"params": decay, "weight_decay": spec.train.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.train.lr,
        betas=(0.9, 0.95),
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=plan.config)
    ckpt.use_safe_loading(engine)
    # WarmupCosineLR starts before step 0 with lr 0; put it at step 0's warm-up value
    engine.lr_scheduler.step(0)

    # --- data and faults ----------------------------------------------------------------------------------
    cache_dir = args.cache_dir or root.parent / "cache"
    tokens = load_tokens(spec.data, cache_dir, vocab_size=dims.vocab_size).tokens
    faults = FaultInjector(spec.faults, rank, root / job_id / ".vigil" / "faults")
    ctx = RankContext(
        job_id=job_id,
        attempt=attempt,
        rank=rank,
        world_size=world,
        node=args.node,
        spec=spec,
        engine=engine,
        tokens=tokens,
        checkpoint_root=root,
        zero_stage=plan.zero_stage,
        precision=plan.precision,
        device=device,
        sink=sink,
        faults=faults,
        comm=comm,
        bare=args.bare,
        timings_path=args.timings,
    )

    # --- resume, or the step-0 checkpoint -------------------------------------------------------------------
    st = TrainState()
    if resume_from:
        m = choose_checkpoint(ctx, resume_from, _step_of_path(resume_from))
        load_checkpoint(ctx, st, m)
        log.info("resumed from %s at step %d", m.path, st.step)
    if skip_data:
        st.skip_windows.append((int(skip_data[0]), int(skip_data[1])))
        st.data_position = first_position(st.data_position, st.skip_windows)
    if not resume_from and not args.bare:
        save_checkpoint(ctx, st)  # so a fault before the first periodic checkpoint can be rolled back

    train(ctx, st)
    record_timing(ctx, {"event": "steps", "seconds": st.step_seconds})

    if args.final_weights:
        _save_full_weights(engine, plan.zero_stage, rank, args.final_weights)
    if rank == 0:
        log.info("done: %d steps", st.step)
    sink.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _step_of_path(path: str) -> int:
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else 2**62


def _save_full_weights(engine: object, zero_stage: int, rank: int, path: Path) -> None:
    import deepspeed
    import torch

    module = engine.module  # type: ignore[attr-defined]
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):
        if rank == 0:
            state = {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
