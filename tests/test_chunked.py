"""ChunkFlow runtime parity: chains of chunks (forward ascending, backward descending, K kept, the rest
recomputed with injected dK/dV) give the whole-sequence loss and gradients in float64."""

import pytest

torch = pytest.importorskip("torch")

import pool  # noqa: E402  (tests/pool.py: warm worker processes)
from dist_workers import SPEC, make_model, plain_logits  # noqa: E402

from longpack.plan import MicroBatch, Piece, Plan, Replica, Step  # noqa: E402
from longpack.runtime.kernel import varlen  # noqa: E402
from longpack.runtime.kernel.chunked import with_prefix  # noqa: E402
from longpack.runtime.kernel.data import SyntheticCorpus  # noqa: E402
from longpack.runtime.kernel.step import run_micro_batches  # noqa: E402

RTOL = 1e-6  # float64; observed ~1e-15 (the same sums in another order)
CORPUS = SyntheticCorpus(SPEC.vocab, seed=0)


def whole_reference(lengths):
    model = make_model("sdpa")
    total = sum(n - 1 for n in lengths)
    loss = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(lengths):
        toks = torch.from_numpy(CORPUS.tokens(i, n)).long()
        logits = plain_logits(model, toks)
        loss = loss + torch.nn.functional.cross_entropy(logits[:-1], toks[1:], reduction="sum") / total
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


def chain_plan(length, chunk, k, extra=(7, 9)):
    """Sample 0 as a chain of chunks (the first N-K recomputed), whole samples 1.. before it and in its last chunk."""
    pieces = [(a, min(length, a + chunk)) for a in range(0, length, chunk)]
    n = len(pieces)
    mbs = [MicroBatch((Piece(1, 0, extra[0]),))]
    for j, (a, b) in enumerate(pieces):
        others = (Piece(2, 0, extra[1]),) if j == n - 1 else ()
        mbs.append(MicroBatch((Piece(0, a, b),) + others, recompute=j < n - k))
    lengths = {0: length, 1: extra[0], 2: extra[1]}
    plan = Plan("chain", 1, lengths, (Step(cp=1, token_cap=10**6, replicas=(Replica(tuple(mbs)),)),))
    plan.validate()
    return plan, [length, *extra]


def _check(plan, lengths):
    model = make_model()
    loss, *_ = run_micro_batches(model, plan, 0, plan.steps[0].replicas[0].micro_batches, CORPUS)
    ref_loss, ref = whole_reference(lengths)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    for name, p in model.named_parameters():
        err = float((p.grad - ref[name]).norm() / ref[name].norm())
        assert err <= RTOL, (name, err)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("k", ["1", "2", "N"])
def test_chunk_parity_chains(chunks, k):
    """Chains of 1..6 chunks with an uneven last chunk (length = 16·chunks − 5), GQA (4 heads / 2 KV heads)."""
    length = 16 * chunks - 5
    kk = chunks if k == "N" else int(k)
    plan, lengths = chain_plan(length, 16, kk)
    _check(plan, lengths)


def test_chunk_parity_even_chunks_and_two_chains_in_one_step():
    pieces_a = [(0, 20), (20, 40)]
    pieces_b = [(0, 13), (13, 26), (26, 30)]
    mbs = [MicroBatch((Piece(0, a, b),), recompute=i == 0) for i, (a, b) in enumerate(pieces_a)]
    mbs += [MicroBatch((Piece(1, a, b),), recompute=i < 2) for i, (a, b) in enumerate(pieces_b)]
    mbs.append(MicroBatch((Piece(2, 0, 11), Piece(3, 0, 6))))
    plan = Plan("two", 1, {0: 40, 1: 30, 2: 11, 3: 6}, (Step(cp=1, token_cap=100, replicas=(Replica(tuple(mbs)),)),))
    plan.validate()
    _check(plan, [40, 30, 11, 6])


def test_chunk_parity_chunkflow_planner_sequence_mean_free():
    """A ChunkFlow plan (uniform chunks, short sequences co-packed with a chain's tail) on one rank."""
    import numpy as np
    from helpers import make_cost

    from longpack.planners import PlanContext, get_planner

    lengths = [70, 5, 9, 33, 2, 12]
    ctx = PlanContext(cost=make_cost("tiny", "cpu", token_cap=1000), options={"chunk_size": 16, "k": 2})
    plan = get_planner("chunkflow").plan(np.array(lengths), [np.arange(len(lengths))], ctx)
    plan.validate()
    assert any(mb.recompute for mb in plan.steps[0].replicas[0].micro_batches)
    _check(plan, lengths)


def test_chunk_parity_isf_samples_beside_chain_tails():
    """An isf plan whose short samples were moved beside chains' last pieces (planners/beside.py), on one rank."""
    import numpy as np
    from helpers import make_cost

    from longpack.planners import PlanContext, get_planner

    lengths = [70, 5, 9, 33, 2, 12, 20, 3]
    ctx = PlanContext(cost=make_cost("tiny", "cpu", token_cap=32))
    plan = get_planner("isf").plan(np.array(lengths), [np.arange(len(lengths))], ctx)
    plan.validate()
    mbs = plan.steps[0].replicas[0].micro_batches
    beside = [mb for mb in mbs if any(plan.is_chunk(p) for p in mb.pieces) and len(mb.pieces) > 1]
    assert len(beside) == 2  # both chains' tails took short samples
    _check(plan, lengths)


