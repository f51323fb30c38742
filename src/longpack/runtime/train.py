"""Training orchestrator: the user's rows and checkpoint, planned once (deterministically, on every rank), run.

Per run: rows from ``--data`` (or synthetic tokens of a ``--workload``), the model from ``--model-path`` (or a
random-init preset) on transformers' classes with the longpack attention (runtime/engine.py), FSDP2 over every
rank unless ``fsdp=False`` (runtime/parallelize.py), AdamW. Per step and rank: the
:class:`~longpack.runtime.data.PlanSampler` gives this rank's micro-batches; each is forwarded and backpropagated
with exact global weights over the step's real targets (runtime/loss.py), checkpointing the layers its plan says;
gradients are summed over all ranks (FSDP2's reduce-scatter, or one all-reduce without it); AdamW steps. Every
``checkpoint_every`` steps every rank writes its shard (runtime/checkpoint.py); ``resume`` continues at the exact
next step. Rank 0 logs a data line (rows read, empty rows dropped, samples dropped or truncated by the over-long
policy, with their tokens and targets), one line (or JSON object) per step — loss, targets, tokens, time, tokens/s,
measured and predicted memory per rank (runtime/memory.py) — and a summary. ``output_dir`` receives a
consolidated Hugging Face checkpoint.

With ``pp`` > 1 the world is pp stages of dp·cp plan ranks: each process keeps one stage's decoder layers and runs
its plan rank's micro-batches in the state-aware 1F1B order (runtime/pipeline.py); gradients are summed within
the stage (and a tied embedding between the first and last stage), and each step's log adds the stages' busy and
idle seconds and the measured bubble beside the simulated one.

Launch: ``torchrun --nproc-per-node N -m longpack.cli train ...`` (gloo on CPU, nccl on GPU), or
``longpack train --nproc N`` which spawns the N processes itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .. import jobs
from ..cost import CostModel
from ..model import ModelSpec, get_model
from ..plan import Plan, step_dict
from ..planners.stream import PlanStream
from ..progress import Meter
from . import checkpoint
from .accounting import chained_samples, data_report
from .ahead import PlanAhead
from .context_parallel import CPGroups
from .data import EpochSource, PlanSampler, Source, SyntheticCorpus
from .dist import DistContext, all_reduce_sum, free_port, init_distributed, leave
from .evaluate import Evaluation
from .fit import check_fits
from .memory import predicted_bytes
from .metrics import MetricsLog
from .optim import build_scheduler, clip_gradients, warmup_of
from .pipeline import pipeline_phrase
from .step import check_step
from .train_step import run_step

__all__ = ["TrainArgs", "train", "build_plan", "plan_stream", "launch", "run_step"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    planner: str = "isf"
    run: jobs.RunSpec = field(default_factory=lambda: jobs.RunSpec(workload="tiny-longtail", model="tiny-llama",
                                                                    hardware="cpu", bucket_size=4096,
                                                                    global_batch=32))
    data: str | None = None
    mask_column: str | None = None
    tokenizer: str | None = None
    model_path: str | None = None
    output_dir: str | None = None
    overwrite_output_dir: bool = False
    log_dir: str | None = None  # metrics.jsonl (+ TensorBoard events); default: output_dir
    eval_data: str | None = None
    eval_every: int = 0  # steps between held-out evaluations (0: at the end only, with eval_data)
    report_to: str = ""  # comma-separated: wandb
    fsdp: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr: float = 0.0
    max_grad_norm: float = 1.0
    loss: str = "token_mean"
    dtype: str = "float32"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_if_present: bool = False
    json_log: bool = False
    threads: int | None = None
    timeout: float = 600.0
    pp: int = 1
    plan_ahead: int = 4
    data_content: str | None = None  # the rows' digest (rows.TokenRows.digest), set once they are loaded

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every}: must be >= 0 (0: never)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every} needs --checkpoint-dir DIR to write to")
        if (self.resume or self.resume_if_present) and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the run to continue")
        if self.pp < 1:
            raise ValueError(f"--pp {self.pp}: must be >= 1")
        if self.plan_ahead < 0:
            raise ValueError(f"--plan-ahead {self.plan_ahead}: must be >= 0 (0: plan the whole run before step 0)")
        if not self.timeout > 0:
            raise ValueError(f"--timeout {self.timeout}: must be > 0 seconds")
        from .optim import SCHEDULERS, warmup_of

        if self.lr_scheduler not in SCHEDULERS:
            raise ValueError(f"--lr-scheduler {self.lr_scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
        warmup_of(1, self.warmup_steps, self.warmup_ratio)
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr:g}: must be in [0, --lr {self.lr:g}]")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm {self.max_grad_norm}: must be >= 0 (0: no clipping)")
        if not self.weight_decay >= 0:
            raise ValueError(f"--weight-decay {self.weight_decay}: must be >= 0")
        from .metrics import REPORTERS

        for name in filter(None, self.report_to.split(",")):
            if name not in REPORTERS:
                raise ValueError(f"--report-to {name!r}: choose {', '.join(REPORTERS)} (metrics.jsonl and "
                                 "TensorBoard are always written with a log folder)")
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"--report-to {name}: the {name} package is not installed; pip install {name}")
        if self.eval_every < 0 or (self.eval_every and not self.eval_data):
            raise ValueError(f"--eval-every {self.eval_every}: give a number of steps >= 1 with --eval-data FILE")


def load_source(args: TrainArgs, vocab: int) -> Source:
    """The user's rows (``--data``) or the synthetic corpus of a built-in workload."""
    if args.data is None:
        return SyntheticCorpus(vocab, seed=args.run.seed)
    from ..rows import load_rows

    return load_rows(args.data, mask_column=args.mask_column, tokenizer=args.tokenizer, vocab=vocab)


