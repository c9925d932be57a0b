"""The rank program: `python -m vigil_trainer --launch launch.json --checkpoint-root DIR ...`.

Started by the worker (or by hand) with the torch.distributed environment: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Builds the process group, the model, the DeepSpeed engine, the
data and its `vigil.Run` (the SDK every program under Vigil uses: the link to its agent, the step
boundary, commands, checkpoints), resumes or saves the step-0 checkpoint, then runs `loop.train`.
Started by hand (no agent in its environment) the rank runs alone: events go nowhere and no command
arrives. Each setup step is a function (`rank_env`, `read_job`, `init_process_group`, `build_engine`,
`load_data`, `open_run`), so that another program, such as a benchmark's baseline, builds the very
same rank.

Exit codes: 0 done; 2 bad spec or arguments; 3 no usable checkpoint; 4 preempted (after the emergency
checkpoint); 1 anything else (traceback in the log). A rank whose collective failed, started by a worker
that hands over, does not exit: it waits for its job's next attempt in its process (`park`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from vigil import preemption, stack_dump
from vigil.exits import (
    EXIT_CHECKPOINT,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PARKED,
    EXIT_PREEMPTED,
    EXIT_SPEC,
    write_exit_file,
)
from vigil_trainer.observer import NullObserver, Observer

if TYPE_CHECKING:
    import numpy as np
    import torch

    from vigil.elastic import Resize
    from vigil.run import Run
    from vigil.spec import JobSpec
    from vigil_trainer.ds_config import DeepSpeedPlan
    from vigil_trainer.mfu import Peak

log = logging.getLogger("vigil.rank")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vigil_trainer", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--launch", type=Path, help="a LaunchJob event as JSON (what the worker writes)")
    src.add_argument("--spec", type=Path, help="a job spec (YAML or JSON), to run without a scheduler")
    p.add_argument("--job-id", help="with --spec: the job id (default: the spec's name)")
    p.add_argument("--attempt", type=int, default=1, help="with --spec: the attempt number")
    p.add_argument("--checkpoint-root", type=Path, required=True)
    p.add_argument(
        "--cache-dir", type=Path, help="tokenized data cache (default: <checkpoint root>/../cache)"
    )
    p.add_argument(
        "--data-root",
        dest="data_roots",
        type=Path,
        action="append",
        help="a folder data.path and data.tokenizer may name (repeatable; default: the data dir)",
    )
    p.add_argument("--node", default=os.environ.get("VIGIL_NODE_NAME", "local"))
    p.add_argument("--resume-from", help="checkpoint directory (overrides the launch's)")
    p.add_argument(
        "--skip-data", type=int, nargs=2, metavar=("START", "END"), help="[start, end) data positions"
    )
    p.add_argument("--final-weights", type=Path, help="rank 0 saves the full trained weights here at the end")
    p.add_argument(
        "--peak-tflops", type=float, help="the device's peak TFLOP/s for MFU (the worker's VIGIL_PEAK_TFLOPS)"
    )
    return p.parse_args(argv)


# --- setup, one function per step ----------------------------------------------------------------------


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job, from the torch.distributed environment."""

    rank: int
    world: int
    local_rank: int
    cuda: bool


