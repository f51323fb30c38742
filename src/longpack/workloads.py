"""Built-in workloads: seeded sequence-length generators that reproduce published statistics (docs/WORKLOADS.md).

Real datasets cannot be downloaded here, so each workload is a generator of token lengths matching what the papers
publish. Where a CDF is published (Skrull Table 1, ChunkFlow's evaluation set) the generator samples the inverse
CDF, log-linear between the published points, which reproduces every published quantile in expectation and is O(n)
numpy. Where only a mean, a range or a size is published (HBP's mixtures, Llama-3's mix) the shape is an assumption
named in the workload's ``assumption`` field; the parameters are plain numbers in this file.

>>> lengths = generate("lmsys-chat-1m", 100_000, seed=0)
>>> round(float((lengths < 1024).mean()), 2)               # Skrull Table 1: 87.12% under 1K
0.87
>>> bool((generate("tiny-longtail", 1000, seed=1) == generate("tiny-longtail", 1000, seed=1)).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .model import UnknownNameError

__all__ = ["Workload", "WORKLOADS", "get_workload", "generate", "knots_sampler", "K"]

K = 1024  # tokens in a "K" of the papers' lengths (32K = 32,768): the one definition


@dataclass(frozen=True)
class Workload:
    """A named length generator; ``cdf`` lists published (length, share below) points the test checks."""

    name: str
    description: str
    sample: Callable[[np.random.Generator, int], np.ndarray]
    default_samples: int
    cdf: tuple[tuple[int, float], ...] = ()
    default_max_len: int | None = None
    assumption: str = ""


def knots_sampler(knots: tuple[tuple[float, float], ...]) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Inverse-CDF sampler, log-linear between (length, cumulative share) knots (first share 0, last 1).

    >>> s = knots_sampler(((16, 0.0), (256, 0.5), (4096, 1.0)))
    >>> x = s(np.random.default_rng(0), 200_000)
    >>> round(float((x < 256).mean()), 2), int(x.min()) >= 16, int(x.max()) <= 4096
    (0.5, True, True)
    """
    lens = np.log(np.array([k[0] for k in knots], dtype=np.float64))
    cdf = np.array([k[1] for k in knots], dtype=np.float64)
    if cdf[0] != 0.0 or cdf[-1] != 1.0 or np.any(np.diff(cdf) < 0) or np.any(np.diff(lens) <= 0):
        raise ValueError(f"knots {knots}: lengths must increase and shares rise from 0 to 1")

    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        u = rng.random(n)
        # floor keeps P(X < knot) equal to the knot's share for integer knots.
        return np.floor(np.exp(np.interp(u, cdf, lens))).astype(np.int64).clip(int(knots[0][0]), int(knots[-1][0]))

    return sample


def _lognormal(mean: float, sigma: float, cap: int, floor: int = 8) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Lognormal with the given mean, truncated to [floor, cap] by redrawing (no atom at the cap)."""
    mu = np.log(mean) - sigma * sigma / 2

    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        out = rng.lognormal(mu, sigma, n)
        bad = (out > cap) | (out < floor)
        while bad.any():
            out[bad] = rng.lognormal(mu, sigma, int(bad.sum()))
            bad = (out > cap) | (out < floor)
        return out.astype(np.int64)

    return sample


def _log_uniform(lo: int, hi: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.int64)

    return sample


def _mixture(short: Callable, long: Callable, long_share: float) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Each sample is long with probability ``long_share`` (independently, so any --samples keeps the mix)."""

    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        is_long = rng.random(n) < long_share
        out = short(rng, n)
        n_long = int(is_long.sum())
        if n_long:
            out[is_long] = long(rng, n_long)
        return out

    return sample


# Published points (Skrull Table 1); the first knot and the median are our assumptions.
_WIKI = ((32, 0.0), (300, 0.5), (K, 0.8788), (4 * K, 0.9934), (8 * K, 0.9992), (32 * K, 0.9999), (78_000, 1.0))
_LMSYS = ((16, 0.0), (200, 0.5), (K, 0.8712), (4 * K, 0.9935), (8 * K, 0.9987), (32 * K, 0.9998),
          (128 * K, 0.9999), (1_643_000, 1.0))