def model_spec(args: TrainArgs) -> ModelSpec:
    """The shapes the cost model plans with: the checkpoint's config, or the preset."""
    if args.model_path is None:
        return get_model(args.run.model)
    from transformers import AutoConfig

    from .hf_model import spec_of

    return spec_of(AutoConfig.from_pretrained(args.model_path, local_files_only=True))


def plan_stream(args: TrainArgs, world: int, source: Source | None = None, spec: ModelSpec | None = None,
                note: Any = jobs.say) -> tuple[PlanStream, CostModel]:
    """The run's plan as a stream (its header now, each step when asked), which every rank makes identically (same
    inputs, same seed), and its cost model; ``note``: where notes for the user go (one process says them)."""
    run = args.run
    if world % args.pp:
        raise ValueError(f"--pp {args.pp} must divide the number of processes ({world})")
    world //= args.pp  # the plan's ranks: one pipeline's stages run each plan rank's micro-batches
    if run.cp < 1 or world % run.cp:
        raise ValueError(f"--cp {run.cp} must divide the number of processes per pipeline stage ({world})")
    run = replace(run, dp=world // run.cp, pp=args.pp)
    spec = spec or model_spec(args)
    if args.data is not None:
        source = source if source is not None else load_source(args, spec.vocab)
        lengths, default_max_len = source.lengths, None  # type: ignore[attr-defined]
        run = replace(run, workload=None, lengths_file=args.data)
    else:
        lengths, default_max_len = jobs.load_workload(run)
    cost = jobs.build_cost(run, spec)
    try:
        return jobs.plan_stream(args.planner, lengths, run, cost, default_max_len, note=note), cost
    except ValueError as exc:  # a sample named by its row in the user's file
        raise (source.located(exc) if hasattr(source, "located") else exc) from None


def build_plan(args: TrainArgs, world: int, source: Source | None = None, spec: ModelSpec | None = None,
               note: Any = jobs.say) -> tuple[Plan, CostModel]:
    """The whole plan (:func:`plan_stream` planned up front, every step checked runnable) and its cost model."""
    stream, cost = plan_stream(args, world, source, spec, note)
    ahead = PlanAhead(stream, 0, check=check_step)
    if len(ahead):
        ahead.wait(len(ahead) - 1)  # raises the first step that failed
    return replace(stream.plan, steps=tuple(stream.plan.steps)), cost


def _evaluation(args: TrainArgs, world: int, spec: ModelSpec) -> Evaluation:
    """The held-out rows of ``--eval-data`` and their plan: one step of all of them (runtime/evaluate.py)."""
    from ..rows import load_rows

    rows = load_rows(args.eval_data, mask_column=args.mask_column, tokenizer=args.tokenizer, vocab=spec.vocab)
    run = replace(args.run, global_batch=len(rows.ids), steps=None, epochs=1)
    plan, _ = build_plan(replace(args, data=args.eval_data, run=run), world, source=rows, spec=spec, note=None)
    return Evaluation(plan, rows)


def _model(args: TrainArgs, spec: ModelSpec, ctx: DistContext, plan: Plan, stage: int = 0) -> torch.nn.Module:
    from .hf_model import build, check_supported, load

    dtype = DTYPES[args.dtype]
    sharded_bf16 = dtype == torch.bfloat16 and _fsdp(args, ctx)
    param_dtype = torch.float32 if sharded_bf16 else dtype  # FSDP2 keeps fp32 shards and computes in bf16
    model = load(args.model_path, param_dtype) if args.model_path else build(spec, args.run.seed, param_dtype)
    check_supported(model, max((plan.effective_length(s) for s in plan.lengths), default=1))
    if args.pp > 1:
        from .pipeline import split_model

        split_model(model, stage, args.pp)
    model.to(ctx.device).train()
    if _fsdp(args, ctx):
        from .parallelize import parallelize

        parallelize(model, ctx.world, ctx.device, dtype, stages=args.pp)
    return model


def _fsdp(args: TrainArgs, ctx: DistContext) -> bool:
    """FSDP2 runs when asked and there is more than one process per pipeline stage to shard over."""
    return args.fsdp and ctx.world // args.pp > 1


def _peer_lost(exc: BaseException) -> bool:
    """True for a collective that failed because a peer stopped answering (timeout, closed connection)."""
    text = str(exc).lower()
    return any(w in text for w in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


class PeerLost(ValueError):
    """A collective failed because another rank stopped answering: a consequence; the cause is that rank's."""


def _step_failure(exc: Exception, step: int, ctx: DistContext, timeout: float) -> Exception:
    """The error a failed step ends the run with: :class:`PeerLost` saying what the wire showed (no answer within
    the timeout, or a closed connection), or ``exc`` noted with its step."""
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    if ctx.distributed and isinstance(exc, RuntimeError) and _peer_lost(exc):
        what = (f"the other ranks did not answer within --timeout {timeout:g} s (a rank froze)"
                if "timed out" in text.lower() or "timeout" in text.lower()
                else "another rank closed its connection (it stopped or died; its own error names the cause)")
        return PeerLost(f"step {step}: {what}: {text}")
    exc.add_note(f"step {step}")
    return exc


def one_line(exc: BaseException) -> str:
    """A rank's error in one line: the step it happened at, the exception's type unless it is a user error
    (ValueError, OSError), and its first line."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if not isinstance(exc, (ValueError, OSError)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    steps = [n for n in getattr(exc, "__notes__", []) if n.startswith("step ")]
    return f"{steps[0]}: {text}" if steps else text


def _emit(ctx: DistContext, args: TrainArgs, record: dict[str, Any]) -> None:
    if ctx.rank != 0:
        return
    if args.json_log:
        print(json.dumps(record), flush=True)
    elif "summary" in record:
        s = record["summary"]
        print(f"done: {s['steps']} steps, {s['tokens_per_second']:.0f} tokens/s, final loss {s['final_loss']:.4f}, "
              f"waited {s['planner_wait_seconds']:.2f} s on the planner (planning took {s['planning_seconds']:.2f} s)"
              + (f", saved {s['output_dir']}" if s.get("output_dir") else ""), flush=True)
    elif "data" in record:
        print("data: " + record["data"]["line"], flush=True)
    else:
        mem = record["memory"]
        print(f"step {record['step']:5d}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  grad norm "
              f"{record['grad_norm']:.3g}  targets {record['targets']:6d}  tokens "
              f"{record['tokens']:6d}  {record['step_seconds']:.3f} s  {record['tokens'] / record['step_seconds']:.0f}"
              f" tokens/s  mem {max(mem['measured_bytes']) / 2**20:.1f} MiB measured / "
              f"{max(mem['predicted_bytes']) / 2**20:.1f} predicted ({mem['what']})  waited "
              f"{record['planner_wait_seconds']:.3f} s on the planner" + pipeline_phrase(record)
              + (f"  eval loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""),
              flush=True)


def _rank_prediction(plan: Plan, step: int, rank: int, cost: CostModel, activations_only: bool) -> float:
    """The cost model's peak bytes on ``rank`` in ``step``: its largest micro-batch at that one's checkpointing."""
    st = plan.steps[step]
    replica, cp_rank = st.position(rank)
    cp = st.replica_cp(replica)
    best = 0.0
    for mb in st.replicas[replica].micro_batches:
        tokens = mb.rank_tokens(cp)[cp_rank] if mb.pieces else 0
        prefix = max((p.start for p in mb.pieces), default=0)
        best = max(best, predicted_bytes(cost, tokens, mb.ckpt_layers, prefix, activations_only=activations_only))
    return best


def settings(args: TrainArgs, world: int) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint it continues (every setting but --steps), by flag."""
    r = args.run
    return {"planner": args.planner, "data": args.data, "mask-column": args.mask_column, "tokenizer": args.tokenizer,
            "model-path": args.model_path, "model": r.model, "workload": r.workload, "lengths": r.lengths_file,
            "samples": r.samples, "seed": r.seed, "epochs": r.epochs, "global-batch": r.global_batch, "cp": r.cp,
            "nproc": world,
            "bucket-size": r.bucket_size, "max-len": r.max_len, "overlong": r.overlong, "opt": dict(r.options),
            "ckpt-layers": r.ckpt_layers, "hardware": r.hardware, "loss": args.loss, "lr": args.lr,
            "weight-decay": args.weight_decay, "dtype": args.dtype, "fsdp": args.fsdp, "pp": args.pp,
            "lr-scheduler": args.lr_scheduler, "warmup-steps": args.warmup_steps, "warmup-ratio": args.warmup_ratio,
            "min-lr": args.min_lr, "max-grad-norm": args.max_grad_norm, "data-content": args.data_content}


def _fingerprint(plan: Plan, n: int, cache: list[dict[str, Any]]) -> str:
    """Fingerprint of the plan's first ``n`` steps (planned already); ``cache``: their JSON, grown as steps run."""
    cache.extend(step_dict(st) for st in plan.steps[len(cache):n])
    return checkpoint.steps_fingerprint(cache[:n])


def _check_resumable(meta: dict[str, Any], args: TrainArgs, world: int, ahead: PlanAhead,
                     cache: list[dict[str, Any]]) -> float:
    """Refuse a resume whose settings changed (naming the flag) or whose plan does not begin with the steps done;
    returns the seconds waited for those steps to be planned again."""
    where = f"--resume: the checkpoint {meta['path']}"
    for flag, now in settings(args, world).items():
        then = meta.get("settings", {}).get(flag, now)
        if then != now and flag == "data-content":
            raise ValueError(f"{where} was trained on other rows: the tokens or labels of --data {args.data} differ "
                             f"from that run's (digest {now} vs {then}); resume with the same data")
        if then != now:
            raise ValueError(f"{where} was made with --{flag} {then!r}, this run has {now!r}; resume with the same "
                             f"--{flag} (only --steps may change)")
    done = int(meta["step"])
    decays = args.lr_scheduler != "constant" or args.warmup_ratio
    if decays and meta.get("total_steps", len(ahead)) != len(ahead):
        raise ValueError(f"{where} was a run of {meta['total_steps']} steps and its --lr-scheduler "
                         f"{args.lr_scheduler} (or --warmup-ratio) spans them; resume with the same --steps")
    if done > len(ahead):
        raise ValueError(f"{where} has trained {done} steps; --steps {len(ahead)} is fewer")
    waited = ahead.wait(done - 1) if done else 0.0  # the steps already trained are planned again, and compared
    if _fingerprint(ahead.plan, done, cache) != meta["plan"]:
        raise ValueError(f"{where}: this run's plan does not begin with the {done} steps already trained (planner "
                         f"{args.planner} lays out the whole run at once); resume with the same --steps")
    return waited


def _resume(args: TrainArgs, model: torch.nn.Module, opt: torch.optim.Optimizer, sampler: PlanSampler,
            ctx: DistContext, ahead: PlanAhead, cache: list[dict[str, Any]], first_layer: int | None = None,
            sched: Any = None) -> float:
    """Continue from the latest checkpoint when asked; the seconds waited on the planner meanwhile."""
    if not (args.resume or args.resume_if_present) or not args.checkpoint_dir:
        return 0.0
    warn = (lambda line: print(f"longpack: warning: {line}", file=sys.stderr, flush=True)) if ctx.rank == 0 else None
    meta = checkpoint.load_latest(args.checkpoint_dir, model=model, optimizer=opt, warn=warn, first_layer=first_layer)
    if meta is None:
        if args.resume_if_present:
            return 0.0
        raise ValueError(f"--resume: no checkpoint in {args.checkpoint_dir}; check the folder, or use "
                         "--resume-if-present to start at step 0 when there is none")
    waited = _check_resumable(meta, args, ctx.world, ahead, cache)
    sampler.load_state_dict(meta["sampler"])
    if sched is not None and "scheduler" in meta:
        sched.load_state_dict(meta["scheduler"])
    return waited


def _memory(plan: Plan, step: int, cost: CostModel, ctx: DistContext, measured_cpu: float,
            prank: int) -> dict[str, Any]:
    on_gpu = ctx.device.type == "cuda"
    both = torch.zeros((2, ctx.world), dtype=torch.float64)
    both[0, ctx.rank] = float(torch.cuda.max_memory_allocated(ctx.device)) if on_gpu else measured_cpu
    both[1, ctx.rank] = _rank_prediction(plan, step, prank, cost, activations_only=not on_gpu)
    both = both.to(ctx.device)  # one collective on the device, read once
    all_reduce_sum([both])
    measured, predicted = both.cpu()
    return {"what": "cuda max_memory_allocated" if on_gpu else "activations held for backward",
            "measured_bytes": [int(x) for x in measured.tolist()],
            "predicted_bytes": [int(x) for x in predicted.tolist()]}


def train(args: TrainArgs, ctx: DistContext | None = None) -> dict[str, Any]:
    """Run the plan; returns {"steps": [per-step records], "summary": {...}, "data": {...}, "model": model}."""
    ctx = ctx or init_distributed(timeout=args.timeout)
    if ctx.device.type == "cuda" and args.dtype != "bfloat16":
        raise ValueError(f"--dtype {args.dtype} on CUDA: the attention (FlashAttention varlen) runs in bfloat16; "
                         "use --dtype bfloat16 (parameters and optimizer state stay float32)")
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_spec(args)
    check_fits(spec, world=ctx.world, local=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               fsdp=_fsdp(args, ctx), dtype=DTYPES[args.dtype], device=ctx.device)
    source = load_source(args, spec.vocab)
    if hasattr(source, "digest") and args.checkpoint_dir:  # what a checkpoint records, and a resume compares
        args = replace(args, data_content=source.digest())
    if args.run.epochs > 1:  # the plan's samples are every epoch's copies of the rows
        n = len(source.lengths) if hasattr(source, "lengths") else len(jobs.load_workload(args.run)[0])
        source = EpochSource(source, n)
    t_plan = time.perf_counter()
    stream, cost = plan_stream(args, ctx.world, source, spec, note=jobs.say if ctx.rank == 0 else None)
    ahead = PlanAhead(stream, args.plan_ahead, check=check_step)  # steps planned on a thread while others train
    header = time.perf_counter() - t_plan  # the over-long policy over the whole run (the whole plan at depth 0)
    try:
        evaluation = _evaluation(args, ctx.world, spec) if args.eval_data else None
        return _train(args, ctx, spec, source, ahead, cost, header, evaluation)
    finally:
        ahead.close()


def _train(args: TrainArgs, ctx: DistContext, spec: ModelSpec, source: Source, ahead: PlanAhead, cost: CostModel,
           header: float, evaluation: Evaluation | None = None) -> dict[str, Any]:
    plan = ahead.plan
    # the memory prediction at the run's own activation width (the planning model assumes bf16)
    mem_cost = CostModel(cost.model, cost.hw, replace(cost.cfg, act_bytes=DTYPES[args.dtype].itemsize))
    report = data_report(plan, source)
    _emit(ctx, args, {"data": report})
    pipe = _pipeline(args, spec, ctx, cost)
    model = _model(args, spec, ctx, plan, pipe.stage if pipe else 0)
    if pipe is not None:
        pipe.model = model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = build_scheduler(opt, args.lr_scheduler, len(ahead), warmup_of(len(ahead), args.warmup_steps,
                                                                          args.warmup_ratio), args.min_lr)
    prank = pipe.layout.prank if pipe else ctx.rank
    sampler = PlanSampler(plan, prank, steps=len(ahead), ready=ahead.wait)
    groups = CPGroups.build(set(), ctx.world, timeout=args.timeout) if ctx.distributed else None
    sync = None
    if _fsdp(args, ctx):
        from .parallelize import StepSync

        sync = StepSync(model, ctx.device)
    first_layer = pipe.first_layer if pipe is not None else None
    cache: list[dict[str, Any]] = []  # the planned steps' JSON, for checkpoint fingerprints
    header += _resume(args, model, opt, sampler, ctx, ahead, cache, first_layer, sched)
    norm_group = pipe.layout.cross_group if pipe is not None else None  # stages' squared norms add up
    tied = [pipe.tied_weight] if pipe is not None and pipe.last and pipe.tied_weight is not None else []
    records: list[dict[str, Any]] = []
    where = args.log_dir or args.output_dir
    reporters = tuple(filter(None, args.report_to.split(",")))
    if reporters and not where:
        raise ValueError(f"--report-to {args.report_to}: needs --output-dir or --log-dir for its files")
    log = MetricsLog(where, reporters, settings(args, ctx.world)) if where and ctx.rank == 0 else None
    progress: Meter | None = None  # rank 0's line on stderr: steps done, tokens/s, time left
    chained: set[int] = set()
    t_start = time.perf_counter()
    for step, mbs in sampler:
        t0 = time.perf_counter()
        if ctx.rank == 0 and progress is None:  # from the first step this run trains (a resume's included)
            progress = Meter("train", len(ahead) - step, ("step",), "steps")
        if groups is not None:
            groups.add(plan.steps[step], ctx.world, args.pp)
        chained |= chained_samples(plan, step)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        try:
            stats, peak = run_step(model, plan, step, mbs, source, ctx, groups, args.loss, sync, pipe)
        except Exception as exc:
            raise _step_failure(exc, step, ctx, args.timeout) from None
        lr = float(opt.param_groups[0]["lr"])
        norm = clip_gradients(model.parameters(), args.max_grad_norm, norm_group, skip=tied)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        read = [stats, norm.reshape(1).to(stats)]
        if evaluation is not None and ((args.eval_every and (step + 1) % args.eval_every == 0)
                                       or step == len(ahead) - 1):
            read.append(evaluation.run(model, ctx, groups, args.loss, sync, pipe)[:1])
        waited = sampler.waited + (header if not records else 0.0)
        loss_v, tokens_v, targets_v, norm_v, *held_out = torch.cat(read).tolist()  # the step's one read
        rec = {"step": step, "loss": loss_v, "tokens": int(tokens_v), "targets": int(targets_v), "lr": lr,
               "grad_norm": norm_v,
               "step_seconds": time.perf_counter() - t0, "planner_wait_seconds": waited,
               "memory": _memory(plan, step, mem_cost, ctx, peak, prank)}
        if held_out:
            rec["eval_loss"] = held_out[0]
        if pipe is not None:
            rec["pipeline"] = pipe.record(ctx.world, ctx.rank)
        records.append(rec)
        _emit(ctx, args, rec)
        if log is not None:
            log.step(rec)
        if progress is not None:
            progress.hint = f"{sum(r['tokens'] for r in records) / (time.perf_counter() - t_start):,.0f} tokens/s"
            progress.tick()
        if args.checkpoint_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, model=model, optimizer=opt, sampler=sampler.state_dict(),
                            fingerprint=_fingerprint(plan, step + 1, cache), rank=ctx.rank,
                            settings=settings(args, ctx.world), first_layer=first_layer,
                            extra={"scheduler": sched.state_dict(), "total_steps": len(ahead)})
    if log is not None:
        log.close()
    if progress is not None:
        progress.close()
    elapsed = time.perf_counter() - t_start
    total = sum(r["tokens"] for r in records)
    summary = {"tokens_per_second": total / elapsed if elapsed > 0 else 0.0,
               "final_loss": records[-1]["loss"] if records else float("nan"), "steps": len(records),
               "dropped_samples": report["dropped_samples"], "truncated_samples": report["truncated_samples"],
               "empty_rows_dropped": report["empty_rows_dropped"], "chained_samples": len(chained),
               "output_dir": args.output_dir, "threads": torch.get_num_threads(),
               "planning_seconds": header + ahead.planning_seconds,
               "planner_wait_seconds": sum(r["planner_wait_seconds"] for r in records)}
    if args.output_dir:
        _save_output(args, model, ctx, pipe)
    _emit(ctx, args, {"summary": summary})
    return {"steps": records, "summary": summary, "data": report, "model": model}


def _pipeline(args: TrainArgs, spec: ModelSpec, ctx: DistContext, cost: CostModel) -> Any:
    """This rank's pipeline stage (None without --pp)."""
    if args.pp == 1:
        return None
    from .pipeline import Layout, PipelineStage

    layout = Layout.build(ctx.rank, ctx.world, args.pp, tied=spec.tied_embeddings)
    return PipelineStage(None, layout, ctx.rank, spec.hidden, DTYPES[args.dtype], cost)


def _save_output(args: TrainArgs, model: Any, ctx: DistContext, pipe: Any = None) -> None:
    """A consolidated Hugging Face checkpoint (rank 0 writes; every rank takes part in gathering)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .hf_model import save

    if pipe is not None:  # the stages' tensors, gathered under the whole model's names, into a full skeleton
        from transformers import AutoModelForCausalLM

        from .stage_state import gather_state

        state: Any = gather_state(model, pipe.layout)
        if ctx.rank == 0:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(model.config)
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0 and args.output_dir:
        keep = None if args.dtype == "float64" else (torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
        save(model, state, args.output_dir, tokenizer=args.tokenizer, dtype=keep)
    if ctx.distributed:
        torch.distributed.barrier()


def _worker(rank: int, world: int, port: int, args_dict: dict[str, Any], errors: str) -> None:
    """One spawned rank: a user error (or a rank that stopped answering) becomes one line in ``errors/RANK`` and
    exit code 2, for :func:`launch` to report once."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    args_dict = dict(args_dict)
    args_dict["run"] = jobs.RunSpec(**args_dict["run"])
    args = TrainArgs(**args_dict)
    if args.threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        train(args)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # leave together: tearing gloo down under a peer's feet can abort it
    except Exception as exc:  # noqa: BLE001  (every error becomes the rank's one line; a lost peer is marked)
        lost = isinstance(exc, PeerLost) or (isinstance(exc, RuntimeError) and _peer_lost(exc))
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
    # fail fast in the parent with a clear message, before allocating or spawning anything
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = model_spec(args)
    check_fits(spec, world=nproc, local=nproc, fsdp=args.fsdp and nproc > 1, dtype=DTYPES[args.dtype], device=device)
    stream, _ = plan_stream(args, nproc, spec=spec, note=None)  # the ranks say what there is to say
    if args.eval_data:
        _evaluation(args, nproc, spec)  # the held-out rows read and planned: their errors before spawning
    if len(stream):  # the run's first step too: a layout it cannot run is refused before spawning
        stream.next_step()
        check_step(stream.plan, 0)
    if nproc == 1:
        train(args)
        return
    import tempfile

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory(prefix="longpack-errors-") as errors:
        ctx = mp.start_processes(_worker, args=(nproc, free_port(), asdict(args), errors), nprocs=nproc, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join(grace_period=5):  # a failed rank's peers get 5 s to stop, then SIGKILL
                pass
        except ProcessException as exc:
            # the cause first: a rank's own error before the peers that saw it leave, then the lowest rank
            said = sorted(os.listdir(errors), key=lambda n: (n.endswith(".peer"), int(n.split(".")[0])))
            if not said or said[0].endswith(".peer") and str(exc.error_index) not in {n.split(".")[0] for n in said}:
                # a rank ended from outside (killed, out of host memory): its end is the cause
                how = (f"was killed ({exc.signal_name})" if getattr(exc, "signal_name", None)
                       else f"exited with code {getattr(exc, 'exit_code', '?')}")
                raise ValueError(f"rank {exc.error_index}: the process {how}; the run stopped (a checkpoint "
                                 "cut short is never used: --resume takes the last complete one)") from None
            with open(os.path.join(errors, said[0])) as f:
                raise ValueError(f"rank {said[0].split('.')[0]}: {f.read()}") from None
    sys.stdout.flush()
