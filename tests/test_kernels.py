"""``--kernels compile`` (runtime/kernel/kernels.py): decoder layers' norms and MLPs compiled with torch.compile
(inductor, on the host) give the eager model's loss and gradients over micro-batches of many token counts, and
compile at most twice per layer class — dynamic token counts, so a new micro-batch length does not recompile."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from longpack.model import ModelSpec  # noqa: E402
from longpack.plan import MicroBatch, Piece, Plan, Replica, Step  # noqa: E402
from longpack.runtime.kernel.data import SyntheticCorpus  # noqa: E402
from longpack.runtime.kernel.kernels import apply_kernels, resolve  # noqa: E402
from longpack.runtime.kernel.step import run_micro_batches  # noqa: E402
from longpack.runtime.run.hf_model import build  # noqa: E402

SPEC = ModelSpec(name="compiled", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=61,
                 qkv_bias=True)


def _plan() -> Plan:
    """One step of 20 micro-batches, each of 1-3 documents, no two with the same token count; two of them
    checkpoint their layers (recomputed in backward through the compiled code)."""
    mbs, lengths, sample = [], {}, 0
    for i in range(20):
        docs = [12 + 7 * i - 4 * (i % 3)] + [4] * (i % 3)  # 12 + 7i tokens
        pieces = []
        for n in docs:
            lengths[sample] = n
            pieces.append(Piece(sample, 0, n, 0))
            sample += 1
        mbs.append(MicroBatch(tuple(pieces), ckpt_layers=SPEC.layers if i in (4, 11) else 0))
    assert len({sum(p.stop - p.start for p in mb.pieces) for mb in mbs}) == 20
    return Plan("kernels", 1, lengths, (Step(cp=1, token_cap=200, replicas=(Replica(tuple(mbs)),)),))


def _grads(model: torch.nn.Module, plan: Plan) -> tuple[float, list[torch.Tensor]]:
    loss, *_ = run_micro_batches(model, plan, 0, plan.steps[0].replicas[0].micro_batches,
                                 SyntheticCorpus(SPEC.vocab, seed=0))
    return float(loss), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parity_compiled_layers_equal_eager_and_compile_at_most_twice(dtype):
    """transformers' RMSNorm computes in fp32 in every model dtype, and a compiled fp32 reduction or ``rsqrt`` may
    round its last bit otherwise than eager: the gradients agree to 1e-6 of their largest entry (measured: 2e-7
    in float64, 3e-7 in float32), the loss to 1e-6 relative (measured: 7e-12, 7e-9)."""
    tol = 1e-6
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plan = _plan()
    eager, compiled = build(SPEC, 0, dtype).train(), build(SPEC, 0, dtype).train()
    apply_kernels(compiled, resolve("compile", torch.device("cpu")))
    want_loss, want = _grads(eager, plan)
    got_loss, got = _grads(compiled, plan)
    worst = max(float((g - w).abs().max()) / max(float(w.abs().max()), 1e-30) for g, w in zip(got, want, strict=True))
    print(f"{dtype}: loss {abs(got_loss - want_loss) / abs(want_loss):.1e} relative, gradients {worst:.1e}")
    assert abs(got_loss - want_loss) <= tol * abs(want_loss)
    assert worst <= tol
    # the compiled parts of a layer (its RMSNorms, its MLP): every instance of a class shares that class's graph,
    # compiled for a dynamic token count — at most 2 compilations per class over 20 lengths, the checkpointed
    # recomputations and both layers
    classes = {type(part) for layer in compiled.model.layers for name, part in layer.named_children()
               if name != "self_attn"}
    graphs = counters["stats"]["unique_graphs"]
    print(f"{dtype}: {graphs} graphs compiled for {len(classes)} classes over 20 micro-batches, "
          f"frames {dict(counters['frames'])}")
    assert len(classes) == 2 and 0 < graphs <= 2 * len(classes), dict(counters["stats"])


def test_kernels_auto_compiles_on_cuda_only_and_refuses_unknown():
    assert resolve("auto", torch.device("cuda")) == "compile"
    assert resolve("auto", torch.device("cpu")) == "eager"
    with pytest.raises(ValueError, match="--kernels 'liger': choose one of auto, compile, eager"):
        resolve("liger", torch.device("cpu"))
