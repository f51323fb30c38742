"""``LongpackTrainer``: transformers' Trainer (or TRL's SFTTrainer) running longpack's plan on the shared engine.

Through the Trainer's public extension points: the prepared ``train_dataset`` is read once from its Arrow columns
(targets from ``labels``, else TRL's completion or assistant masks, else every next token; rows with no target
and empty rows left out and counted), planned over dp·cp ranks identically on every process, and each dataloader
item is one plan step that ``training_step`` runs through the kernel's step runner, as ``longpack train`` does —
the longpack attention switched on for the step, every target weighed by the step's global count, the gradient
summed once (one all-reduce, or FSDP2's gather and reduce-scatter under Accelerate ``fsdp_version: 2``). The
Trainer's own resume continues at the exact next step. docs/EXECUTION.md, "LongpackTrainer", has the contract.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from ..planners.base import OVERLONG_POLICIES
from ..rows import TokenRows, rows_from_dataset
from ..runspec import RunSpec, build_cost, plan_stream
from ..runtime.dist import DistContext
from ..runtime.kernel.data import EpochSource, PlanSampler
from ..runtime.kernel.engine import engine_attention
from ..runtime.kernel.head_loss import head_loss_name, loss_head, resolve_head_loss, set_head_loss
from ..runtime.kernel.liger_loss import liger_refusal
from ..runtime.kernel.loss import MODES
from ..runtime.kernel.names import HEAD_LOSSES
from ..runtime.kernel.runner import model_device
from ..runtime.kernel.step import check_step
from ..runtime.kernel.step_fn import StepRunner
from ..runtime.run.accounting import data_report
from ..runtime.run.ahead import PlanAhead
from ..runtime.run.hf_model import check_supported, spec_of
from ..sim import plan_metrics

__all__ = ["LongpackConfig", "LongpackMixin", "LongpackTrainer", "longpack_trainer_class", "config_message"]


@dataclass(frozen=True, kw_only=True)
class LongpackConfig:
    """What the plan is made of: planner, sequences per optimizer step (``global_batch``), token cap per rank and
    micro-batch, hardware for the cost model, context-parallel degree, the over-long policy and its limit, loss
    normalisation (``token_mean`` or ``sequence_mean``, exact over each step), planner options, how many steps
    are planned ahead on a background thread while earlier ones train (``plan_ahead``; 0: the whole run first), and
    the head's fused loss (``head_loss``: as ``longpack train --head-loss``)."""

    planner: str = "unified"
    global_batch: int = 32
    token_cap: int = 4096
    hardware: str = "cpu"
    cp: int = 1
    max_len: int | None = None
    overlong: str = "split"
    ckpt_layers: int = 0
    loss: str = "token_mean"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    plan_ahead: int = 4
    head_loss: str = "auto"

    def __post_init__(self) -> None:
        for name in ("global_batch", "token_cap", "cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"LongpackConfig({name}={getattr(self, name)!r}): must be an integer >= 1")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 1):
            raise ValueError(f"LongpackConfig(max_len={self.max_len!r}): must be an integer >= 1 or None")
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"LongpackConfig(overlong={self.overlong!r}): choose one of "
                             f"{', '.join(OVERLONG_POLICIES)}")
        if self.loss not in MODES:
            raise ValueError(f"LongpackConfig(loss={self.loss!r}): choose one of {', '.join(MODES)}")
        if self.head_loss not in HEAD_LOSSES:
            raise ValueError(f"LongpackConfig(head_loss={self.head_loss!r}): choose one of {', '.join(HEAD_LOSSES)}")
        if self.ckpt_layers < 0:
            raise ValueError(f"LongpackConfig(ckpt_layers={self.ckpt_layers}): must be >= 0")
        if not isinstance(self.plan_ahead, int) or self.plan_ahead < 0:
            raise ValueError(f"LongpackConfig(plan_ahead={self.plan_ahead!r}): must be an integer >= 0 (0: plan "
                             "the whole run before the first step)")
        from ..hardware import load_hardware
        from ..planners import check_options, get_planner

        for name, check in (("planner", lambda: get_planner(self.planner)),
                            ("hardware", lambda: load_hardware(self.hardware)),
                            ("options", lambda: check_options([self.planner], self.options))):
            try:
                check()
            except (ValueError, OSError) as exc:
                said = config_message(str(exc))
                raise ValueError(f"LongpackConfig({name}={getattr(self, name)!r}): {said}") from None


