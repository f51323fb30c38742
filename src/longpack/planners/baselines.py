"""The baselines the three papers compare against, each on the Plan contract: random_padded, sorted, isf /
ffd / bfd / spfhp, fixed_cp and one_seq. Every one shards each sequence over the whole CP group, as a fixed-CP
framework does; they differ in how they form micro-batches and deal them to DP replicas (docs/PLANNERS.md, "The
papers' baselines", has the table and the capacity rule). Guarantees: coverage, caps, chunk order, equal
micro-batch counts, determinism by seed. Cost: O(n log n) per global batch (O(n · bins) for ffd/bfd).

>>> import numpy as np
>>> from longpack.cost import CostModel, TrainConfig
>>> from longpack.hardware import get_hardware
>>> from longpack.model import get_model
>>> from longpack.planners.base import PlanContext, global_batches
>>> cost = CostModel(get_model("tiny"), get_hardware("cpu"), TrainConfig(dp=2, cp=1, token_cap=100))
>>> plan = FixedCP().plan(np.array([60, 50, 40, 30]), global_batches(4, 4), PlanContext(cost=cost))
>>> plan.validate(); [[mb.tokens for mb in r.micro_batches] for r in plan.steps[0].replicas]
[[100], [80]]
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from ..plan import MicroBatch, make_pieces
from .base import Batch, PlanContext, assemble_step, place_chains
from .columnar import fixed_cp_steps, isf_steps
from .packers import PACKERS, next_fit
from .registry import Planner, register

__all__ = ["RandomPadded", "Sorted", "PackedBaseline", "FixedCP", "OneSeq"]


def _rank_weights(lengths: np.ndarray, cp: int) -> np.ndarray:
    return -(-lengths // cp)  # ceil(len / cp): what one CP rank holds of a sharded sequence


def _sharded(batch: Batch, positions: list[int], ckpt: int, pad_to: int = 0) -> MicroBatch:
    idx = np.asarray(positions, dtype=np.int64)
    pieces = make_pieces(batch.samples[idx].tolist(), [0] * idx.size, batch.lengths[idx].tolist(), None)
    return MicroBatch(pieces=pieces, ckpt_layers=ckpt, pad_to=pad_to)


def _padded_groups(lengths: np.ndarray, order: list[int], cp: int, cap: int, max_rows: int) -> list[list[int]]:
    """Greedy consecutive groups (in ``order``) whose padded size rows · ceil(max/cp) stays within ``cap``."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, int(lengths[i]))
        rows = len(cur) + 1
        if cur and (rows * math.ceil(new_longest / cp) > cap or (max_rows and rows > max_rows)):
            groups.append(cur)
            cur, new_longest = [], int(lengths[i])
        cur.append(i)
        longest = new_longest
    if cur:
        groups.append(cur)
    return groups


def _deal(items: list, k: int) -> list[list]:
    """Round-robin: item j to replica j mod k."""
    return [items[r::k] for r in range(k)]


@register
class RandomPadded(Planner):
    """Random micro-batches padded to their longest sequence (HBP Table 3 "random").

    Each replica takes every dp-th sample of the shuffled batch (DistributedSampler style) and fills
    micro-batches in that order while rows · ceil(longest/cp) ≤ token cap and rows ≤ ``micro_batch_size``
    (option, default 8; 0 = as many as fit).
    """

    name = "random_padded"
    options = ("micro_batch_size",)

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
        rng = np.random.default_rng([ctx.seed, batch.index])
        whole = batch.whole[rng.permutation(batch.whole.size)].tolist()
        replicas: list[list[MicroBatch]] = []
        for part in _deal(whole, dp):
            groups = _padded_groups(batch.lengths, part, cp, cap, ctx.option("micro_batch_size", 8))
            replicas.append([_sharded(batch, g, ctx.ckpt_layers, int(batch.lengths[g].max())) for g in groups])
        place_chains(batch, replicas, ctx, pad=True)
        return assemble_step(replicas, cp=cp, token_cap=cap)


@register
class Sorted(Planner):
    """LongAlign sorted batching: sort the batch by length, cut consecutive padded micro-batches of at most
    ``micro_batch_size`` rows (option, default 8; 0 = as many as the token cap allows, HBP's dynamic B), shuffle
    them, deal them round-robin to replicas.

    The papers sort the whole dataset and draw consecutive groups as global batches; here every planner must
    schedule the same global batches (equal optimizer steps), so sorting happens inside each global batch.
    Filling to the token cap then spans a wide length range and pads heavily, hence the row limit."""

    name = "sorted"
    options = ("micro_batch_size",)

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
        whole = batch.whole
        order = whole[np.lexsort((batch.samples[whole], batch.lengths[whole]))].tolist()
        groups = _padded_groups(batch.lengths, order, cp, cap, ctx.option("micro_batch_size", 8))
        rng = np.random.default_rng([ctx.seed, batch.index])
        groups = [groups[j] for j in rng.permutation(len(groups))]
        mbs = [_sharded(batch, g, ctx.ckpt_layers, int(batch.lengths[g].max())) for g in groups]
        replicas = _deal(mbs, dp)
        place_chains(batch, replicas, ctx, pad=True)
        return assemble_step(replicas, cp=cp, token_cap=cap)