def rank_env() -> RankEnv:
    """Read RANK, WORLD_SIZE and LOCAL_RANK; log with the rank on every line; pick DeepSpeed's CPU
    accelerator where there is no CUDA (before anything imports deepspeed)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    _setup_logging(rank)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return RankEnv(rank, world, local_rank, cuda)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@dataclass(frozen=True)
class Job:
    """What to run: from a LaunchJob (the worker's) or a spec file, with the command line's overrides.
    An elastic job at another size than its spec's trains by `spec` with the accumulation that keeps its
    global batch (`elastic.shape_of`)."""

    spec: JobSpec
    job_id: str
    attempt: int
    resume_from: str | None
    skip_data: tuple[int, int] | None
    shape: Resize


def read_job(args: argparse.Namespace, world: int) -> Job:
    from vigil import events as ev
    from vigil.spec import parse_spec
    from vigil_trainer.elastic import shape_of

    if args.launch:
        launch = ev.decode(args.launch.read_bytes(), (ev.LaunchJob,))
        assert isinstance(launch, ev.LaunchJob)
        if launch.world_size != world:
            raise SystemExit(f"WORLD_SIZE={world} but the launch places {launch.world_size} ranks")
        spec, job_id, attempt = launch.spec, str(launch.job_id), launch.attempt
        resume_from, skip_data = launch.resume_from, launch.skip_data
    else:
        spec = parse_spec(args.spec.read_text())
        job_id, attempt, resume_from, skip_data = args.job_id or spec.name, args.attempt, None, None
    skip = tuple(args.skip_data) if args.skip_data else skip_data
    spec, shape = shape_of(spec, world)
    return Job(
        spec=spec,
        shape=shape,
        job_id=job_id,
        attempt=attempt,
        resume_from=args.resume_from or resume_from,
        skip_data=(int(skip[0]), int(skip[1])) if skip else None,
    )


def init_process_group(env: RankEnv) -> torch.device:
    """The process group (NCCL on GPU, gloo on CPU), its store listening on MASTER_ADDR only (the SDK's
    `init_process_group`; DeepSpeed then takes the group as it is); returns this rank's device."""
    import deepspeed
    import torch

    from vigil.integrations import ds_compat
    from vigil.rendezvous import init_process_group as init_group

    if env.cuda:
        index = 0 if torch.cuda.device_count() == 1 else env.local_rank  # the worker shows each rank one GPU
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        ds_compat.skip_shm_build()
    init_group("nccl" if env.cuda else "gloo", timeout_s=600)
    deepspeed.init_distributed(dist_backend="nccl" if env.cuda else "gloo", timeout=timedelta(minutes=10))
    return device


def build_engine(spec: JobSpec, env: RankEnv, device: torch.device) -> tuple[Any, DeepSpeedPlan]:
    """The model, its optimizer and the DeepSpeed engine around them, configured for this hardware;
    returns the engine and the configuration plan (ZeRO stage, precision, and why)."""
    import deepspeed
    import torch

    from vigil.integrations import ds_compat
    from vigil_trainer import checkpoint as ckpt
    from vigil_trainer.compile import compile_engine
    from vigil_trainer.ds_config import Hardware, build_config
    from vigil_trainer.model import GPT

    torch.manual_seed(spec.train.seed)  # same initial weights on every rank
    model = GPT(spec.model.resolved())
    if env.cuda:
        props = torch.cuda.get_device_properties(device)
        hw = Hardware("cuda", props.total_memory, bf16_supported=torch.cuda.is_bf16_supported())
    else:
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        hw = Hardware("cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_here)
    plan = build_config(spec.train, world_size=env.world, n_params=model.num_params(), hw=hw)
    optimizer = model.configure_optimizers(spec.train.weight_decay, spec.train.lr, betas=(0.9, 0.95))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=plan.config)
    if plan.autocast and not engine.torch_autocast_enabled():  # a DeepSpeed without `torch_autocast`
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} ignores the torch_autocast section: bf16 without ZeRO "
            "would train in fp32; use a DeepSpeed that has it (0.19 does), or set train.zero_stage: 1"
        )
    if env.world == 1 and plan.zero_stage == 0:
        # one rank has nothing to reduce (under ZeRO the reduction also fills its gradient partitions)
        ds_compat.no_backward_allreduce(engine)
    compile_engine(engine, spec.train.compile, device, plan.zero_stage)
    ckpt.use_safe_loading(engine)
    # WarmupCosineLR starts before step 0 with lr 0; put it at step 0's warm-up value
    engine.lr_scheduler.step(0)
    return engine, plan


def open_run(job: Job, env: RankEnv, node: str, checkpoint_root: Path) -> Run:
    """This rank's `vigil.Run`, as `vigil.init()` makes one for any program: linked to the agent that
    started it (its environment says where, with the token the agent minted), or inert when the rank runs
    alone; the checkpoint to resume from and the data to skip are the launch's."""
    from vigil.link import NullLink, connect_from_env
    from vigil.run import Identity, Run

    link = connect_from_env(job.job_id, job.attempt, env.rank) or NullLink()
    identity = Identity(job.job_id, job.attempt, env.rank, env.world, env.local_rank, node)
    return Run(
        identity,
        link,
        checkpoint_root=checkpoint_root,
        keep=job.spec.checkpoint.keep,
        resume_from=Path(job.resume_from) if job.resume_from else None,
        skip_windows=[job.skip_data] if job.skip_data else None,
        spec=job.spec,
    )


