"""Liger's fused linear cross-entropy in place of longpack's (runtime/kernel/liger_loss.py): where it runs, and that
it gives the same objective and gradients — Liger's Triton kernels run here in Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py), the same kernel code a GPU compiles."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("liger_kernel")

from longpack.runtime.kernel import head_loss  # noqa: E402
from longpack.runtime.kernel.head_loss import (  # noqa: E402
    head_cross_entropy,
    head_loss_name,
    resolve_head_loss,
    set_head_loss,
)
from longpack.runtime.kernel.liger_loss import liger_cross_entropy, liger_runs, liger_version  # noqa: E402

CUDA = torch.device("cuda")


def _case(tokens: int = 53, hidden: int = 16, vocab: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    w = torch.full((tokens,), 1 / 41, dtype=torch.float64)
    w[::4] = 0.0  # positions without a target (prompt tokens, a document's last token)
    return h, weight, labels, w


def _grads(loss: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss * 0.37, [h, weight])  # an incoming gradient other than 1


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_parity_liger_head_loss_equals_whole_logits_and_longpack():
    """float32: Liger's uniform-weight loss and gradients equal F.cross_entropy over whole logits and longpack's
    chunked loss within 1e-6 relative."""
    h, weight, labels, w = _case()
    whole = (torch.nn.functional.cross_entropy(h @ weight.T, labels, reduction="none") * w.float()).sum()
    ours = head_cross_entropy(h, weight, labels, w, chunk=16)
    liger = liger_cross_entropy(h, weight, labels, w, 1 / 41, chunk_bytes=16 * 97 * 4)
    assert liger.dtype == torch.float32
    for out in (ours, liger):
        assert abs(float((out - whole).detach())) <= 1e-6 * abs(float(whole.detach()))
    expected = _grads(whole, h, weight)
    for got in (_grads(ours, h, weight), _grads(liger, h, weight)):
        for g, e in zip(got, expected, strict=True):
            assert _close(g, e) <= 1e-6


def test_liger_runs_only_where_it_gives_the_objective(monkeypatch):
    """--head-loss auto: Liger on CUDA in bf16/fp16/fp32 with token_mean; longpack's loss on the host, in float64,
    for sequence_mean, and for a micro-batch whose weights differ (no one value to hand Liger). --head-loss liger
    where it cannot run: refused, saying why; longpack: longpack's even where Liger could run."""
    assert liger_runs(CUDA, torch.bfloat16) and liger_runs(CUDA, torch.float32)
    assert not liger_runs(CUDA, torch.float64) and not liger_runs(torch.device("cpu"), torch.float32)
    for kind in ("auto", "liger"):
        assert resolve_head_loss(kind, CUDA, torch.bfloat16, "token_mean") == "liger"
    assert resolve_head_loss("longpack", CUDA, torch.bfloat16, "token_mean") == "longpack"
    assert head_loss_name("liger") == f"Liger fused linear cross-entropy (liger_kernel {liger_version()})"
    assert head_loss_name("longpack") == "longpack fused linear cross-entropy"
    for device, dtype, mode, why in ((CUDA, torch.bfloat16, "sequence_mean", "--loss sequence_mean weighs"),
                                     (CUDA, torch.float64, "token_mean", "not float64"),
                                     (torch.device("cpu"), torch.float32, "token_mean", "this run on cpu")):
        assert resolve_head_loss("auto", device, dtype, mode) == "longpack"
        with pytest.raises(ValueError, match=f"--head-loss liger: .*{why}.*; use --head-loss auto or longpack"):
            resolve_head_loss("liger", device, dtype, mode)
    with pytest.raises(ValueError, match="--head-loss 'fast': choose one of auto, longpack, liger"):
        resolve_head_loss("fast", CUDA, torch.bfloat16, "token_mean")
    calls: list[float] = []

    def spy(h, weight, labels, w, uniform, chunk_bytes):  # noqa: ANN001, ANN202 - the real kernel, counted
        calls.append(uniform)
        return liger_cross_entropy(h, weight, labels, w, uniform, chunk_bytes)

    monkeypatch.setattr(head_loss, "liger_runs", lambda device, dtype: True)  # the host as if it were a GPU
    monkeypatch.setattr(head_loss, "liger_cross_entropy", spy)
    h, weight, labels, w = _case(seed=1)
    head_cross_entropy(h, weight, labels, w, uniform=None)
    with torch.no_grad():  # evaluation: longpack's logits-only loop
        head_cross_entropy(h, weight, labels, w, uniform=1 / 41)
    assert calls == []
    out = head_cross_entropy(h, weight, labels, w, uniform=1 / 41)
    assert calls == [1 / 41]
    ours = head_cross_entropy(h, weight, labels, w, chunk=16)
    assert abs(float((out - ours).detach())) <= 1e-6 * abs(float(out.detach()))