def _masked_reference(q, keys, vals):
    """Bottom-right causal attention by an explicit mask ([1, H, s, D] queries, [1, H, n, D] keys)."""
    s, n = q.shape[2], keys.shape[2]
    mask = torch.arange(n)[None, :] <= (n - s + torch.arange(s))[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)


def test_chunk_prefix_attention_matches_masked_reference():
    """A chunk over stored earlier blocks plus its own keys: output, own gradients and the accumulated stored-key
    gradients equal the masked reference (float64, GQA 4 heads over 2)."""
    torch.manual_seed(0)
    q = torch.randn(6, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kp, vp = (torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bh = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    ref = _masked_reference(bh(q), bh(torch.cat([kp, k])).repeat_interleave(2, 1),
                            bh(torch.cat([vp, v])).repeat_interleave(2, 1))[0].transpose(0, 1)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((ref * w).sum(), [q, k, v, kp, vp])
    blocks = [(kp[:4].detach(), vp[:4].detach(), torch.zeros(4, 2, 8, dtype=torch.float64),
               torch.zeros(4, 2, 8, dtype=torch.float64)),
              (kp[4:].detach(), vp[4:].detach(), torch.zeros(5, 2, 8, dtype=torch.float64),
               torch.zeros(5, 2, 8, dtype=torch.float64))]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = with_prefix(q2, k2, v2, blocks)
    (out * w).sum().backward()
    # 1e-13: the same sums in another order (log-sum-exp merge vs one softmax) differ by float64 rounding only
    assert torch.allclose(out, ref, atol=1e-13)
    acc_k, acc_v = torch.cat([b[2] for b in blocks]), torch.cat([b[3] for b in blocks])
    for got, exp in zip((q2.grad, k2.grad, v2.grad, acc_k, acc_v), grads, strict=True):
        assert torch.allclose(got, exp, atol=1e-13)


def test_varlen_bottom_right_sequences_match_masked_reference():
    """Several sequences in one backend call, each with more keys than queries (a CP rank's late block): output
    and gradients equal the masked reference per sequence."""
    torch.manual_seed(1)
    seqs = varlen.Seqs([3, 5, 4], [7, 5, 10])
    q = torch.randn(12, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(22, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = varlen.attention(q, k, v, seqs)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), [q, k, v])
    bh = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    refs, qa, ka = [], 0, 0
    for s, n in zip(seqs.q_lens, seqs.k_lens, strict=True):
        refs.append(_masked_reference(bh(q[qa:qa + s]), bh(k[ka:ka + n]).repeat_interleave(2, 1),
                                      bh(v[ka:ka + n]).repeat_interleave(2, 1))[0].transpose(0, 1))
        qa, ka = qa + s, ka + n
    ref = torch.cat(refs)
    exp = torch.autograd.grad((ref * w).sum(), [q, k, v])
    assert torch.allclose(out, ref, atol=1e-13)
    for g, e in zip(got, exp, strict=True):
        assert torch.allclose(g, e, atol=1e-13)


def _train_two_steps(*flags: str) -> None:
    """`longpack train` on the tiny long-tail workload, 2 processes, 2 steps: it runs and logs a positive loss."""
    import json

    proc = pool.cli(["train", "--workload", "tiny-longtail", "--model", "tiny", *flags, "--nproc", "2", "--steps", "2",
                     "--global-batch", "24", "--json"])
    assert proc.returncode == 0, proc.stderr
    steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]
    assert len(steps) == 2 and all(s["loss"] > 0 for s in steps)


def test_chunk_train_cli_chunkflow_end_to_end():
    _train_two_steps("--planner", "chunkflow", "--opt", "chunk_size=256", "--opt", "k=1")


def test_chunk_parity_dp2_chunkflow(tmp_path):
    """ChunkFlow plan on two gloo processes (chains on both replicas), global token-mean: equal to unpacked."""
    from dist_workers import parity_worker, reference_grads

    from longpack.runtime.dist import free_port

    out = str(tmp_path / "grads.pt")
    pool.spawn(parity_worker, args=(2, free_port(), out, "chunkflow", "token_mean",
                                                     {"chunk_size": 32, "k": 1}), nprocs=2)
    got = torch.load(out, weights_only=False)
    ref_loss, ref = reference_grads("token_mean")
    assert got["loss"] == pytest.approx(ref_loss, rel=RTOL)
    for name, g in ref.items():
        assert float((got["grads"][name] - g).norm() / g.norm()) <= RTOL, name


def test_chunk_parity_unified_chains_single_process():
    """unified at cap 32 on one rank: samples over 32 tokens become chains (first N - K chunks recomputed)."""
    from dist_workers import make_plan, packed_grads, reference_grads

    plan = make_plan("unified", 1, cap=32)
    assert any(mb.recompute for r in plan.steps[0].replicas for mb in r.micro_batches)
    ref_loss, ref = reference_grads("token_mean")
    loss, grads = packed_grads("unified", 1, 0, "token_mean", cap=32)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    for name, g in ref.items():
        assert float((grads[name] - g).norm() / g.norm()) <= RTOL, name


def test_chunk_train_cli_unified_end_to_end():
    """`longpack train --planner unified` with chains (the runtime keeps them at cp 1)."""
    _train_two_steps("--planner", "unified", "--token-cap", "256", "--cp", "2")