def device_peak(device: torch.device, precision: str, override: float | None = None) -> Peak | None:
    """The peak MFU is measured against: `override` (TFLOP/s: `--peak-tflops`, which the worker sets from
    VIGIL_PEAK_TFLOPS), else the table for this GPU, else (a CPU, or a GPU not in the table) this
    process's measured matmul rate."""
    import torch

    from vigil_trainer.mfu import measure_peak, peak_flops

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured = None
    if override is None and peak_flops(name, precision, override_tflops=None) is None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        measured = measure_peak(device, dtype)
    return peak_flops(name, precision, override_tflops=override, measured_flops=measured)


def load_data(args: argparse.Namespace, spec: JobSpec) -> np.ndarray:
    """The tokenized training data (tokenized once into the cache, memory-mapped after)."""
    from vigil_trainer.data import load_tokens

    cache_dir = args.cache_dir or args.checkpoint_root.resolve().parent / "cache"
    roots = args.data_roots or [args.checkpoint_root.resolve().parent]  # the data dir
    return load_tokens(spec.data, cache_dir, vocab_size=spec.model.resolved().vocab_size, roots=roots).tokens


# --- the program ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, *, observer: Observer | None = None) -> int:
    """Run one rank; `observer` (default: none) hears each step's and each rollback's timing. A rank whose
    collective failed may wait in this process for its job's next attempt and run it here (`park`)."""
    from vigil.handover import become_rank
    from vigil_trainer import park

    stack_dump.install()  # the worker's fallback when py-spy cannot read this process
    preemption.listen_early()  # a notice during the imports is kept, not the end of the process
    while True:
        code, parked = _attempt(argv, observer or NullObserver())
        if parked is None:
            return code
        handed = park.wait_for_next_attempt()
        if handed is None:
            write_exit_file(EXIT_ERROR)
            return EXIT_ERROR
        launch, log_fd = handed
        become_rank(launch, log_fd)
        argv = launch["argv"]
        sys.argv = [sys.argv[0], *argv]


def _attempt(argv: list[str] | None, observer: Observer) -> tuple[int, str | None]:
    """One attempt's rank: its exit code, and why it parked (None: it did not)."""
    from vigil.errors import CheckpointError, SpecError
    from vigil_trainer import park

    args = parse_args(argv)
    env = rank_env()
    code, parked = EXIT_ERROR, None
    try:
        code = _run(args, env, observer)
    except SpecError as exc:
        log.error("bad job spec: %s", exc)
        code = EXIT_SPEC
    except CheckpointError as exc:
        log.error("checkpoint: %s", exc)
        code = EXIT_CHECKPOINT
    except Exception as exc:
        if not park.may_park(exc):
            raise
        log.exception("a collective failed")
        code, parked = EXIT_PARKED, f"{type(exc).__name__}: {exc}"
    finally:
        if parked is None:
            write_exit_file(code)  # 1 when an exception escapes (its traceback follows in the log)
    return code, parked


def _run(args: argparse.Namespace, env: RankEnv, observer: Observer) -> int:
    from vigil_trainer import park

    job = read_job(args, env.world)
    root = args.checkpoint_root.resolve()
    run = open_run(job, env, args.node, root)  # the rank's session with Vigil, as any program's
    try:
        with park.cuttable():  # a peer cut off: the worker says so, and the collective fails now
            return _train(args, env, observer, job, root, run)
    except Exception as exc:
        if park.may_park(exc):
            run.close()  # its events out, its link closed, its snapshot's thread done (or this rank hangs)
            park.begin(f"{type(exc).__name__}: {exc}")  # the worker may hand the next attempt over now
        raise