_FIELDS = {"--overlong": "LongpackConfig.overlong", "--max-len": "LongpackConfig.max_len",
           "--cp": "LongpackConfig.cp", "--token-cap": "LongpackConfig.token_cap",
           "--global-batch": "LongpackConfig.global_batch", "--opt": "LongpackConfig.options",
           "--pack-len": "LongpackConfig.options['pack_len']", "--ckpt-layers": "LongpackConfig.ckpt_layers",
           "--micro-batch-size": "LongpackConfig.options['micro_batch_size']",
           "--planner": "LongpackConfig.planner", "--hardware": "LongpackConfig.hardware",
           "--dp": "the number of processes / LongpackConfig.cp", "--steps": "TrainingArguments.max_steps",
           "--tp": "tensor parallelism (not on this path)", "--pp": "pipeline parallelism (not on this path)"}


def config_message(text: str) -> str:
    """A planner's message with its CLI flags named as the ``LongpackConfig`` fields that set them here."""
    return re.sub(r"--[a-z][a-z-]*", lambda m: _FIELDS.get(m.group(0), m.group(0)), text)


def dataset_rows(dataset: Any, args: Any, vocab: int | None = None) -> TokenRows:
    """The Trainer's ``train_dataset`` as :class:`TokenRows` (targets chosen as in the module docstring)."""
    names = list(getattr(dataset, "column_names", None) or [])
    if "input_ids" not in names:
        raise ValueError(f"LongpackTrainer: train_dataset has no input_ids column (has {names[:8]}); tokenize it "
                         "first, or use TRL's SFTTrainer through longpack_trainer_class")
    mask = None
    completion = getattr(args, "completion_only_loss", None)
    if "labels" in names:
        pass
    elif completion is not False and "completion_mask" in names:
        mask = "completion_mask"
    elif getattr(args, "assistant_only_loss", False):
        if "assistant_masks" not in names:
            raise ValueError("LongpackTrainer: assistant_only_loss=True but train_dataset has no assistant_masks "
                             "column (TRL writes it from a chat template with generation markers)")
        mask = "assistant_masks"
    elif completion is True:
        raise ValueError("LongpackTrainer: completion_only_loss=True but train_dataset has no completion_mask "
                         "column (TRL writes it for prompt-completion data)")
    cols = ["input_ids"] + (["labels"] if "labels" in names else []) + ([mask] if mask else [])
    return rows_from_dataset(dataset, cols, "train_dataset", mask_column=mask, vocab=vocab)


