"""``LongpackTrainer``: transformers' Trainer driven by a longpack Plan.

How it plugs in (public extension points only):

* ``get_train_dataloader`` returns this process's micro-batches of every step, already rank-specific (so it is not
  handed to accelerate for sharding). Steps with fewer micro-batches than the longest step are padded with one-token
  batches that carry no target, so the fixed ``gradient_accumulation_steps`` (set to the plan's micro-batch count)
  always ends an optimizer step exactly where the plan's step ends.
* ``compute_loss`` runs the model on a packed row (``use_cache=False``: with a cache transformers skips the packed
  document mask, ENVIRONMENT.md) and returns Σ cross-entropy · world / (targets in the whole step) — the plan knows
  the count — with ``loss_is_scaled_for_ga`` set, so after DDP's gradient averaging the update is the exact global
  token mean, whatever the packing.
* ``check_document_masking`` runs once at start: the model on two packed documents must give the second document
  the same logits as alone; an attention implementation that lets documents see each other is refused with one
  line naming it.

Packing efficiency (real tokens / computed tokens) and the plan's rank imbalance (DBR, ABR) are logged once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import Trainer

from ..cost import CostModel, TrainConfig
from ..hardware import load_hardware
from ..plan import Plan
from ..planners import PlanContext, check_options, get_planner, global_batches
from ..runtime.hf_model import spec_of
from ..sim import plan_metrics

__all__ = ["LongpackConfig", "LongpackMixin", "LongpackTrainer", "longpack_trainer_class", "check_document_masking"]

IGNORE = -100


@dataclass(frozen=True, kw_only=True)
class LongpackConfig:
    """Planner, global batch (sequences per optimizer step), token cap per micro-batch, hardware for the cost model."""

    planner: str = "skrull"
    global_batch: int = 32
    token_cap: int = 4096
    hardware: str = "cpu"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)


def check_document_masking(model: torch.nn.Module) -> None:
    """Refuse (ValueError, one line) an attention implementation that lets packed documents attend to each other."""
    impl = getattr(model.config, "_attn_implementation", "?")
    device = next(model.parameters()).device
    a = torch.tensor([[5, 6, 7, 8]], device=device)
    b = torch.tensor([[9, 10, 11]], device=device)
    packed = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]], device=device)
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=pos, use_cache=False, **_flash_kwargs([0, 4, 7], device))
        alone = model(input_ids=b, position_ids=pos[:, 4:], use_cache=False)
    err = float((together.logits[0, 4:] - alone.logits[0]).abs().max())
    scale = float(alone.logits.abs().max()) + 1e-12
    if err > 1e-4 * scale:
        raise ValueError(f"attn_implementation={impl!r} lets packed documents attend to each other (logit error "
                         f"{err:.2e}); load the model with attn_implementation='sdpa', 'eager' or 'flash_attention_2'")


def _flash_kwargs(cu: list[int], device: torch.device) -> dict[str, Any]:
    t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu, cu[1:], strict=False))
    return {"cu_seq_lens_q": t, "cu_seq_lens_k": t, "max_length_q": longest, "max_length_k": longest}


class _PlanBatches(torch.utils.data.Dataset):
    """This process's micro-batches of every step, padded to a fixed count per step, as packed-row dicts."""

    def __init__(self, plan: Plan, rank: int, rows: Any, depth: int) -> None:
        self.items: list[tuple[int, tuple | None]] = []
        self.totals = []
        for s, step in enumerate(plan.steps):
            targets = sum(max(0, plan.effective_length(p.sample) - 1) for r in step.replicas
                          for mb in r.micro_batches for p in mb.pieces)
            self.totals.append(targets)
            mbs = step.replicas[rank].micro_batches
            for mb in mbs:
                self.items.append((s, tuple((p.sample, p.start, p.stop) for p in mb.pieces) or None))
            self.items += [(s, None)] * (depth - len(mbs))
        self.rows = rows

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        step, pieces = self.items[i]
        if pieces is None:  # a filler micro-batch: one token, no target
            ids, tgt, pos, cu = [0], [IGNORE], [0], [0, 1]
        else:
            ids, tgt, pos, cu = [], [], [], [0]
            for sample, start, stop in pieces:
                toks = list(self.rows[sample])[start:stop]
                ids += toks
                tgt += toks[1:] + [IGNORE]
                pos += list(range(stop - start))
                cu.append(cu[-1] + stop - start)
        return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]),
                "longpack_targets": torch.tensor([tgt]), "longpack_cu": torch.tensor(cu, dtype=torch.int32),
                "longpack_step_targets": torch.tensor(self.totals[step], dtype=torch.float64)}


