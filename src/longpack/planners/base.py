"""What every planner shares: the request it answers, the global batches, the over-long policy.

A planner turns the lengths of the samples in each global batch into one :class:`~longpack.plan.Step`. The driver
(:func:`~longpack.planners.stream.make_plan`) does the rest the same way for all planners, so they are comparable:

1. :func:`global_batches` draws the optimizer steps' samples with one seeded permutation: every planner schedules
   the same samples in the same step (Adam stays equivalent; only placement and accumulation order differ).
2. :func:`apply_overlong` applies the over-long policy to samples longer than the limit (``max_len`` or what one
   micro-batch can hold, ``token_cap · cp``): ``split`` (default) cuts them into a chain of consecutive pieces,
   ``truncate`` keeps the first ``limit`` tokens, ``drop`` removes them with a reason, ``error`` refuses. Every
   affected sample is counted in the plan's ``meta["overlong"]``; nothing is lost silently.
3. The planner's ``plan_batch`` (planners/registry.py) returns the step's replicas; :func:`assemble_step` pads
   replicas with empty micro-batches to equal counts.

Cost: O(samples) for the driver; the planner's own cost is in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cost import CostModel
from ..plan import MicroBatch, Piece, Replica, Step

__all__ = ["PlanContext", "Batch", "global_batches", "apply_overlong", "assemble_step", "OverlongError",
           "chain_pieces", "place_chains", "OVERLONG_POLICIES"]

OVERLONG_POLICIES = ("split", "truncate", "drop", "error")


class OverlongError(ValueError):
    """A sample longer than every cap under ``--overlong error``; ``sample``: its index in the planned lengths."""

    def __init__(self, message: str, sample: int | None = None) -> None:
        super().__init__(message)
        self.sample = sample


@dataclass(frozen=True, kw_only=True)
class PlanContext:
    """Everything a planner may read: the cost model (with dp, cp, caps), the seed and planner options."""

    cost: CostModel
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.cost.cfg.dp

    @property
    def cp(self) -> int:
        return self.cost.cfg.cp

    @property
    def world(self) -> int:
        return self.cost.cfg.dp * self.cost.cfg.cp

    @property
    def ckpt_layers(self) -> int:
        return self.cost.cfg.ckpt_layers

    @property
    def token_cap(self) -> int:
        return self.cost.token_cap()

    def option(self, name: str, default: Any) -> Any:
        return self.options.get(name, default)

    def flag(self, name: str, default: bool) -> bool:
        """Option ``name`` as on/off: anything but 0, false, no or off (any case) is on."""
        return str(self.options.get(name, default)).strip().lower() not in ("0", "false", "no", "off")

    def count(self, name: str, example: str) -> int | None:
        """Option ``name`` as a whole number >= 0 (None when not given), or one line naming it and the fix."""
        text = self.options.get(name)
        if text is None or text == "":
            return None
        try:
            value = int(str(text).strip())
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"--opt {name}={text!r}: expected a whole number >= 0 (0 turns it off), e.g. "
                             f"{name}={example}")
        return value

    def numbers(self, name: str, cast: Callable[[str], Any], example: str, kind: str) -> list[Any]:
        """Option ``name`` as comma-separated values ([] when not given), or one line naming it and the fix."""
        text = self.options.get(name)
        if text is None or text == "":
            return []
        try:
            return [cast(x) for x in str(text).split(",")]
        except ValueError:
            raise ValueError(f"--opt {name}={text!r}: expected comma-separated {kind}, e.g. {name}={example}") from None


@dataclass(frozen=True)
class Batch:
    """One global batch after the over-long policy: ``samples[i]`` has ``lengths[i]`` tokens to schedule;
    ``piece_len`` is the longest piece one micro-batch can take at the configured checkpointing (longer samples
    must be split into a chain); ``split_len`` is the user's ``--max-len`` under ``--overlong split`` (a limit
    no piece may exceed whatever the memory), None when not given."""

    index: int
    samples: np.ndarray
    lengths: np.ndarray
    piece_len: int
    split_len: int | None = None

    @property
    def whole(self) -> np.ndarray:
        """Positions (into samples/lengths) of samples that fit one micro-batch."""
        return np.flatnonzero(self.lengths <= self.piece_len)

    @property
    def chains(self) -> np.ndarray:
        """Positions of samples that must be split into chained pieces."""
        return np.flatnonzero(self.lengths > self.piece_len)


def global_batches(n_samples: int, global_batch: int, *, seed: int = 0, steps: int | None = None,
                   epochs: int = 1) -> list[np.ndarray]:
    """Sample ids of each optimizer step: one seeded permutation cut into ``global_batch``-sized steps.

    The last, smaller batch is kept (never dropped). ``steps`` keeps only the first ``steps`` batches. With
    ``epochs`` > 1, epoch e (from 0) is its own permutation (seeded by ``seed`` and e; epoch 0 as without epochs)
    of the ids ``e * n_samples + i`` — each epoch's copy of sample i is a sample of its own in the plan.

    >>> [b.tolist() for b in global_batches(5, 2, seed=0)]
    [[2, 4], [3, 0], [1]]
    """
    if global_batch < 1:
        raise ValueError(f"--global-batch {global_batch}: must be >= 1")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps {steps}: must be >= 1")
    if epochs < 1:
        raise ValueError(f"--epochs {epochs}: must be >= 1")
    batches = []
    for e in range(epochs):
        order = np.random.default_rng(seed if e == 0 else [seed, e]).permutation(n_samples) + e * n_samples
        batches += [order[i:i + global_batch] for i in range(0, n_samples, global_batch)]
    return batches[:steps] if steps is not None else batches


def apply_overlong(lengths: np.ndarray, scope: np.ndarray, limit: int, policy: str,
                   ) -> tuple[np.ndarray, dict[int, int], dict[int, str], int]:
    """Effective lengths after the policy, plus truncated {sample: kept}, dropped {sample: reason}, split count."""
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"--overlong {policy!r}: choose one of {', '.join(OVERLONG_POLICIES)}")
    eff = lengths.copy()
    over = scope[lengths[scope] > limit]
    truncated: dict[int, int] = {}
    dropped: dict[int, str] = {}
    if over.size and policy == "error":
        s = int(over[0])
        raise OverlongError(f"sample {s} has {int(lengths[s])} tokens > limit {limit} (token cap x cp or --max-len);"
                            " use --overlong split|truncate|drop, a larger --cp, or more checkpointing", s)
    if policy == "truncate":
        for s in over.tolist():
            truncated[s] = limit
        eff[over] = limit
    elif policy == "drop":
        for s in over.tolist():
            dropped[s] = f"{int(lengths[s])} tokens > limit {limit}"
        eff[over] = 0
    return eff, truncated, dropped, int(over.size) if policy == "split" else 0


def chain_pieces(sample: int, length: int, piece_len: int, cp_rank: int | None = None) -> list[Piece]:
    """Consecutive pieces of at most ``piece_len`` tokens covering [0, length), in order.

    >>> [tuple(p[1:3]) for p in chain_pieces(7, 10, 4)]
    [(0, 4), (4, 8), (8, 10)]
    """
    n = math.ceil(length / piece_len)
    return [Piece(sample, i * piece_len, min(length, (i + 1) * piece_len), cp_rank) for i in range(n)]


def place_chains(batch: Batch, replicas: list[list[MicroBatch]], ctx: PlanContext, pad: bool = False,
                 rows: int = 0) -> None:
    """Append each over-long sample's pieces, one per micro-batch and in order, to the replica holding the fewest
    tokens (``pad``: each piece as a padded row of its own length). Packed (not ``pad``), that replica's whole
    samples then fill the room beside the chain's last piece where that empties micro-batches (planners/beside.py;
    ``rows``: most samples a micro-batch may hold, 0 for no limit)."""
    from .beside import fill_replica

    load = [sum(mb.tokens for mb in r) for r in replicas]
    holding: set[int] = set()
    for i in batch.chains.tolist():
        target = min(range(len(replicas)), key=lambda r: (load[r], r))
        for p in chain_pieces(int(batch.samples[i]), int(batch.lengths[i]), batch.piece_len):
            replicas[target].append(MicroBatch(pieces=(p,), ckpt_layers=ctx.ckpt_layers,
                                               pad_to=p.stop - p.start if pad else 0))
        load[target] += int(batch.lengths[i])
        holding.add(target)
    if pad or rows == 1 or not holding:
        return
    length = dict(zip(batch.samples.tolist(), batch.lengths.tolist(), strict=True)).__getitem__
    for r in sorted(holding):
        replicas[r][:] = fill_replica(replicas[r], ctx.cp, ctx.token_cap, ctx.cost, length, rows)


def assemble_step(replicas: Sequence[Sequence[MicroBatch]], *, cp: int, token_cap: int, group: str = "") -> Step:
    """A Step whose replicas are padded with empty micro-batches to the same count."""
    depth = max((len(r) for r in replicas), default=0)
    reps = tuple(Replica(micro_batches=tuple(r) + (MicroBatch(),) * (depth - len(r))) for r in replicas)
    return Step(cp=cp, token_cap=token_cap, replicas=reps, group=group)
