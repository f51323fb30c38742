"""Data for the runtime: a synthetic token corpus, the collator from plan pieces to tensors, and the per-rank
plan sampler.

* :class:`SyntheticCorpus` — token ids for any sample, deterministic from (seed, sample), so every rank and every
  run sees the same text offline. Each sample follows a noisy arithmetic progression modulo the vocabulary: a
  pattern a small model can learn, so loss curves mean something.
* :func:`collate` — pieces of one micro-batch (and one CP rank's share of them) -> ``input_ids``, ``labels``
  (the source's next-token targets: the user's labels or masks, or every next token; the last token of a sample
  has none, the last token of a chunk predicts the next chunk's first), ``position_ids`` (restarting per
  sample, continuing across chunks) and ``cu_seqlens`` from the pieces' lengths. Padded micro-batches
  (``pad_to``) pad each row to that length with ignored targets.
* :class:`PlanSampler` — the micro-batches of one rank, step by step; ``state_dict``/``load_state_dict`` resume
  mid-epoch at the exact next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ...plan import MicroBatch, Plan
from ...rows import IGNORE
from .host import to_device

__all__ = ["SyntheticCorpus", "Source", "Packed", "collate", "PlanSampler", "IGNORE"]


def _cat(parts: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)



class SyntheticCorpus:
    """``tokens(sample, n)``: the first n token ids of ``sample`` (seeded; vocabulary [1, vocab), 0 is padding)."""

    def __init__(self, vocab: int, seed: int = 0, noise: float = 0.1) -> None:
        if vocab < 4:
            raise ValueError(f"vocab={vocab}: need at least 4 token ids")
        self.vocab, self.seed, self.noise = vocab, seed, noise
        self._cache: dict[int, np.ndarray] = {}

    def tokens(self, sample: int, n: int) -> np.ndarray:
        cached = self._cache.get(sample)
        if cached is not None and cached.size >= n:
            return cached[:n]
        rng = np.random.default_rng([self.seed, sample])
        start, stride = rng.integers(1, self.vocab), rng.integers(1, 7)
        seq = (start + stride * np.arange(n)) % (self.vocab - 1) + 1
        flip = rng.random(n) < self.noise
        seq[flip] = rng.integers(1, self.vocab, int(flip.sum()))
        self._cache[sample] = seq
        return seq

    def next_targets(self, sample: int, n: int) -> np.ndarray:
        """Per-position next-token targets of the first n tokens (every next token; the last has none)."""
        toks = self.tokens(sample, n)
        out = np.full(n, IGNORE, dtype=np.int64)
        out[:-1] = toks[1:]
        return out

    def target_count(self, sample: int, n: int) -> int:
        return max(0, n - 1)


class Source(Protocol):
    """What the runtime reads samples from: :class:`SyntheticCorpus` (demos, tests) or
    :class:`longpack.rows.TokenRows` (the user's rows and targets)."""

    def tokens(self, sample: int, n: int) -> np.ndarray: ...

    def next_targets(self, sample: int, n: int) -> np.ndarray: ...

    def target_count(self, sample: int, n: int) -> int: ...


class EpochSource:
    """``inner`` over several epochs: the plan's sample ``e * n + i`` is epoch e's copy of ``inner``'s sample i
    (planners.global_batches); everything else is ``inner``'s."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def tokens(self, sample: int, n: int) -> np.ndarray:
        return self.inner.tokens(sample % self.n, n)

    def next_targets(self, sample: int, n: int) -> np.ndarray:
        return self.inner.next_targets(sample % self.n, n)

    def target_count(self, sample: int, n: int) -> int:
        return self.inner.target_count(sample % self.n, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Packed:
    """One micro-batch on one rank as tensors; ``docs`` lists (sample, start, stop) per document row."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: list[int]
    docs: list[tuple[int, int, int]]
    sample_of_token: torch.Tensor
    weights: torch.Tensor | None = None  # each token's target weight in the step objective (runtime/kernel/loss.py)
    n_targets: int = 0  # positions with a real target, counted on the host
    uniform: float | None = None  # the one weight of every target, when they share one (runtime/kernel/liger_loss.py)
    cu_device: torch.Tensor | None = None  # ``cu_seqlens`` as int32 on the device, once the batch is moved there

    def to(self, device: torch.device) -> Packed:
        """The tensors the model, the loss and the attention read, moved to ``device`` in one copy: ids, labels,
        positions, the weights' bits and the document offsets in one int64 buffer (pinned and not blocking on
        CUDA: runtime/kernel/host.py), sliced on the device; the host keeps the counts and ``sample_of_token``."""
        if device.type == "cpu":
            return self
        n, parts = self.input_ids.shape[0], [self.input_ids, self.labels, self.position_ids]
        if self.weights is not None:
            parts.append(self.weights.to(torch.float64).view(torch.int64))
        parts.append(torch.tensor(self.cu_seqlens, dtype=torch.int64))
        buf = to_device(torch.cat(parts), device)
        self.input_ids, self.labels, self.position_ids = buf[:n], buf[n:2 * n], buf[2 * n:3 * n]
        if self.weights is not None:
            self.weights = buf[3 * n:4 * n].view(torch.float64)
        self.cu_device = buf[(len(parts) - 1) * n:].to(torch.int32)
        return self

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens."""
        return sum(stop - start for _, start, stop in self.docs)

    @property
    def targets(self) -> int:
        """Positions with a real target."""
        return self.n_targets


def collate(mb: MicroBatch, corpus: Source, effective_length: Callable[[int], int],
            pieces: list[tuple[int, int, int]] | None = None) -> Packed:
    """Tensors for ``mb`` (or for explicit ``pieces`` (sample, start, stop), e.g. one CP rank's share)."""
    spans = pieces if pieces is not None else [(p.sample, p.start, p.stop) for p in mb.pieces]
    ids, labels, pos, cu, owner = [], [], [], [0], []
    for sample, start, stop in spans:
        n = effective_length(sample)
        row = corpus.tokens(sample, n)[start:stop]
        tgt = corpus.next_targets(sample, n)[start:stop]
        width = max(mb.pad_to, stop - start) if mb.pad_to else stop - start
        pad = width - (stop - start)
        ids.append(np.concatenate([row, np.zeros(pad, dtype=row.dtype)]))
        labels.append(np.concatenate([tgt, np.full(pad, IGNORE)]))
        pos.append(np.arange(start, start + width))
        owner.append(np.full(width, sample))
        cu.append(cu[-1] + width)
    label_t = _cat(labels).long()
    return Packed(input_ids=_cat(ids).long(), labels=label_t, position_ids=_cat(pos).long(),
                  cu_seqlens=cu, docs=list(spans), sample_of_token=_cat(owner).long(),
                  n_targets=int((label_t != IGNORE).sum()))


class PlanSampler:
    """Iterates one rank's micro-batches of a Plan. Rank r of a step with CP degree c is replica r // c, CP rank
    r % c (the world is fixed; HBP steps change c); in a step on groups of several sizes, the groups follow one
    another in replica order (:meth:`Step.position`). A plan still being made (runtime/run/ahead.py) gives ``steps``,
    the run's step count, and ``ready(step)``, which blocks until that step is planned; ``waited`` is the seconds
    the last step waited for it."""

    def __init__(self, plan: Plan, rank: int, steps: int | None = None,
                 ready: Callable[[int], float] | None = None) -> None:
        if not 0 <= rank < plan.world:
            raise ValueError(f"rank {rank} outside the plan's world of {plan.world}")
        self.plan, self.rank, self.step = plan, rank, 0
        self.n = len(plan.steps) if steps is None else steps
        self.ready, self.waited = ready, 0.0

    def position(self, step: int) -> tuple[int, int]:
        """(replica, CP rank) of this rank in ``step`` (groups of several sizes: one after another)."""
        return self.plan.steps[step].position(self.rank)

    def micro_batches(self, step: int) -> tuple[MicroBatch, ...]:
        replica, _ = self.position(step)
        return self.plan.steps[step].replicas[replica].micro_batches

    def __iter__(self) -> Iterator[tuple[int, tuple[MicroBatch, ...]]]:
        while self.step < self.n:
            step = self.step
            self.waited = self.ready(step) if self.ready is not None else 0.0
            self.step += 1
            yield step, self.micro_batches(step)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "rank": self.rank}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if not 0 <= int(state["step"]) <= self.n:
            raise ValueError(f"sampler state step={state['step']} outside the plan's {self.n} steps")
        self.step = int(state["step"])
