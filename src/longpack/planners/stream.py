"""A run's plan made one step at a time, so training can start before the whole run is planned.

:class:`PlanStream` does at once what the whole run must know: the token cap, the over-long policy over every
sample of the run (which samples are truncated, dropped or split, with reasons) and the plan's header. It then
plans each step when asked, in order. ``stream.plan`` is a :class:`~longpack.plan.Plan` whose ``steps`` list grows
by one per :meth:`PlanStream.next_step`; with ``validate`` each new step is checked alone (its shape, capacity and
the coverage of its own samples, :meth:`Plan.validate_steps`) as it is made.

A step is a pure function of its global batch, the plan context and the seed, so every rank streaming the same run
gets the same steps in the same order. A planner that lays out the whole run at once (one that overrides
:meth:`Planner.plan`, such as HBP's global packing and ordering) is planned whole when the stream is made, and its
steps are then handed out in order. :func:`make_plan` is a stream whose steps are all planned at once
(:meth:`PlanStream.rest`), equal to the steps one at a time.

A resumed run starts the stream at the step it continues (:meth:`PlanStream.start_at`): the global batches are a
function of the seed and the data alone, so step k's batch is the same on any world, and the steps before it are
not planned again (they stay :class:`Trained` in ``plan.steps``). :meth:`PlanStream.trained_fingerprint` names the
batches of the first steps — their samples and the tokens kept of each — for a resume to compare.

Cost: the header is O(samples of the run); each step costs its planner's ``plan_batch``, plus O(its pieces) to
validate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..columns import Lengths, StepColumns
from ..plan import Plan, Step
from ..progress import tick
from ..sources import check_lengths
from .base import Batch, PlanContext, apply_overlong

if TYPE_CHECKING:
    from .registry import Planner

__all__ = ["PlanStream", "make_plan", "Trained"]


class Trained:
    """Step ``index`` of a resumed run, trained before the resume and not planned again; reading it is refused."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __getattr__(self, name: str) -> None:
        raise RuntimeError(f"step {self.index} was trained before the resume and is not planned again "
                           f"(read of {name!r})")