class LongpackMixin:
    """The hooks that make any ``transformers.Trainer`` subclass (Trainer, TRL's SFTTrainer) train on a plan."""

    args: Any  # provided by the Trainer class this is mixed into

    def __init__(self, *args: Any, longpack: LongpackConfig | None = None, **kwargs: Any) -> None:
        self.lp = longpack or LongpackConfig()
        model, train_args = kwargs.get("model"), kwargs.get("args")
        dataset = kwargs.get("train_dataset")
        if model is None or train_args is None or dataset is None:
            raise ValueError("LongpackTrainer needs model=, args= and train_dataset= (rows with input_ids)")
        if getattr(model.config, "use_cache", False):
            warnings.warn("LongpackTrainer: setting model.config.use_cache=False (a cache disables the packed "
                          "document mask)", stacklevel=2)
            model.config.use_cache = False
        check_document_masking(model)
        self.plan = self._make_plan(model, dataset, train_args.world_size)
        self._lp_rows = list(dataset["input_ids"])  # what was planned (subclasses may rewrite train_dataset)
        depth = max(len(st.replicas[0].micro_batches) for st in self.plan.steps)
        train_args.gradient_accumulation_steps = depth
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.loss_is_scaled_for_ga: Any = True
        m = plan_metrics(self.plan)
        self.longpack_metrics = {"longpack/packing_efficiency": 1.0 - m.pr, "longpack/dbr": m.dbr,
                                 "longpack/abr": m.abr, "longpack/micro_batches_per_step": depth}
        self._logged = False

    def _make_plan(self, model: torch.nn.Module, dataset: Any, world: int) -> Plan:
        lengths = np.array([len(r) for r in dataset["input_ids"]], dtype=np.int64)
        cost = CostModel(spec_of(model.config), load_hardware(self.lp.hardware),
                         TrainConfig(dp=world, cp=1, token_cap=self.lp.token_cap))
        options = dict(self.lp.options)
        check_options([self.lp.planner], options)
        if self.lp.planner == "unified":
            options.setdefault("degrees", "1")  # this path runs no context parallelism: every step at CP 1
        ctx = PlanContext(cost=cost, seed=self.lp.seed, options=options)
        batches = global_batches(len(lengths), self.lp.global_batch, seed=self.lp.seed)
        plan = get_planner(self.lp.planner).plan(lengths, batches, ctx, overlong="error")
        plan.validate()
        wide = next((s.cp for s in plan.steps if s.cp > 1), None)
        if wide is not None:
            raise ValueError(f"LongpackTrainer: planner {self.lp.planner!r} made a step with CP degree {wide}; the "
                             "Hugging Face path runs CP 1 only (use longpack train for context parallelism)")
        return plan

    def get_train_dataloader(self) -> DataLoader:
        depth = self.args.gradient_accumulation_steps
        data = _PlanBatches(self.plan, self.args.process_index, self._lp_rows, depth)
        return DataLoader(data, batch_size=None, shuffle=False)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        targets = inputs.pop("longpack_targets")
        cu = inputs.pop("longpack_cu").tolist()
        total = float(inputs.pop("longpack_step_targets"))
        out = model(**inputs, use_cache=False, **_flash_kwargs(cu, targets.device))
        ce = F.cross_entropy(out.logits[0].float() if out.logits.dtype in (torch.float16, torch.bfloat16)
                             else out.logits[0], targets[0].clamp_min(0), reduction="none")
        loss = (ce * (targets[0] != IGNORE)).sum() * self.args.world_size / max(total, 1.0)
        return (loss, out) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if not self._logged:
            logs = {**logs, **self.longpack_metrics}
            self._logged = True
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


class LongpackTrainer(LongpackMixin, Trainer):
    """``transformers.Trainer`` on a longpack plan of ``train_dataset`` (rows with ``input_ids``)."""


def longpack_trainer_class(base: type) -> type:
    """A Trainer subclass ``base`` (e.g. ``trl.SFTTrainer``) with longpack's hooks mixed in."""
    return type(f"Longpack{base.__name__}", (LongpackMixin, base), {})
