"""The run's inputs, made identically on every rank: the rows (:func:`load_source`), the model's shapes
(:func:`model_spec`), the plan as a stream or whole (:func:`plan_stream`, :func:`build_plan`), and the held-out rows'
one-step plan (:func:`held_out`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...cost import CostModel
from ...model import ModelSpec, get_model
from ...plan import Plan
from ...planners.stream import PlanStream
from ...runspec import build_cost, load_workload, say
from ...runspec import plan_stream as run_stream
from ..kernel.data import Source, SyntheticCorpus
from ..kernel.step import check_step
from .ahead import PlanAhead
from .evaluate import Evaluation
from .train_args import TrainArgs, check_layout

LAUNCHED = "LONGPACK_LAUNCHED"  # set by `longpack train --nproc`'s launcher once it has read the rows

__all__ = ["LAUNCHED", "load_source", "with_digest", "model_spec", "plan_stream", "build_plan", "held_out",
           "zero_stage"]


def load_source(args: TrainArgs, vocab: int, say: Any = None) -> Source:
    """The user's rows (``--data``, through the token store's cache; ``say``: where the line about it goes) or
    the synthetic corpus of a built-in workload."""
    if args.data.path is None:
        return SyntheticCorpus(vocab, seed=args.run.seed)
    return _rows(args, args.data.path, vocab, say, "--data")


def with_digest(args: TrainArgs, source: Source) -> TrainArgs:
    """``args`` with the rows' digest, where a checkpoint records it and a resume compares it (the user's rows
    and a checkpoint folder); unchanged otherwise."""
    if hasattr(source, "digest") and args.out.checkpoint_dir:
        return args.with_content(source.digest())
    return args


def _rows(args: TrainArgs, path: str, vocab: int, say: Any, flag: str) -> Any:
    from ...rows import load_rows

    return load_rows(path, mask_column=args.data.mask_column, tokenizer=args.data.tokenizer, vocab=vocab,
                     cache_dir=args.data.cache_dir, num_proc=args.data.num_proc,
                     keep_untargeted=args.data.keep_untargeted,
                     say=say, flag=flag)


def model_spec(args: TrainArgs) -> ModelSpec:
    """The shapes the cost model plans with: the checkpoint's config, or the preset."""
    if args.model.path is None:
        return get_model(args.run.model)
    from transformers import AutoConfig

    from .hf_model import spec_of

    return spec_of(AutoConfig.from_pretrained(args.model.path, local_files_only=True))


def sharded(args: TrainArgs, world: int) -> bool:
    """Whether the run's parameters live in FSDP2 (``--fsdp``): over every process of a pipeline stage when there
    are two or more, and on a single bfloat16 process too, where FSDP2's mixed precision keeps the parameters,
    their gradients and AdamW state in fp32 and computes in bf16 (a bf16 AdamW would round away updates below
    1/256 of a weight: at fine-tuning rates, most of them)."""
    return args.parallel.fsdp and (world // args.parallel.pp > 1 or (world == 1 and args.model.dtype == "bfloat16"))


def zero_stage(args: TrainArgs, world: int, spec: ModelSpec | None = None) -> int:
    """The sharding the run executes: 0 unsharded; 3 under FSDP2 gathered per layer and pass
    (runtime/kernel/parallelize.PassSync); 1 under FSDP2 gathered once per step (StepSync: whole weights and gradients
    while the step runs, AdamW state sharded), which pipeline stages and a single process always use.

    ``--shard auto`` gathers once per step when that static state takes at most a quarter of the ``--hardware``
    memory, else per layer: one all-gather and one reduce-scatter per step instead of one per layer and pass
    wherever memory allows it, and ZeRO-3 where the model would not leave the activations room. The choice
    depends on the model's shape, the world and ``--hardware`` only, so every rank makes it alike."""
    if not sharded(args, world):
        return 0
    if world == 1 or args.parallel.pp > 1 or args.parallel.shard == "step":  # one process: gathered per step
        return 1
    if args.parallel.shard == "layer":
        return 3
    import torch

    from ...hardware import load_hardware
    from .fit import static_need

    need = static_need(spec or model_spec(args), world=world, fsdp=True, dtype=getattr(torch, args.model.dtype),
                       per_layer=False)
    return 1 if need <= load_hardware(args.run.hardware).memory_bytes / 4 else 3


def plan_stream(args: TrainArgs, world: int, source: Source | None = None, spec: ModelSpec | None = None,
                note: Any = say) -> tuple[PlanStream, CostModel]:
    """The run's plan as a stream (its header now, each step when asked), which every rank makes identically (same
    inputs, same seed), and its cost model; ``note``: where notes for the user go (one process says them)."""
    ranks = check_layout(args, world)
    spec = spec or model_spec(args)
    run = replace(args.run, dp=ranks // args.run.cp, pp=args.parallel.pp, zero_stage=zero_stage(args, world, spec))
    if args.data.path is not None:
        source = source if source is not None else load_source(args, spec.vocab)
        lengths, default_max_len = source.lengths, None  # type: ignore[attr-defined]
        run = replace(run, workload=None, lengths_file=args.data.path)
    else:
        lengths, default_max_len = load_workload(run)
    cost = build_cost(run, spec, runtime=True)
    try:
        return run_stream(args.planner, lengths, run, cost, default_max_len, note=note), cost
    except ValueError as exc:  # a sample named by its row in the user's file
        raise (source.located(exc) if hasattr(source, "located") else exc) from None


def build_plan(args: TrainArgs, world: int, source: Source | None = None, spec: ModelSpec | None = None,
               note: Any = say, steps: int | None = None) -> tuple[Plan, CostModel]:
    """The whole plan (:func:`plan_stream` planned up front, every step checked runnable) and its cost model;
    ``steps``: its first ``steps`` steps only (the same steps: each is a pure function of its batch and the seed)."""
    stream, cost = plan_stream(args, world, source, spec, note)
    ahead = PlanAhead(stream, 0, check=check_step, upto=steps)
    last = len(ahead) if steps is None else min(steps, len(ahead))
    if last:
        ahead.wait(last - 1)  # raises the first step that failed
    return replace(stream.plan, steps=tuple(stream.plan.steps)), cost


def held_out(args: TrainArgs, world: int, spec: ModelSpec, say: Any = None) -> Evaluation:
    """The held-out rows of ``--eval-data`` and their plan: one step of all of them (runtime/run/evaluate.py)."""
    assert args.data.eval_data is not None
    rows = _rows(args, args.data.eval_data, spec.vocab, say, "--eval-data")
    run = replace(args.run, global_batch=len(rows.ids), steps=None, epochs=1)
    held = replace(args, data=replace(args.data, path=args.data.eval_data), run=run)
    plan, _ = build_plan(held, world, source=rows, spec=spec, note=None)
    _check_positions(args, spec, plan, rows)
    return Evaluation(plan, rows)


def _check_positions(args: TrainArgs, spec: ModelSpec, plan: Plan, rows: Any) -> None:
    """Refuse held-out rows longer than the model's positions, as training rows are (runtime/run/hf_model.py),
    naming the row."""
    from .hf_model import config_of, positions

    covered = positions(config_of(spec, args.model.path))
    if covered is None or not plan.lengths:
        return
    sample = max(plan.lengths, key=plan.effective_length)
    n = plan.effective_length(sample)
    if n > covered:
        raise ValueError(f"--eval-data: {rows.where(int(rows.rows[sample]))} has {n} tokens, longer than the "
                         f"{covered} positions the model was trained for (max_position_embeddings, times its "
                         f"rope_scaling factor if any); cap --max-len at {covered} or leave that row out")