class PlanStream:
    """The run's plan header now, its steps one :meth:`next_step` at a time (see the module docstring)."""

    def __init__(self, planner: Planner, lengths: np.ndarray, batches: Sequence[np.ndarray], ctx: PlanContext, *,
                 max_len: int | None = None, overlong: str = "split", validate: bool = True) -> None:
        check_lengths(lengths, "lengths")  # a zero, negative or fractional length: ValueError naming the sample
        self.made, self.start, self.validate = 0, 0, validate
        self.whole = type(planner).whole_run  # this planner lays out the whole run at once
        if self.whole:
            full = planner.plan(lengths, batches, ctx, max_len=max_len, overlong=overlong)
            if validate:
                full.validate()
            self.plan, self._todo = full, []
            return
        self.planner, self.ctx = planner, ctx
        cap = ctx.token_cap
        if cap < 1:
            c = ctx.cost
            raise ValueError(f"model {c.model.name} on {c.hw.name}: memory {c.hw.memory_gib:g} GiB leaves no room "
                             f"for activations after {c.static_bytes / 2**30:.1f} GiB of weights/optimizer state; "
                             "raise --dp/--cp/--tp (ZeRO sharding) or use larger hardware")
        piece_len = cap * ctx.cp
        limit = piece_len if max_len is None else min(max_len, piece_len)
        scope = np.concatenate(batches) if len(batches) else np.zeros(0, dtype=np.int64)
        eff, truncated, dropped, n_split = apply_overlong(lengths, scope, limit, overlong)
        split_len = max_len if max_len is not None and overlong == "split" else None
        if split_len is not None:
            piece_len = min(piece_len, split_len)
        self._eff, self._piece_len, self._split_len = eff, piece_len, split_len
        if bool(np.all(eff[scope] > 0)):
            self._todo = [(i, ids) for i, ids in enumerate(batches) if ids.size]
        else:
            kept = [(i, ids[eff[ids] > 0]) for i, ids in enumerate(batches)]
            self._todo = [(i, keep) for i, keep in kept if keep.size]
        tick("planned", len(batches) - len(self._todo))  # batches with nothing left to train
        meta = {"seed": ctx.seed, "dp": ctx.dp, "cp": ctx.cp, "tp": ctx.cost.cfg.tp, "pp": ctx.cost.cfg.pp,
                "model": ctx.cost.model.name, "hardware": ctx.cost.hw.name, "token_cap": cap,
                "ckpt_layers": ctx.ckpt_layers, "options": dict(ctx.options),
                "overlong": {"policy": overlong, "limit": limit, "split": n_split, "truncated": len(truncated),
                             "split_len": split_len, "dropped": len(dropped)}}
        self._steps: list[Step] = []  # the plan's own list, grown by next_step
        self.plan = Plan(planner=planner.name, world=ctx.world, steps=self._steps, truncated=truncated, dropped=dropped,
                         lengths=Lengths(scope, lengths[scope]), meta=meta)

    def __len__(self) -> int:
        """The run's step count (known before any step is planned)."""
        return len(self.plan.steps) if self.whole else len(self._todo)

    def next_step(self) -> Step:
        """Plan (or hand out) the next step; it is ``self.plan.steps[self.made - 1]`` afterwards."""
        if self.made >= len(self):
            raise IndexError(f"all {len(self)} steps of the run are planned")
        s = self.made
        if not self.whole:
            step = self.planner.plan_batch(self._batch(s), self.ctx)
            self._steps.append(step)
            tick("planned")
            if self.validate:
                self.plan.validate_steps([s], self._todo[s][1].tolist())
        self.made += 1
        return self.plan.steps[s]

    def start_at(self, k: int) -> None:
        """Plan from step ``k`` on: the steps before it are :class:`Trained` placeholders (a whole-run planner's
        steps exist already and stay). Only before any step is made here."""
        if not 0 <= k <= len(self):
            raise ValueError(f"step {k} outside the run's {len(self)} steps")
        if self.made:
            raise RuntimeError(f"start_at({k}) after {self.made} steps were made")
        self.start = self.made = k
        if not self.whole:
            self._steps.extend(Trained(s) for s in range(k))  # type: ignore[misc]

    def trained_fingerprint(self, n: int) -> str:
        """SHA-256 (16 hex digits) of the first ``n`` steps' global batches: each step's sample ids, in order, and
        the tokens kept of each (the over-long policy's cut). Equal on any world, cap or planner that keeps the
        run's batches. Cost: O(samples of those steps)."""
        import hashlib

        h = hashlib.sha256()
        for s in range(n):
            if self.whole:
                st = self.plan.steps[s]
                ids = np.array(sorted({p.sample for rep in st.replicas for mb in rep.micro_batches for p in mb.pieces}),
                               dtype=np.int64)
                eff = np.array([self.plan.effective_length(int(i)) for i in ids], dtype=np.int64)
            else:
                ids = np.sort(self._todo[s][1]).astype(np.int64)
                eff = self._eff[ids].astype(np.int64)
            h.update(np.int64(len(ids)).tobytes() + ids.tobytes() + eff.tobytes())
        return h.hexdigest()[:16]

    def _batch(self, s: int) -> Batch:
        i, keep = self._todo[s]
        return Batch(i, keep, self._eff[keep], self._piece_len, self._split_len)

    def rest(self) -> Plan:
        """The plan with every step not yet made planned at once (:meth:`Planner.plan_many`): steps in a tuple, or
        in columns where the planner makes them so; not validated."""
        if self.whole:
            return self.plan
        todo = [self._batch(s) for s in range(self.made, len(self))]
        steps = self.planner.plan_many(todo, self.ctx)
        tick("planned", len(todo))
        self.made = len(self)
        if not self._steps:
            return replace(self.plan, steps=steps if isinstance(steps, StepColumns) else tuple(steps))
        return replace(self.plan, steps=tuple(self._steps) + tuple(steps))


def make_plan(planner: Planner, lengths: np.ndarray, batches: Sequence[np.ndarray], ctx: PlanContext, *,
              max_len: int | None = None, overlong: str = "split") -> Plan:
    """Run ``planner`` over ``batches`` of sample ids with the shared over-long policy (planners/base.py): the
    whole plan, its steps planned at once by :meth:`Planner.plan_many` (a tuple, or columns where the planner
    makes them: :mod:`longpack.columns`); not validated (``Plan.validate`` checks it whole)."""
    return PlanStream(planner, lengths, batches, ctx, max_len=max_len, overlong=overlong, validate=False).rest()
