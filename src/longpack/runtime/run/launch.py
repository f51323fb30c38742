"""``longpack train --nproc N``: spawn N local processes running :func:`~longpack.runtime.run.train.train`, after
checking in the parent what can be checked before spawning (the model fits, the plan and its first step, the
held-out rows); a failed rank's one line is reported once, the cause before the peers that saw it."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import Any

import torch

from ...runspec import say
from ..dist import free_port, leave
from ..kernel.data import EpochSource
from ..kernel.step import check_step
from .failure import PeerLost, one_line, peer_lost, watch
from .fit import check_fits
from .resume import announce, begin, warner
from .run_plan import LAUNCHED, held_out, load_source, model_spec, plan_stream, sharded, with_digest, zero_stage
from .startup import Phases
from .step_log import show
from .train import DTYPES, Prepared, check_folders, first_records, train
from .train_args import TrainArgs

__all__ = ["launch"]


def _worker(rank: int, world: int, port: int, args_dict: dict[str, Any], errors: str,
            prepared: Prepared | None = None) -> None:
    """One spawned rank: a user error (or a rank that stopped answering) becomes one line in ``errors/RANK`` and
    exit code 2, for :func:`launch` to report once."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      LONGPACK_HEARTBEAT=os.path.join(errors, f"{rank}.step"))
    args = TrainArgs.from_dict(args_dict)
    try:
        train(args, prepared=prepared)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # leave together: tearing gloo down under a peer's feet can abort it
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (every error, torch's BaseException ones too, becomes one line)
        lost = isinstance(exc, PeerLost) or (isinstance(exc, RuntimeError) and peer_lost(exc))
        with open(os.path.join(errors, f"{rank}.peer" if lost else str(rank)), "w") as f:
            f.write(one_line(exc))
        sys.exit(2)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    leave()  # the group is gone; flush and exit without interpreter teardown (gloo's race there)


def launch(args: TrainArgs, nproc: int) -> None:
    """Spawn ``nproc`` local processes (gloo on CPU) running :func:`train`; rank 0 prints."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec, prepared = _before_spawning(args, nproc, device)
    for record in first_records(args, nproc, device.type, prepared.stream, prepared.source, prepared.resumed,
                                local=nproc):
        show(args, record)  # rank 0's first lines, said before the ranks start
    os.environ[LAUNCHED] = "1"  # what the ranks would say of reading the rows and planning is said
    try:
        if nproc == 1:
            train(args, prepared=prepared)
            if torch.distributed.is_initialized():  # the group of one FSDP2 ran on: closed, not left to exit's
                torch.distributed.destroy_process_group()
            return
        _spawn(args, nproc, device, spec, prepared)
    finally:
        os.environ.pop(LAUNCHED, None)


def _before_spawning(args: TrainArgs, nproc: int, device: torch.device) -> tuple[Any, Prepared]:
    """Fail fast in the parent with a clear message, before allocating or spawning anything: the model fits, the
    rows read (once, here: the ranks map the token store this builds), the plan and its first step, the held-out
    rows. Returns the model's shapes and what was read and planned, for ranks that share this memory."""
    clock = Phases()
    spec = model_spec(args)
    check_fits(spec, world=nproc, local=nproc, fsdp=sharded(args, nproc), dtype=DTYPES[args.model.dtype], device=device,
               per_layer=zero_stage(args, nproc, spec) == 3)
    check_folders(args, spec, nproc)
    source = load_source(args, spec.vocab, say=say)
    args = with_digest(args, source)
    clock.mark("data")
    if args.run.epochs > 1:  # the plan's samples are every epoch's copies of the rows (as train makes them)
        source = EpochSource(source, len(source.lengths))  # type: ignore[attr-defined]
    stream, cost = plan_stream(args, nproc, source, spec=spec, note=say)
    resumed = begin(args, nproc, stream, warner(0))  # a resume: its checkpoint checked, the stream started there
    announce(resumed, args, nproc, stream, say)
    if args.data.eval_data:
        held_out(args, nproc, spec, say=say)
    if stream.made < len(stream):  # the run's first step too: a layout it cannot run is refused before spawning
        stream.next_step()
        check_step(stream.plan, stream.made - 1)
    clock.mark("plan")
    return spec, Prepared(source, stream, cost, clock, resumed)


def _spawn(args: TrainArgs, nproc: int, device: torch.device, spec: Any, prepared: Prepared) -> None:
    import tempfile

    import torch.multiprocessing as mp

    # On the host the ranks are forked from this process, which has imported torch and the model's class already
    # (seconds each rank would spend again); CUDA cannot be used in a forked child, so GPU ranks are spawned.
    method = "fork" if device.type == "cpu" else "spawn"
    if method == "fork":
        from .hf_model import preload

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a fast tokenizer's threads do not survive a fork
        preload(spec, args.model.path)
        prepared.clock.mark("model")  # the model's class imported, once for every rank
    with tempfile.TemporaryDirectory(prefix="longpack-errors-") as errors:
        # forked ranks share the launcher's memory, and with it its rows and plan; spawned ones read and plan again
        shared = prepared if method == "fork" else None
        ctx = mp.start_processes(_worker, args=(nproc, free_port(), asdict(args), errors, shared), nprocs=nproc,
                                 join=False, start_method=method)
        failure = watch(ctx.processes, errors, args.parallel.timeout)
        if failure:
            raise ValueError(failure)
    sys.stdout.flush()