def _train(args: argparse.Namespace, env: RankEnv, observer: Observer, job: Job, root: Path, run: Run) -> int:
    import torch.distributed as dist

    from vigil.identity import first_position
    from vigil.integrations import ds_compat
    from vigil_trainer import snapshots
    from vigil_trainer.checkpoint_collective import load_checkpoint, save_checkpoint
    from vigil_trainer.clock import Clock
    from vigil_trainer.comm import CommTimer
    from vigil_trainer.compile import compiled_graphs, should_compile
    from vigil_trainer.context import RankContext, TrainState
    from vigil_trainer.faults import FaultInjector
    from vigil_trainer.loop import train
    from vigil_trainer.mfu import flops_per_token

    run.notice.install()  # from now on a SIGUSR1 is a preemption notice

    # --- process group and comm timer ---------------------------------------------------------------------
    device = init_process_group(env)
    clock = Clock(cuda=env.cuda)
    comm = CommTimer(clock).install()

    # --- model and engine ---------------------------------------------------------------------------------
    engine, plan = build_engine(job.spec, env, device)
    compiled = should_compile(job.spec.train.compile, device, plan.zero_stage)
    fpt = flops_per_token(job.spec.model.resolved())
    peak = device_peak(device, plan.precision, args.peak_tflops)
    if env.rank == 0:
        n_params = engine.module.num_params()
        log.info("%s: %.2fM parameters, world %d", job.job_id, n_params / 1e6, env.world)
        for reason in plan.reasons:
            log.info("%s", reason)
        log.info(
            "MFU: %.3g FLOPs per token against %s",
            fpt,
            f"{peak.flops / 1e12:.3g} TFLOP/s ({peak.source})" if peak else "no known peak (no MFU)",
        )

    # --- data and faults ----------------------------------------------------------------------------------
    ctx = RankContext(
        spec=job.spec,
        engine=engine,
        tokens=load_data(args, job.spec),
        zero_stage=plan.zero_stage,
        precision=plan.precision,
        device=device,
        faults=FaultInjector(job.spec.faults, env.rank, root / job.job_id / ".vigil" / "faults"),
        run=run,
        comm=comm,
        clock=clock,
        observer=observer,
        flops_per_token=fpt,
        peak=peak,
        shape=job.shape,
    )
    if job.shape.resized and env.rank == 0:
        log.warning(
            "elastic: %d ranks (the spec's %d): %d micro-steps each, the same global batch",
            env.world,
            job.spec.resources.world_size,
            job.shape.grad_accum,
        )

    # --- how a rollback loads in place; resume (the newest whole in-memory snapshot, else the disk) ---------
    run.on_rollback(lambda path: load_checkpoint(ctx, path))
    snapshots.register(ctx)
    st = TrainState()
    position = 0
    got = run.restore(safe_globals=ds_compat.checkpoint_safe_globals()) if run.snapshotting else None
    if got is not None:
        if got.resized_from is not None:  # elastic: every former rank's, re-partitioned to this size
            snapshots.load_resized_state(ctx, got.state)
        else:
            snapshots.load_rank_state(ctx, got.state)
        st.step, position = got.step, got.data_position
        log.warning(
            "resumed from the in-memory snapshot of step %d (relaunched from %s)", got.step, job.resume_from
        )
    elif (m := run.resume_checkpoint()) is not None:
        load_checkpoint(ctx, m.path)
        st.step, position = m.step, m.data_position
        log.info("resumed from %s at step %d", m.path, st.step)
    st.data_position = first_position(position, run.skip_windows)
    if not job.resume_from:
        save_checkpoint(ctx, st)  # so a fault before the first periodic checkpoint can be rolled back

    t_train, first_step = time.perf_counter(), st.step
    train(ctx, st)
    if (snapshot_cost := run.snapshot_cost) is not None:
        observer.on_snapshots(snapshot_cost[0], st.step - first_step, snapshot_cost[1])
    if compiled:
        # the compile is paid once per rank start (at its first step, and once per new micro-batch shape)
        log.info(
            "torch.compile: %d graph(s) built in this process; %d steps in %.1f s",
            compiled_graphs(),
            st.step,
            time.perf_counter() - t_train,
        )
    if st.preempted:  # the emergency checkpoint is on disk: flush its event, then all ranks exit together
        run.close()
        dist.barrier()
        dist.destroy_process_group()
        log.warning("preempted: exiting after the emergency checkpoint of step %d", st.step)
        return EXIT_PREEMPTED

    if args.final_weights:
        _save_full_weights(engine, plan.zero_stage, env.rank, args.final_weights)
    if env.rank == 0:
        log.info("done: %d steps", st.step)
    run.done()  # the job is done: its copies in this node's memory go
    run.close()
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_OK


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


def exit_process(code: int) -> NoReturn:
    """End the rank with `code` once `main` returned: the exit handlers run and the output is flushed,
    then the process ends without the interpreter's teardown. Tearing down torch, DeepSpeed and inductor
    took 1.3-3.4 s on a CPU after the job's last step (every rank's exit, the job's end), and a thread
    still inside torch by then aborted the process (pytorch#179291)."""
    atexit._run_exitfuncs()  # what the interpreter runs first: Run.close, logging's flush, torch's
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
