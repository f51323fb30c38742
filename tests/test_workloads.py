"""Each built-in generator reproduces its published statistics (docs/WORKLOADS.md)."""

import numpy as np
import pytest

from longpack.model import UnknownNameError
from longpack.workloads import WORKLOADS, generate, get_workload

N = 400_000


@pytest.mark.parametrize("name", [n for n, w in WORKLOADS.items() if w.cdf])
def test_published_quantiles(name):
    w = get_workload(name)
    x = generate(name, N, seed=1)
    for length, share in w.cdf:
        got = float((x < length).mean())
        # binomial standard error at N samples, 5 sigma, plus 0.05 points for the integer rounding of lengths
        tol = 5 * np.sqrt(max(share * (1 - share), 1e-6) / N) + 5e-4
        assert abs(got - share) <= tol, f"{name}: share below {length} is {got:.4%}, published {share:.4%}"
    assert x.max() <= w.cdf[-1][0]


def test_tulu3_mixture_mean_p99_and_longcite_share():
    x = generate("tulu3-longcite", N, seed=2)
    short = x[x < 8 * 1024]
    assert 740 <= short.mean() <= 820  # published ~3.1 KB/sample ≈ 750-800 tokens
    assert 3600 <= np.percentile(short, 99) <= 4400  # assumption: p99 ≈ 4K
    long_share = (x >= 8 * 1024).mean()
    # LongCite is 2,000 of 941,344 samples; Tulu3 itself puts ~0.01% above 8K
    assert 0.0015 <= long_share <= 0.0035
    assert x.max() <= 128 * 1024


def test_llama3_mix_share_and_means():
    x = generate("llama3-longsft", 2_000_000, seed=3)
    long = x[x >= 8 * 1024]
    assert abs(long.size / x.size - 0.0011) < 0.0002
    assert 33_000 <= long.mean() <= 40_000  # published ~37K
    assert x[x < 8 * 1024].mean() < 1024  # published: short mean under 1K


def test_openhermes_and_longwriter_ranges():
    oh = generate("openhermes-longcite", N, seed=4)
    assert 360 <= oh[oh <= 4096].mean() <= 440 and oh.max() <= 128 * 1024
    lw = generate("tulu3-longwriter", N, seed=5)
    assert lw.max() <= 32 * 1024


def test_seeded_and_sized():
    a = generate("wikipedia-cn", 1000, seed=7)
    assert a.dtype == np.int64 and a.size == 1000 and a.min() >= 1
    assert np.array_equal(a, generate("wikipedia-cn", 1000, seed=7))
    assert not np.array_equal(a, generate("wikipedia-cn", 1000, seed=8))
    assert generate("tiny-longtail").size == WORKLOADS["tiny-longtail"].default_samples


def test_unknown_workload_and_bad_size():
    with pytest.raises(UnknownNameError, match="lmsys-chat-1m"):
        get_workload("c4")
    with pytest.raises(ValueError, match="--samples 0"):
        generate("wikipedia-cn", 0)


def test_lmsys_default_max_len_is_128k():
    assert get_workload("lmsys-chat-1m").default_max_len == 128 * 1024
