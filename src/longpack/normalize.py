"""Loss normalisers as pure functions over plan-known token counts (HBP's stable Ave-Token loss; LongAlign).

Each function takes the loss-token counts of the samples on every rank — ``counts[r]`` lists rank r's samples
(over all its micro-batches of the step) — and returns per-sample weights ``w[r][i]``: rank r's loss is
Σ_i w[r][i] · Σ_t ℓ_{i,t}, and the step's objective is the mean of the rank losses (gradient averaging over DP).

=============  ===========================================  ==========================================
name           rank loss                                    objective over the step
=============  ===========================================  ==========================================
token_mean     Σ ℓ / Σ_{i∈B_l} T_i (per rank)               ranks with few tokens weigh more per token
sample_mean    (1/B_l) Σ_i Σ_t ℓ_i,t / T_i                  every sample equal, tokens of short ones
                                                            weigh more
sum            Σ ℓ                                          unnormalised (gradients grow with tokens)
ave_token      Σ ℓ / (B̄_l · T_ave), T_ave = Σ_{B_g} T / B_g  the global token mean, whatever the split
=============  ===========================================  ==========================================

HBP's Ave-Token uses the global-batch average token count T_ave (one all-reduce, or free from the plan). We take
B̄_l = B_g / N, the mean local batch: with packing, ranks hold different sample counts, and using each rank's own
B_l would weigh ranks unequally. Then every rank's weight is N / Σ_all T and the objective is exactly
Σ_all ℓ / Σ_all T. Cost: O(samples).

>>> counts = [[10, 30], [60]]                       # rank 0 has two samples, rank 1 one
>>> [[round(x, 4) for x in r] for r in ave_token(counts)]
[[0.02, 0.02], [0.02]]
>>> objective(ave_token(counts), counts, [[1.0, 1.0], [1.0]]) == 1.0   # per-token loss 1 -> mean 1
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["token_mean", "sample_mean", "loss_sum", "ave_token", "objective", "NORMALISERS"]

Counts = Sequence[Sequence[int]]
Weights = list[list[float]]


def token_mean(counts: Counts) -> Weights:
    out = []
    for rank in counts:
        total = sum(rank)
        out.append([1.0 / total if total else 0.0 for _ in rank])
    return out


def sample_mean(counts: Counts) -> Weights:
    return [[1.0 / (len(rank) * t) if t else 0.0 for t in rank] for rank in counts]


def loss_sum(counts: Counts) -> Weights:
    return [[1.0 for _ in rank] for rank in counts]


def ave_token(counts: Counts) -> Weights:
    ranks = len(counts)
    total = sum(sum(rank) for rank in counts)
    w = ranks / total if total else 0.0  # 1 / (B̄_l · T_ave) with B̄_l = B_g / N and T_ave = Σ T / B_g
    return [[w for _ in rank] for rank in counts]


def objective(weights: Weights, counts: Counts, mean_loss: Sequence[Sequence[float]]) -> float:
    """The step objective given each sample's mean per-token loss: mean over ranks of Σ_i w_i · T_i · ℓ̄_i."""
    per_rank = [sum(w * t * m for w, t, m in zip(wr, cr, lr, strict=True))
                for wr, cr, lr in zip(weights, counts, mean_loss, strict=True)]
    return sum(per_rank) / len(per_rank)


NORMALISERS: dict[str, Callable[[Counts], Weights]] = {"token_mean": token_mean, "sample_mean": sample_mean,
                                                       "sum": loss_sum, "ave_token": ave_token}
