"""HBP's hierarchical balance packing with per-group SP degree and checkpointing (HBP, NeurIPS 2025, arXiv
2503.07680).

HBP plans the whole dataset offline: samples are grouped by length (packing lengths with an SP degree and
checkpointing each, :mod:`.hbp_groups`), packed by ISF within their group, under-full packs fill longer groups'
(GreedyFill), packs are balanced by attention work into steps, and the steps follow a curriculum (short groups
first) then a seeded interleaving. Each step carries its group's CP degree, token cap and checkpointing. Options:
``groups``, ``profiles``, ``widen``, ``greedy_fill``, ``balance``, ``step_tokens``, ``curriculum``. The
algorithm step by step: docs/PLANNERS.md, "HBP".

Guarantees: every sample in exactly one pack (or counted as split/truncated/dropped), caps per group, determinism
by seed. Cost: O(N · iters) for ISF plus O(N log N) sorting.

>>> import numpy as np
>>> from longpack.cost import CostModel, TrainConfig
>>> from longpack.hardware import get_hardware
>>> from longpack.model import get_model
>>> from longpack.planners.base import PlanContext
>>> cost = CostModel(get_model("tiny"), get_hardware("cpu"), TrainConfig(dp=2, cp=2))
>>> ctx = PlanContext(cost=cost, options={"groups": "8:1:0,32:2:0", "curriculum": 0})
>>> plan = HBP().plan(np.array([3, 5, 2, 30, 20, 6, 7, 1]), [np.arange(8)], ctx)
>>> plan.validate(); [(s.group, s.cp, len(s.replicas)) for s in plan.steps]
[('8/sp1/ckpt0', 1, 4), ('32/sp2/ckpt0', 2, 2)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Plan, Step, make_pieces
from ..progress import tick
from ..sources import check_lengths
from .base import PlanContext, apply_overlong, assemble_step, chain_pieces
from .hbp_groups import Group, select_groups
from .packers import isf
from .registry import Planner, register

__all__ = ["HBP", "parse_groups"]


def parse_groups(text: str) -> list[Group]:
    """``"16384:1:28,131072:8:29"`` -> groups (length, sp, ckpt), sorted by length."""
    groups = []
    for item in str(text).split(","):
        try:
            length, sp, ckpt = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--opt groups: {item!r} is not LENGTH:SP:CKPT") from None
        groups.append(Group(length, sp, ckpt))
    return sorted(groups, key=lambda g: g.length)


class _Pack:
    __slots__ = ("items", "room", "attn")

    def __init__(self, room: int) -> None:
        self.items: list[int] = []
        self.room = room
        self.attn = 0.0


class _Pool:
    """Leftover samples of one group, longest first, for GreedyFill: the next sample that fits a pack's room is a
    binary search on the (descending) lengths plus a skip over taken samples (union-find), so filling costs
    O(taken · log n) instead of a scan of the pool per pack."""

    def __init__(self, ids: np.ndarray, eff: np.ndarray) -> None:
        self.ids = ids
        self.len = eff[ids].astype(np.int64)
        self.neg = -self.len  # ascending, for searchsorted
        self.next = np.arange(ids.size + 1)  # next untaken position at or after k (ids.size = none)
        self.left = ids.size

    def _find(self, k: int) -> int:
        root = k
        while self.next[root] != root:
            root = self.next[root]
        while self.next[k] != root:
            self.next[k], k = root, self.next[k]
        return root

    def fill(self, p: _Pack, sp: int) -> None:
        while self.left and p.room > 0:
            # longest sample with ceil(len / sp) <= room, i.e. len <= room · sp
            k = self._find(int(np.searchsorted(self.neg, -p.room * sp, side="left")))
            if k >= self.ids.size:
                return
            n = int(self.len[k])
            p.items.append(int(self.ids[k]))
            p.room -= math.ceil(n / sp)
            p.attn += float(n) ** 2
            self.next[k] = k + 1
            self.left -= 1

    def remaining(self) -> list[int]:
        out, k = [], self._find(0)
        while k < self.ids.size:
            out.append(int(self.ids[k]))
            k = self._find(k + 1)
        return out


@register
class HBP(Planner):
    """Hierarchical balance packing (see the module docstring)."""

    name = "hbp"
    whole_run = True
    options = ("groups", "lengths", "profiles", "step_tokens", "isf_iters", "greedy_fill", "balance", "curriculum",
               "widen")

    def plan(self, lengths: np.ndarray, batches: Sequence[np.ndarray], ctx: PlanContext, *,
             max_len: int | None = None, overlong: str = "split") -> Plan:
        check_lengths(lengths, "lengths")  # a zero, negative or fractional length: ValueError naming the sample
        scope = np.sort(np.concatenate(batches)) if len(batches) else np.zeros(0, dtype=np.int64)
        world = ctx.world
        groups, report = self._groups(lengths[scope], ctx, world)
        costs = {g: self._group_cost(ctx.cost, g, world) for g in groups}
        for g in groups:
            if world % g.sp or costs[g].token_cap(g.ckpt) < math.ceil(g.length / g.sp):
                raise ValueError(f"HBP group {g.tag}: sp must divide the world ({world}) and a pack must fit memory "
                                 f"(cap {costs[g].token_cap(g.ckpt)} tokens per rank)")
        top = groups[-1].length
        limit = top if max_len is None else min(max_len, top)
        eff, truncated, dropped, n_split = apply_overlong(lengths, scope, limit, overlong)
        ids = scope[eff[scope] > 0]
        # samples over the limit (the top group, or a shorter --max-len under split) run as chains of pieces of at
        # most the limit; the rest are packed whole
        chains = ids[eff[ids] > limit]
        packs = self._pack(ids[eff[ids] <= limit], eff, groups, ctx)
        # default step size: one pack of the longest group per replica of that group
        step_tokens = int(ctx.option("step_tokens", top * (world // groups[-1].sp)))
        steps_by_group = [self._steps(g, packs[j], eff, costs[g], ctx, step_tokens, world)
                          for j, g in enumerate(groups)]
        self._add_chains(chains, eff, groups[-1], steps_by_group[-1], costs[groups[-1]], ctx, world, limit)
        steps = self._order(steps_by_group, groups, ctx)
        meta = {"seed": ctx.seed, "dp": ctx.dp, "cp": ctx.cp, "tp": ctx.cost.cfg.tp, "pp": ctx.cost.cfg.pp,
                "model": ctx.cost.model.name, "hardware": ctx.cost.hw.name, "token_cap": ctx.token_cap,
                "ckpt_layers": ctx.ckpt_layers, "options": dict(ctx.options), "hbp": report,
                "overlong": {"policy": overlong, "limit": limit, "split": n_split, "truncated": len(truncated),
                         "split_len": max_len if max_len is not None and overlong == "split" else None,
                             "dropped": len(dropped)}}
        tick("planned", len(batches))  # HBP plans the whole scope at once
        return Plan(planner=self.name, world=world, lengths={int(s): int(lengths[s]) for s in scope},
                    steps=tuple(steps), truncated=truncated, dropped=dropped, meta=meta)

    # --- 1. groups ------------------------------------------------------------------------------------------
    @staticmethod
    def _groups(lengths: np.ndarray, ctx: PlanContext, world: int) -> tuple[list[Group], dict[str, Any]]:
        if ctx.option("groups", None):
            groups = parse_groups(ctx.option("groups", ""))
            return groups, {"groups": [g.tag for g in groups], "selection": "manual"}
        cand = ctx.option("lengths", None)
        candidates = [int(x) for x in str(cand).split(",")] if cand else None
        widen = ctx.flag("widen", False)
        sp_set = None if widen else [d for d in (1, 2, 4, 8, 16) if ctx.cp % d == 0]  # divisors of --cp
        groups, report = select_groups(lengths, ctx.cost, world, candidates=candidates, sp_set=sp_set,
                                       profiles=ctx.option("profiles", None))
        return groups, report | {"selection": "auto"}

    @staticmethod
    def _group_cost(cost: CostModel, g: Group, world: int) -> CostModel:
        # a configured token cap (--token-cap) holds for every group; memory sets it otherwise
        return CostModel(cost.model, cost.hw, replace(cost.cfg, cp=g.sp, dp=world // g.sp, ckpt_layers=g.ckpt))

    # --- 2-3. packing and GreedyFill ------------------------------------------------------------------------
    def _pack(self, ids: np.ndarray, eff: np.ndarray, groups: list[Group], ctx: PlanContext) -> list[list[_Pack]]:
        """Per group: ISF packs; then, longest group first, its packs (with its own under-full ones re-packed) are
        topped up from the under-full samples of shorter groups (GreedyFill)."""
        bounds = [0] + [g.length for g in groups]
        full: list[list[_Pack]] = []
        pools: list[_Pool] = []
        for j, g in enumerate(groups):
            members = ids[(eff[ids] > bounds[j]) & (eff[ids] <= bounds[j + 1])]
            accepted, rest = self._isf(members, eff, g, ctx.seed + j, int(ctx.option("isf_iters", 10)))
            full.append(accepted)
            pools.append(_Pool(np.array(rest, dtype=np.int64), eff))
        fill = ctx.option("greedy_fill", True) in (True, 1, "1", "true", "True")
        packs: list[list[_Pack]] = [[] for _ in groups]
        for j in range(len(groups) - 1, -1, -1):
            g = groups[j]
            packs[j] = full[j] + self._as_packs(pools[j].remaining(), eff, g)
            if fill:
                for p in packs[j]:
                    for i in range(j - 1, -1, -1):
                        pools[i].fill(p, g.sp)
        return packs

    @staticmethod
    def _isf(members: np.ndarray, eff: np.ndarray, g: Group, seed: int, iters: int) -> tuple[list[_Pack], list[int]]:
        """ISF packs of group g: (accepted packs, samples of under-full packs, longest first)."""
        if members.size == 0:
            return [], []
        cap = g.length // g.sp
        w = -(-eff[members] // g.sp)
        threshold = cap - min(128, cap // 32)
        bins = isf(w, cap, threshold=threshold, iters=iters, seed=seed)
        if not bins:
            return [], []
        flat = np.concatenate([np.asarray(b, dtype=np.int64) for b in bins])
        starts = np.cumsum([0] + [len(b) for b in bins[:-1]])
        used = np.add.reduceat(w[flat], starts)
        attn = np.add.reduceat(eff[members[flat]].astype(np.float64) ** 2, starts)
        full, rest = [], []
        for b, u, a in zip(bins, used.tolist(), attn.tolist(), strict=True):
            if u >= threshold:
                p = _Pack(cap - u)
                p.items = members[b].tolist()
                p.attn = a
                full.append(p)
            else:
                rest.extend(members[b].tolist())
        rest.sort(key=lambda s: (-int(eff[s]), s))
        return full, rest

    @staticmethod
    def _as_packs(items: list[int], eff: np.ndarray, g: Group) -> list[_Pack]:
        """Next-fit of already-ordered samples into packs of group g."""
        out: list[_Pack] = []
        for s in items:
            w = math.ceil(int(eff[s]) / g.sp)
            if not out or out[-1].room < w:
                out.append(_Pack(g.length // g.sp))
            out[-1].items.append(s)
            out[-1].room -= w
            out[-1].attn += float(eff[s]) ** 2
        return out

    # --- 4. attention balance and steps ---------------------------------------------------------------------
    @staticmethod
    def _steps(g: Group, packs: list[_Pack], eff: np.ndarray, cost: CostModel, ctx: PlanContext, step_tokens: int,
               world: int) -> list[Step]:
        if not packs:
            return []
        dp = world // g.sp
        m = max(1, round(step_tokens / (g.length * dp)))
        if ctx.option("balance", True) in (True, 1, "1", "true", "True"):
            packs = sorted(packs, key=lambda p: (-p.attn, p.items[0]))
            packs = HBP._even_tail(packs, dp, g, eff)
        else:
            rng = np.random.default_rng([ctx.seed, g.length])
            packs = [packs[i] for i in rng.permutation(len(packs))]
        per_step = dp * m
        steps = []
        size = eff.tolist()
        rank = None if g.sp > 1 else 0
        for start in range(0, len(packs), per_step):
            chunk = packs[start:start + per_step]
            replicas: list[list[MicroBatch]] = [[] for _ in range(dp)]
            for idx, p in enumerate(chunk):
                row, col = divmod(idx, dp)
                r = col if row % 2 == 0 else dp - 1 - col  # snake order: equal attention per replica
                pieces = make_pieces(p.items, [0] * len(p.items), [size[s] for s in p.items], rank)
                replicas[r].append(MicroBatch(pieces=pieces, ckpt_layers=g.ckpt))
            steps.append(assemble_step(replicas, cp=g.sp, token_cap=cost.token_cap(g.ckpt), group=g.tag))
        return steps

    @staticmethod
    def _even_tail(packs: list[_Pack], dp: int, g: Group, eff: np.ndarray) -> list[_Pack]:
        """When the pack count is not a multiple of dp, the last row would leave replicas empty: spread the samples
        of those last packs over exactly dp packs (heaviest sample to the pack with least attention that fits)."""
        r = len(packs) % dp
        if r == 0 or len(packs) < dp:
            return packs
        samples = sorted((s for p in packs[-r:] for s in p.items), key=lambda s: (-int(eff[s]), s))
        new = [_Pack(g.length // g.sp) for _ in range(dp)]
        for s in samples:
            w = math.ceil(int(eff[s]) / g.sp)
            fits = [p for p in new if p.room >= w]
            if not fits:
                return packs  # cannot spread without overflowing: keep the packs as they were
            p = min(fits, key=lambda q: q.attn)
            p.items.append(s)
            p.room -= w
            p.attn += float(eff[s]) ** 2
        new = [p for p in new if p.items]
        return packs[:-r] + sorted(new, key=lambda p: (-p.attn, p.items[0]))

    def _add_chains(self, chains: np.ndarray, eff: np.ndarray, g: Group, steps: list[Step], cost: CostModel,
                    ctx: PlanContext, world: int, piece: int) -> None:
        """Samples longer than the limit: a chain of pieces of at most ``piece`` tokens (the top group's length or
        a shorter --max-len), one per micro-batch, on one replica."""
        if chains.size == 0:
            return
        dp = world // g.sp
        replicas: list[list[MicroBatch]] = [[] for _ in range(dp)]
        for n, s in enumerate(chains.tolist()):
            for p in chain_pieces(int(s), int(eff[s]), min(g.length, piece), None if g.sp > 1 else 0):
                replicas[n % dp].append(MicroBatch(pieces=(p,), ckpt_layers=g.ckpt))
        steps.append(assemble_step(replicas, cp=g.sp, token_cap=cost.token_cap(g.ckpt), group=g.tag))

    # --- 5. curriculum and interleaving ---------------------------------------------------------------------
    @staticmethod
    def _order(steps_by_group: list[list[Step]], groups: list[Group], ctx: PlanContext) -> list[Step]:
        warm = int(ctx.option("curriculum", 500))
        short = [j for j, g in enumerate(groups) if g.sp == 1] or [0]
        queues = [list(s) for s in steps_by_group]
        out: list[Step] = []
        rng = np.random.default_rng([ctx.seed, 7])
        while len(out) < warm and any(queues[j] for j in short):
            pool = [j for j in short if queues[j]]
            weights = np.array([len(queues[j]) for j in pool], dtype=np.float64)
            out.append(queues[pool[int(rng.choice(len(pool), p=weights / weights.sum()))]].pop(0))
        while any(queues):
            pool = [j for j in range(len(queues)) if queues[j]]
            weights = np.array([len(queues[j]) for j in pool], dtype=np.float64)
            out.append(queues[pool[int(rng.choice(len(pool), p=weights / weights.sum()))]].pop(0))
        return out