class PackedBaseline(Planner):
    options: ClassVar[tuple[str, ...]] = ("pack_len",)
    """Naive packing to a fixed length with one packer, every pack one micro-batch sharded over the CP group.

    The pack length is the run's limit, min(--max-len, token cap x cp) (option ``pack_len`` sets it, within the
    cap). Packs are shuffled with
    the seed and dealt round-robin to replicas, as a random sampler over packs does (HBP's ISF baseline).
    """

    packer = ""

    @staticmethod
    def pack_cap(ctx: PlanContext, piece_len: int) -> int:
        """Per rank, a pack of pack_len tokens sharded over cp holds ceil(pack_len / cp) (a sample exactly at an
        odd limit must fit), within the token cap."""
        return min(ctx.token_cap, -(-int(ctx.option("pack_len", piece_len)) // ctx.cp))

    @staticmethod
    def too_short(ctx: PlanContext, piece_len: int, sample: int) -> ValueError:
        """The one-line refusal of a pack length shorter than ``sample``."""
        return ValueError(f"--pack-len {ctx.option('pack_len', piece_len)}: shorter than sample {sample}; raise it "
                          "or lower --max-len")

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
        pack_cap = self.pack_cap(ctx, batch.piece_len)
        whole = batch.whole
        weights = _rank_weights(batch.lengths[whole], cp)
        if weights.size and int(weights.max()) > pack_cap:
            raise self.too_short(ctx, batch.piece_len, int(batch.samples[whole[int(np.argmax(weights))]]))
        bins = PACKERS[self.packer](weights, pack_cap) if weights.size else []
        rng = np.random.default_rng([ctx.seed, batch.index])
        bins = [bins[j] for j in rng.permutation(len(bins))]
        mbs = [_sharded(batch, [int(whole[i]) for i in b], ctx.ckpt_layers) for b in bins]
        replicas = _deal(mbs, dp)
        place_chains(batch, replicas, ctx)
        return assemble_step(replicas, cp=cp, token_cap=cap)


@register
class ISF(PackedBaseline):
    """Naive packing with ISF (OmniBal iterative sampling and filtering), HBP's baseline packer, planned in
    columns for many batches at once (planners/columnar.py); its packs are shuffled by counter-keyed sorts
    (planners/isf_rows.py) rather than numpy's Generator, so every batch plans alike alone or with the run."""

    name, packer = "isf", "isf"
    options = ("pack_len", "isf_iters")

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        return self.plan_many([batch], ctx)[0]

    def plan_many(self, batches, ctx: PlanContext):
        piece_len = batches[0].piece_len if batches else 1
        return isf_steps(batches, ctx, self.pack_cap(ctx, piece_len), int(ctx.option("isf_iters", 10)),
                         lambda sample: self.too_short(ctx, piece_len, sample))


@register
class FFD(PackedBaseline):
    """Naive packing with first-fit decreasing."""

    name, packer = "ffd", "ffd"


@register
class BFD(PackedBaseline):
    """Naive packing with best-fit decreasing."""

    name, packer = "bfd", "bfd"


@register
class SPFHP(PackedBaseline):
    """Naive packing with shortest-pack-first histogram packing."""

    name, packer = "spfhp", "spfhp"


@register
class FixedCP(Planner):
    """DeepSpeed-style fixed CP (Skrull's baseline): replica r takes the r-th contiguous slice
    of the global batch and packs it in arrival order (next fit) into micro-batches up to the token cap; every
    sequence is sharded over the whole CP group, whatever its length.

    Option ``micro_batch_size`` (default 0 = pack to the cap) caps the sequences per micro-batch; 1 is DeepSpeed's
    default ``train_micro_batch_size_per_gpu`` with gradient accumulation over single sequences, the baseline
    Skrull measured against (DeepSpeed has no packing of its own)."""

    name = "fixed_cp"
    options = ("micro_batch_size",)

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
        whole = batch.whole
        replicas = []
        for part in np.array_split(whole, dp):
            mbs = ctx.option("micro_batch_size", 0)
            bins = next_fit(_rank_weights(batch.lengths[part], cp), cap, mbs) if part.size else []
            replicas.append([_sharded(batch, [int(part[i]) for i in b], ctx.ckpt_layers) for b in bins])
        place_chains(batch, replicas, ctx, rows=ctx.option("micro_batch_size", 0))
        return assemble_step(replicas, cp=cp, token_cap=cap)

    def plan_many(self, batches, ctx: PlanContext):
        return fixed_cp_steps(batches, ctx, int(ctx.option("micro_batch_size", 0)))


@register
class OneSeq(Planner):
    """Megatron-style (ChunkFlow's baseline): micro-batch size 1, every sequence sharded over a
    CP group sized for the longest, sequences dealt round-robin to replicas in batch order."""

    name = "one_seq"

    def plan_batch(self, batch: Batch, ctx: PlanContext):
        cap, cp, dp = ctx.token_cap, ctx.cp, ctx.dp
        mbs = [_sharded(batch, [int(i)], ctx.ckpt_layers) for i in batch.whole]
        replicas = _deal(mbs, dp)
        place_chains(batch, replicas, ctx, rows=1)
        return assemble_step(replicas, cp=cp, token_cap=cap)