class _Steps(torch.utils.data.Dataset):
    """The plan's steps in order, one item each (the rank's micro-batches are read from the plan)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"longpack_step": torch.tensor(i)}


def _one(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return items[0]


class LongpackMixin:
    """The hooks that make any ``transformers.Trainer`` subclass (Trainer, TRL's SFTTrainer) train on a plan."""

    args: Any  # provided by the Trainer class this is mixed into
    model: Any
    train_dataset: Any
    accelerator: Any

    def __init__(self, *args: Any, longpack: LongpackConfig | None = None, **kwargs: Any) -> None:
        self.lp = longpack or LongpackConfig()
        train_args = kwargs.get("args")
        if kwargs.get("model") is None or train_args is None or kwargs.get("train_dataset") is None:
            raise ValueError("LongpackTrainer needs model=, args= and train_dataset=")
        if train_args.gradient_accumulation_steps != 1:
            warnings.warn(f"LongpackTrainer: gradient_accumulation_steps={train_args.gradient_accumulation_steps} "
                          "is replaced by the plan: one optimizer step is LongpackConfig.global_batch rows, run "
                          "as the plan's micro-batches", stacklevel=2)
            train_args.gradient_accumulation_steps = 1
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._lp_setup()

    def _lp_setup(self) -> None:
        net = self.model
        world, rank = int(self.args.world_size), int(self.args.process_index)
        if world % self.lp.cp:
            raise ValueError(f"LongpackConfig(cp={self.lp.cp}) must divide the number of processes ({world})")
        self._lp_rows = dataset_rows(self.train_dataset, self.args, int(net.config.vocab_size))
        cut = getattr(self.args, "max_length", None)  # TRL's SFTConfig truncates rows to it while preparing them
        at_cut = int((self._lp_rows.lengths == cut).sum()) if cut else 0
        if at_cut and rank == 0:
            warnings.warn(f"LongpackTrainer: {at_cut} rows are exactly max_length={cut} tokens long: TRL truncated "
                          "them before longpack saw them (longpack cannot count what was cut); set "
                          "max_length=None and LongpackConfig(max_len=..., overlong='split'|'truncate'|'drop') to "
                          "have long rows split, or cut and counted", stacklevel=2)
        say = (lambda line: print(f"longpack: note: {config_message(line)}", file=sys.stderr, flush=True)) \
            if rank == 0 else None
        n = len(self._lp_rows.ids)
        self._lp_epoch_steps = math.ceil(n / min(self.lp.global_batch, n))  # what the Trainer counts as an epoch
        max_steps = int(getattr(self.args, "max_steps", -1) or -1)
        epochs = math.ceil(max_steps / self._lp_epoch_steps if max_steps > 0 else self.args.num_train_epochs)
        self._lp_ahead = self._lp_plan(net, world, say, max(1, epochs))
        self.plan = self._lp_ahead.plan  # its steps grow as they are planned
        if epochs > 1:  # every epoch its own permutation of the rows: the plan's samples are their copies
            self._lp_rows = EpochSource(self._lp_rows, n)
        check_supported(net, max((self.plan.effective_length(s) for s in self.plan.lengths), default=1))
        self.longpack_report = data_report(self.plan, self._lp_rows)
        head = self._lp_head(net)
        if rank == 0:
            print(f"longpack: data: {self.longpack_report['line']}", file=sys.stderr, flush=True)
            print(f"longpack: head loss: {head}", file=sys.stderr, flush=True)
        self._lp_ctx = DistContext(rank=rank, world=world, device=self.args.device)
        self._lp_sampler = PlanSampler(self.plan, rank, steps=len(self._lp_ahead))  # training_step waits itself
        self._lp_sync: Any = None
        self._lp_runner: StepRunner | None = None  # made at the first step, once the model is where it trains
        self._lp_sync_checked = False
        self.longpack_steps: list[dict[str, Any]] = []
        self._logged, self._lp_waited = False, 0.0

    def _lp_head(self, net: Any) -> str:
        """Put the model's head on ``LongpackConfig.head_loss``'s fused loss (runtime/kernel/head_loss.py) for the
        device the Trainer trains on; its name. ``liger`` where Liger's cannot run is refused, saying why."""
        head = loss_head(net)
        if head is None:
            return "the model's own (its head is not a bias-free linear layer)"
        device, dtype = torch.device(self.args.device), head.weight.dtype
        if self.lp.head_loss == "liger" and (why := liger_refusal(device, dtype, self.lp.loss)):
            raise ValueError(f"LongpackConfig(head_loss='liger'): {why}; use head_loss='auto' or 'longpack'")
        chosen = resolve_head_loss(self.lp.head_loss, device, dtype, self.lp.loss)
        set_head_loss(net, chosen)
        return head_loss_name(chosen)

    def _lp_metrics(self) -> dict[str, float]:
        """The data report's counts and the packing metrics of the steps planned so far (said on the first log)."""
        m = plan_metrics(replace(self.plan, steps=tuple(self.plan.steps)))
        r = self.longpack_report
        return {"longpack/packing_efficiency": 1.0 - m.pr, "longpack/dbr": m.dbr, "longpack/abr": m.abr,
                "longpack/rows": r["rows"]["rows"], "longpack/empty_rows_dropped": r["empty_rows_dropped"],
                "longpack/dropped_samples": r["dropped_samples"], "longpack/truncated_samples": r["truncated_samples"],
                "longpack/split_samples": r["split_samples"]}

    def _lp_plan(self, net: Any, world: int, say: Any, epochs: int) -> PlanAhead:
        cfg = self.lp
        options = dict(cfg.options)
        run = RunSpec(model=getattr(net.config, "name_or_path", "") or "model", hardware=cfg.hardware,
                           dp=world // cfg.cp, cp=cfg.cp, token_cap=cfg.token_cap, global_batch=cfg.global_batch,
                           seed=cfg.seed, max_len=cfg.max_len, overlong=cfg.overlong, ckpt_layers=cfg.ckpt_layers,
                           options=options, epochs=epochs)
        try:
            cost = build_cost(run, spec_of(net.config))
            stream = plan_stream(cfg.planner, self._lp_rows.lengths, run, cost, note=say)
        except ValueError as exc:
            raise ValueError(config_message(str(self._lp_rows.located(exc)))) from None
        return PlanAhead(stream, cfg.plan_ahead, check=check_step)

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: the plan's global batch (the Trainer would count its one-step batches), so
        its train_samples_per_second is the run's."""
        return self.lp.global_batch

    def num_examples(self, dataloader: DataLoader) -> int:
        """Samples in one epoch of the plan's steps (the train loader yields steps, not samples)."""
        if isinstance(dataloader.dataset, _Steps):
            return min(len(dataloader.dataset) * self.lp.global_batch, len(self._lp_rows.lengths))
        return super().num_examples(dataloader)  # type: ignore[misc]

    def get_train_dataloader(self) -> DataLoader:
        # batches of one step (not batch_size=None): the Trainer's resume skips batches through a batch sampler;
        # one epoch's steps, as the Trainer counts epochs (training_step reads the plan's step from global_step)
        return DataLoader(_Steps(self._lp_epoch_steps), batch_size=1, shuffle=False, collate_fn=_one)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        step = int(self.state.global_step)  # optimizer steps so far, over every epoch: the plan's next step
        if step % self._lp_epoch_steps != int(inputs["longpack_step"]):
            raise RuntimeError(f"LongpackTrainer: the Trainer is at step {step} but its data loader gave step "
                               f"{int(inputs['longpack_step'])} of an epoch of {self._lp_epoch_steps}")
        net = self.accelerator.unwrap_model(model)
        net.train()
        if self._lp_ctx.device != (dev := model_device(net)):  # where the Trainer placed the model, not args.device
            self._lp_ctx = replace(self._lp_ctx, device=dev)
        if not self._lp_sync_checked and self._lp_ctx.world > 1:  # Accelerate wraps the model in train()
            self._lp_sync_checked = True
            self._lp_sync = _fsdp_sync(net, self._lp_ctx.device)
            if self._lp_sync is None and getattr(self.args, "fsdp", None) and self._lp_ctx.rank == 0:
                warnings.warn("LongpackTrainer: fsdp was asked for but Accelerate did not shard the model (it "
                              "enables FSDP on GPU process groups only, not on CPU): every process holds the whole "
                              "model and gradients are summed with one all-reduce per step", stacklevel=2)
        try:
            waited = self._lp_ahead.wait(step)
        except ValueError as exc:
            raise ValueError(config_message(str(exc))) from None
        self._lp_waited += waited
        if self._lp_runner is None or self._lp_runner.ctx.device != self._lp_ctx.device:
            self._lp_runner = StepRunner(self._lp_ctx, self.lp.loss, self._lp_sync)
        with engine_attention(net):
            stats, _ = self._lp_runner.run(net, self.plan, step, self._lp_sampler.micro_batches(step), self._lp_rows)
        loss, tokens, targets = stats.tolist()  # the step's one read of the device
        self.longpack_steps.append({"step": step, "loss": loss, "tokens": int(tokens), "targets": int(targets),
                                    "planner_wait_seconds": waited})
        return stats[0].detach().float()  # the step's loss, already on the model's device

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log: the seconds its steps waited on the planner
            logs = {**logs, "longpack/planner_wait_seconds": self._lp_waited}
            self._lp_waited = 0.0
        if not self._logged:
            logs = {**logs, **self._lp_metrics()}
            self._logged = True
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


def _fsdp_sync(net: torch.nn.Module, device: torch.device) -> Any:
    """A :class:`StepSync` when Accelerate sharded ``net`` with FSDP2 (sum reduction, as the plan's weights need);
    None (one gradient all-reduce) otherwise."""
    from ..runtime.kernel.parallelize import StepSync, fsdp_modules

    mods = fsdp_modules(net)
    if not mods:
        return None
    for m in mods:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return StepSync(net, device)


class LongpackTrainer(LongpackMixin, Trainer):
    """``transformers.Trainer`` on a longpack plan of ``train_dataset`` (rows with ``input_ids``)."""


def longpack_trainer_class(base: type) -> type:
    """A Trainer subclass ``base`` (e.g. ``trl.SFTTrainer``) with longpack's hooks mixed in."""
    return type(f"Longpack{base.__name__}", (LongpackMixin, base), {})
