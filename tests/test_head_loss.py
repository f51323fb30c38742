"""The chunked head + cross-entropy (runtime/kernel/head_loss.py): equal to the whole-logits loss in float64, and no
[tokens, vocab] tensor is ever made for more tokens than a chunk — in the function and in a micro-batch of the
engine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from longpack.runtime.kernel import head_loss  # noqa: E402
from longpack.runtime.kernel.head_loss import head_cross_entropy  # noqa: E402


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an operator makes."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def _widest(shapes: list[tuple[int, ...]], vocab: int) -> int:
    """The most rows of any [rows, vocab] tensor made (the head weight's transpose, [hidden, vocab], included: the
    tests keep hidden ≤ the chunk)."""
    return max((s[0] for s in shapes if len(s) == 2 and s[1] == vocab), default=0)


def test_parity_head_cross_entropy_equals_whole_logits_and_never_holds_them():
    torch.manual_seed(0)
    h = torch.randn(37, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (37,))
    w = torch.rand(37, dtype=torch.float64)
    w[3] = 0.0  # a position without a target
    ref = (torch.nn.functional.cross_entropy(h @ weight.T, labels, reduction="none") * w).sum()
    expected = torch.autograd.grad(ref * 1.7, [h, weight])
    with _Shapes() as seen:
        out = head_cross_entropy(h, weight, labels, w, chunk=5)
        got = torch.autograd.grad(out * 1.7, [h, weight])
    # float64: the same sums in chunks, ~1e-15 apart; 1e-12 leaves no room for a wrong term
    assert abs(float(out.detach() - ref.detach())) < 1e-12
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, rtol=0, atol=1e-12)
    assert _widest(seen.shapes, 11) == 5


class _Flops(TorchDispatchMode):
    """FLOPs of every matrix product at dispatch: mm, addmm, addmm_, bmm and their wide-output (``.dtype``)
    forms, in place or not (torch's FlopCounterMode does not count the in-place addmm_)."""

    MM = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func._overloadpacket.__name__
        if name in self.MM:
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            self.flops += 2 * a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _case(dtype, tokens=64, hidden=8, vocab=50):
    torch.manual_seed(1)
    h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    w = torch.rand(tokens, dtype=dtype)
    w[::7] = 0.0
    return h, weight, labels, w


def test_fused_head_costs_three_matrix_products_per_token():
    """6 · T · hidden · vocab FLOPs for forward and backward (the logits, dh and dW), counted over every matrix
    product at dispatch; 2 · T · hidden · vocab under no_grad (evaluation)."""
    h, weight, labels, w = _case(torch.float32)
    t, hidden, vocab = h.shape[0], h.shape[1], weight.shape[0]
    with _Flops() as count:
        out = head_cross_entropy(h, weight, labels, w, chunk=16)
        out.backward()
    assert count.flops == 6 * t * hidden * vocab
    with torch.no_grad(), _Flops() as count:
        head_cross_entropy(h, weight, labels, w, chunk=16)
    assert count.flops == 2 * t * hidden * vocab


def test_parity_fused_head_float32_equals_cross_entropy_within_1e6():
    """float32: loss and both gradients within 1e-6 relative of F.cross_entropy over whole logits, with an
    incoming gradient other than 1 (backward scales what forward made)."""
    h, weight, labels, w = _case(torch.float32, tokens=300, hidden=32, vocab=700)
    ref = (torch.nn.functional.cross_entropy(h @ weight.T, labels, reduction="none") * w).sum()
    expected = torch.autograd.grad(ref * 0.37, [h, weight])
    out = head_cross_entropy(h, weight, labels, w, chunk=64)
    got = torch.autograd.grad(out * 0.37, [h, weight])
    assert abs(float(out.detach() - ref.detach())) <= 1e-6 * abs(float(ref.detach()))
    for g, e in zip(got, expected, strict=True):
        assert float((g - e).norm() / e.norm()) <= 1e-6


def test_engine_micro_batch_never_allocates_whole_logits(monkeypatch):
    """A packed micro-batch of 402 tokens through the engine, forward and backward, with chunks of 32 tokens."""
    from dist_workers import SPEC, make_model, make_plan

    from longpack.runtime.kernel.data import SyntheticCorpus
    from longpack.runtime.kernel.step import run_micro_batches

    monkeypatch.setattr(head_loss, "CHUNK_BYTES", 32 * 4 * SPEC.vocab)
    plan = make_plan("isf", 1)
    mbs = plan.steps[0].replicas[0].micro_batches
    model = make_model()
    with _Shapes() as seen:
        _, tokens, _ = run_micro_batches(model, plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0))
    assert max(len(mb.pieces) and sum(p.stop - p.start for p in mb.pieces) for mb in mbs) > 32
    assert 0 < _widest(seen.shapes, SPEC.vocab) <= 32