_CHATQA2 = ((64, 0.0), (K, 0.2192), (4 * K, 0.3148), (8 * K, 0.4043), (32 * K, 0.9986), (99_000, 1.0))
_CHUNKFLOW = ((16, 0.0), (200, 0.5), (K, 0.90), (4 * K, 0.98), (32 * K, 0.9992), (256 * K, 1.0))
_TINY = ((16, 0.0), (64, 0.5), (256, 0.90), (K, 0.98), (4 * K, 1.0))

_TULU3 = _lognormal(780, 0.863, 32 * K)        # mean 780 and p99 4K solve to sigma 0.863
_OPENHERMES = _lognormal(400, 0.9, 4 * K)
_LONGCITE = _log_uniform(8 * K, 128 * K)
_LONGWRITER = _log_uniform(4 * K, 32 * K)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("wikipedia-cn", "Chinese Wikipedia (Skrull Table 1): long tail, longest 78K", knots_sampler(_WIKI),
             254_547, _WIKI[2:], assumption="shortest 32 tokens, median 300 (not published)"),
    Workload("lmsys-chat-1m", "LMSYS-Chat-1M (Skrull Table 1): long tail, longest 1643K", knots_sampler(_LMSYS),
             1_000_000, _LMSYS[2:], default_max_len=128 * K,
             assumption="shortest 16, median 200 (not published); default --max-len 128K keeps 99.99% whole"),
    Workload("chatqa2-long-sft", "ChatQA2-Long-SFT (Skrull Table 1): bimodal, ~60% in 8K-32K",
             knots_sampler(_CHATQA2), 128_000, _CHATQA2[1:],
             assumption="shortest 64; log-uniform inside each published interval; 128,000 samples"),
    Workload("chunkflow-eval", "ChunkFlow's evaluation set: ~90% <1K, ~8% 1-4K, ~2% 4-32K, <0.1% >32K, to 256K",
             knots_sampler(_CHUNKFLOW), 100_000, _CHUNKFLOW[2:],
             assumption="0.08% above 32K; median 200; 100,000 samples"),
    Workload("llama3-longsft", "Llama-3 long-SFT mix: 99.89% short (mean <1K), 0.11% long (mean ~37K)",
             _mixture(_lognormal(700, 1.0, 8 * K), _log_uniform(8 * K, 100 * K), 0.0011), 1_000_000,
             assumption="short lognormal mean 700 sigma 1.0 capped 8K; long log-uniform 8K-100K (mean 36.4K)"),
    Workload("tulu3-longcite", "Tulu 3 SFT mixture + 2,000 LongCite samples (HBP)",
             _mixture(_TULU3, _LONGCITE, 2000 / 941_344), 941_344,
             assumption="Tulu3 lognormal mean 780, p99 4K, cap 32K; LongCite log-uniform 8K-128K"),
    Workload("openhermes-longcite", "OpenHermes 2.5 + 2,000 LongCite samples (HBP)",
             _mixture(_OPENHERMES, _LONGCITE, 2000 / 1_003_551), 1_003_551,
             assumption="OpenHermes lognormal mean 400 sigma 0.9 cap 4K; LongCite log-uniform 8K-128K"),
    Workload("tulu3-longwriter", "Tulu 3 SFT mixture + LongWriter-6k (HBP)",
             _mixture(_TULU3, _LONGWRITER, 6000 / 945_344), 945_344,
             assumption="Tulu3 as above; LongWriter log-uniform 4K-32K"),
    Workload("tiny-longtail", "lmsys shape scaled down for CPU training: 16-256 mostly, ~2% 1K-4K",
             knots_sampler(_TINY), 2_000, _TINY[1:], assumption="90% < 256, 98% < 1K, cap 4K"),
)}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise UnknownNameError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)} "
                               "or pass --lengths FILE") from None


def generate(name: str, samples: int | None = None, *, seed: int = 0) -> np.ndarray:
    """``samples`` lengths (default: the dataset's size) of workload ``name``, int64, reproducible by seed."""
    w = get_workload(name)
    n = w.default_samples if samples is None else samples
    if n < 1:
        raise ValueError(f"--samples {n}: must be >= 1")
    return w.sample(np.random.default_rng(seed), n)
