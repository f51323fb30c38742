"""Regressions of the fuzz run: a sample exactly at an odd limit under CP packs, and chunkflow's default chunk size
passes its own check."""

import numpy as np
import pytest

from longpack.cost import CostModel, TrainConfig
from longpack.hardware import get_hardware
from longpack.model import get_model
from longpack.planners import PlanContext, get_planner, global_batches


@pytest.mark.parametrize("planner", ["isf", "ffd", "bfd", "spfhp", "fixed_cp"])
@pytest.mark.parametrize("model,hardware,cap,limit", [("tiny-llama", "cpu", 16, 7),
                                                      ("qwen2.5-0.5b", "h100", None, 8191)])
def test_sample_exactly_at_an_odd_limit_packs_under_cp2(planner, model, hardware, cap, limit):
    cost = CostModel(get_model(model), get_hardware(hardware), TrainConfig(cp=2, token_cap=cap))
    lengths = np.array([limit, 3])
    plan = get_planner(planner).plan(lengths, global_batches(2, 2), PlanContext(cost=cost), max_len=limit)
    plan.validate()
    assert not plan.dropped and not plan.truncated
    assert {p.sample: (p.start, p.stop) for *_, p in plan.iter_pieces()}[0] == (0, limit)


def test_chunkflow_default_chunk_size_fits_its_own_check():
    cost = CostModel(get_model("tiny-llama"), get_hardware("cpu"), TrainConfig(cp=2, token_cap=32))
    lengths = np.array([100, 70, 9, 5, 40, 3])
    plan = get_planner("chunkflow").plan(lengths, global_batches(6, 6), PlanContext(cost=cost, options={"k": 3}))
    plan.validate()
    chunks = {p.stop - p.start for *_, p in plan.iter_pieces() if plan.is_chunk(p) and p.stop < plan.lengths[p.sample]}
    assert chunks == {20}  # (32 // 3) x 2: three chunks of 10 tokens a rank within the cap of 32


def test_hbp_splits_at_max_len_and_counts_what_it_split():
    """A 50-token sample over --max-len 40 is split too (not kept whole), and no piece exceeds 40 tokens."""
    cost = CostModel(get_model("tiny"), get_hardware("cpu"), TrainConfig(dp=2))
    lengths = np.array([50, 10, 10, 200])
    ctx = PlanContext(cost=cost, options={"groups": "64:1:0", "curriculum": 0})
    plan = get_planner("hbp").plan(lengths, global_batches(4, 4), ctx, max_len=40, overlong="split")
    plan.validate()
    pieces = [p for *_, p in plan.iter_pieces()]
    assert max(p.stop - p.start for p in pieces) <= 40
    assert {p.sample for p in pieces if plan.is_chunk(p)} == {0, 3} and plan.meta["overlong"]["split"] == 2


def test_hbp_keeps_a_configured_token_cap():
    """--token-cap 256 holds for HBP's groups (it used the memory model's cap of 737,271 tokens instead), and
    auto-selected packing lengths that no SP degree fits under it are refused in one line."""
    cost = CostModel(get_model("tiny-llama"), get_hardware("cpu"), TrainConfig(dp=2, token_cap=256))
    lengths = np.array([30, 200, 500, 90, 12, 300, 7, 64])
    ctx = PlanContext(cost=cost, options={"groups": "256:1:0,512:2:0", "curriculum": 0})
    plan = get_planner("hbp").plan(lengths, global_batches(8, 8), ctx)
    plan.validate()
    assert {s.token_cap for s in plan.steps} == {256}
    with pytest.raises(ValueError, match="fits --token-cap 256 tokens per rank"):
        get_planner("hbp").plan(lengths, global_batches(8, 8), PlanContext(cost=cost))


def test_samples_beyond_the_models_positions_are_refused_unless_rope_scaling_covers_them():
    transformers = pytest.importorskip("transformers")
    from longpack.runtime.run.hf_model import check_supported

    def model(**kw):
        cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                       **kw)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    check_supported(model(), 64)
    with pytest.raises(ValueError, match="a sample of 65 tokens is longer than the 64 positions .* cap --max-len at"):
        check_supported(model(), 65)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    check_supported(model(rope_scaling=yarn), 128)  # 32 x 4
    with pytest.raises(ValueError, match="longer than the 128 positions"):
        check_supported(model(rope_scaling=yarn), 129)