def test_parity_liger_micro_batch_through_the_runner(monkeypatch):
    """A packed micro-batch of the engine under token_mean: the runner finds its one weight on the host and the
    head hands it to Liger, once per micro-batch; loss and every parameter's gradient equal the longpack loss's
    within 1e-5 relative. A head set to longpack's loss (--head-loss longpack) never calls Liger."""
    from dist_workers import SPEC, make_model, make_plan

    from longpack.runtime.kernel.data import SyntheticCorpus
    from longpack.runtime.kernel.step import run_micro_batches

    plan = make_plan("isf", 1)
    mbs = plan.steps[0].replicas[0].micro_batches
    runs = {}
    for liger in (False, True, "set longpack"):
        calls: list[float] = []

        def spy(h, weight, labels, w, uniform, chunk_bytes, calls=calls):  # noqa: ANN001, ANN202
            calls.append(uniform)
            return liger_cross_entropy(h, weight, labels, w, uniform, chunk_bytes)

        monkeypatch.setattr(head_loss, "liger_runs", lambda device, dtype, on=bool(liger): on)
        monkeypatch.setattr(head_loss, "liger_cross_entropy", spy)
        model = make_model()
        if liger == "set longpack":
            set_head_loss(model, "longpack")
        loss, _, _ = run_micro_batches(model, plan, 0, mbs, SyntheticCorpus(SPEC.vocab, seed=0))
        runs[liger] = (float(loss), [p.grad.clone() for p in model.parameters()], calls)
    assert runs[False][2] == runs["set longpack"][2] == []
    assert len(runs[True][2]) == len(mbs) and len(set(runs[True][2])) == 1
    assert runs["set longpack"][0] == runs[False][0]
    assert abs(runs[True][0] - runs[False][0]) <= 1e-5 * abs(runs[False][0])
    for g, e in zip(runs[True][1], runs[False][1], strict=True):
        assert _close(g, e) <= 1e-5


def test_liger_chunks_follow_longpacks_memory_budget():
    """Liger's chunks are the largest power of two of tokens whose logits fit longpack's chunk budget (its default
    would be 8 tokens here: logits bounded to tokens × hidden): 128-token chunks for a 128-token budget, 3 logits
    products for 300 tokens, and the loss unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longpack.runtime.kernel.liger_loss import mem_const

    class Logits(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith("mm") and out.shape[-1] == 1000:
                self.rows.append(out.shape[0])
            return out

    h, weight, labels, w = _case(tokens=300, hidden=16, vocab=1000, seed=2)
    assert mem_const(300, 16, 1000, 128) == 20 and mem_const(300, 16, 1000, 100_000) == 63
    whole = (torch.nn.functional.cross_entropy(h @ weight.T, labels, reduction="none") * w.float()).sum()
    with Logits() as seen:
        out = liger_cross_entropy(h, weight, labels, w, 1 / 41, chunk_bytes=128 * 1000 * 4)
    assert seen.rows == [128, 128, 44]
    assert abs(float((out - whole).detach())) <= 1e-6 * abs(float(whole.detach()))
