import pytest

from longpack.model import MODEL_PRESETS, ModelSpec, UnknownNameError, get_model

# Published parameter counts (model cards), in billions; our shapes must reproduce them within 1.5%.
PUBLISHED_B = {"qwen2.5-0.5b": 0.494, "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.7, "qwen2.5-32b": 32.8,
               "qwen2.5-72b": 72.7, "llama3.1-8b": 8.03, "llama3.1-70b": 70.6, "deepseek-v2": 236.0}


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED_B.items()))
def test_preset_parameter_counts_match_published(name, billions):
    assert get_model(name).total_params / 1e9 == pytest.approx(billions, rel=0.015)


def test_deepseek_v2_active_parameters_about_21b():
    m = get_model("deepseek-v2")
    active = m.layers * m.layer_params(active=True) + m.embedding_params
    assert active / 1e9 == pytest.approx(21.0, rel=0.05)


def test_every_preset_builds_and_has_positive_costs():
    for name in MODEL_PRESETS:
        m = get_model(name)
        assert m.linear_flops_per_token > 0 and m.attn_flops_per_pair > 0 and m.kv_width > 0


def test_gqa_kv_width_and_standard_attention_pair_cost():
    m = get_model("qwen2.5-7b")  # 4 KV heads x 128
    assert m.kv_width == 2 * 4 * 128
    assert m.attn_flops_per_pair == 4 * m.hidden  # the 4·h·S² of Skrull's formula


def test_mla_exchanges_mha_sized_kv():
    m = get_model("deepseek-v2")
    assert m.kv_width == 128 * (128 + 64 + 128)


def test_unknown_model_lists_known_names():
    with pytest.raises(UnknownNameError, match="qwen2.5-0.5b"):
        get_model("gpt-5")


def test_bad_shapes_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="heads=6 is not a multiple of kv_heads=4"):
        ModelSpec(name="x", layers=1, hidden=8, heads=6, kv_heads=4, head_dim=2, ffn=8, vocab=8)
    with pytest.raises(ValueError, match="layers=0"):
        ModelSpec(name="x", layers=0, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=8, vocab=8)
