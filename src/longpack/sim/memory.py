"""What one rank of a replica holds in memory while each of its micro-batches runs, in the simulator's terms.

A replica's micro-batches run in order. Per CP rank, the peak while micro-batch m runs is the cost model's
``static + α(k_m)·(tokens_m + held) + K/V store + reserve`` (:meth:`CostModel.memory_bytes`), where

* ``held`` is what unfinished chunk chains keep: a chain runs forward over all its chunks before its backward
  (descending), so each earlier chunk not marked ``recompute`` keeps its whole micro-batch's activations — the
  chain's piece and any sample beside it — until the chain's last chunk, each priced at the checkpointing it ran
  with;
* a token of a piece sharded over the CP group weighs more than a local one (the gathered K/V its layers keep:
  :meth:`CostModel.shard_act_bytes_per_token`), here and in what a chain keeps;
* the K/V store is that of the earlier tokens of every unfinished chain (recomputed chunks leave theirs too), kept
  until the chain's last chunk, in every micro-batch between.

A chain's last chunk frees both. :class:`ReplicaMemory` walks a replica micro-batch by micro-batch; the simulator
reports its peaks and planners read the room they leave. Cost: O(pieces + ranks · unfinished chains) per
micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Piece

__all__ = ["ReplicaMemory"]


class ReplicaMemory:
    """The walk over one replica at CP degree ``cp``; ``length(sample)`` is the tokens the plan covers of it (a
    piece is a chain's chunk when it is not the whole sample)."""

    def __init__(self, cost: CostModel, cp: int, length: Callable[[int], int]) -> None:
        self.cost, self.cp, self.length = cost, cp, length
        self.group_cost = cost.at_cp(cp) if cp > 1 else cost  # a sharded token's surcharge is the group's degree's
        # chain sample -> {checkpointed layers: activation tokens per rank} its kept chunks hold until its last
        self.held: dict[int, dict[int, np.ndarray]] = {}
        self.stored: dict[int, np.ndarray] = {}  # chain sample -> per rank, the K/V store of the tokens it has run

    def is_chunk(self, p: Piece) -> bool:
        return p.start > 0 or p.stop < self.length(p.sample)

    def peak(self, mb: MicroBatch, tokens: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        """Peak bytes per rank while ``mb`` runs (``tokens``, ``prefix``: its activation tokens and own pieces'
        K/V prefix per rank, as :func:`~longpack.sim.simulate.micro_batch_times` gives them); then the walk moves
        past it."""
        chains = [p for p in mb.pieces if self.is_chunk(p)]
        tokens = self._with_shards(mb, tokens)
        if self.stored:  # chains whose pieces ran earlier; a chain with a piece here has its store in prefix
            here = {p.sample for p in chains}
            prefix = prefix + sum((kv for x, kv in self.stored.items() if x not in here), np.zeros(self.cp))
        mem = self._resident(mb, tokens, prefix)
        for p in chains:
            self._advance(mb, p, tokens)
        return mem

    def skip(self, mb: MicroBatch, tokens: np.ndarray) -> None:
        """Move past ``mb`` without pricing it (what :meth:`peak` does after pricing)."""
        tokens = self._with_shards(mb, tokens)
        for p in mb.pieces:
            if self.is_chunk(p):
                self._advance(mb, p, tokens)

    def _advance(self, mb: MicroBatch, p: Piece, tokens: np.ndarray) -> None:
        if p.stop == self.length(p.sample):
            self.held.pop(p.sample, None)  # last chunk: the chain's backward runs and frees it all
            self.stored.pop(p.sample, None)
            return
        if not mb.recompute:
            kept = self.held.setdefault(p.sample, {})
            kept[mb.ckpt_layers] = kept.get(mb.ckpt_layers, np.zeros(self.cp)) + tokens
        self.stored[p.sample] = self._spread(p, p.stop)  # every chunk, recomputed or not, leaves its K/V

    def prefix(self, mb: MicroBatch) -> np.ndarray:
        """Per rank, the K/V prefix of ``mb``'s own chunks (what :func:`~longpack.sim.simulate.micro_batch_times`
        gives as its prefix)."""
        out = np.zeros(self.cp)
        for p in mb.pieces:
            if self.is_chunk(p):
                out += self._spread(p, p.start)
        return out

    def _with_shards(self, mb: MicroBatch, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` with each rank's tokens of sharded pieces weighed up by what they hold beyond a local token
        (:meth:`CostModel.shard_act_bytes_per_token`, at the micro-batch's checkpointing), in local tokens."""
        if self.cp == 1:
            return tokens
        extra = self.group_cost.shard_act_bytes_per_token(mb.ckpt_layers)
        shard = sum((math.ceil((mb.pad_to or p.stop - p.start) / self.cp) for p in mb.pieces if p.cp_rank is None), 0)
        if not extra or not shard:
            return tokens
        return tokens + shard * extra / self.cost.act_bytes_per_token(mb.ckpt_layers)

    def _spread(self, p: Piece, tokens: int) -> np.ndarray:
        """``tokens`` of ``p``'s sample as its ranks hold them: an equal share on each when sharded, else on its own."""
        out = np.zeros(self.cp)
        if p.cp_rank is None or self.cp == 1:
            out += tokens / self.cp
        else:
            out[p.cp_rank] = tokens
        return out

    def _resident(self, mb: MicroBatch, tokens: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        cost, held = self.cost, self.held
        same = sum((t for kept in held.values() for k, t in kept.items() if k == mb.ckpt_layers), np.zeros(tokens.size))
        other = sum((cost.hw.fragmentation * cost.act_bytes_per_token(k) * t
                     for kept in held.values() for k, t in kept.items() if k != mb.ckpt_layers),
                    np.zeros(tokens.size))
        if not mb.pieces and not held and not np.any(prefix):
            return np.full(tokens.size, float(cost.memory_bytes(0.0)))
        return np.asarray(cost.memory_bytes(tokens + same, mb.ckpt_layers, prefix), dtype=np.float64) + other
