"""The one engine: transformers' own Llama, Qwen2, Qwen3 and Mistral classes running the longpack attention
(registered through AttentionInterface) on a packed stream give each document's logits exactly as the model alone
with sdpa; what the engine cannot run exactly is refused in one line."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from longpack.runtime.kernel import varlen  # noqa: E402
from longpack.runtime.kernel.engine import forward_logits  # noqa: E402
from longpack.runtime.run.hf_model import check_supported, load, spec_of  # noqa: E402

SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
KINDS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
         "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None})}


def _saved(tmp_path, kind, **extra):
    cfg_name, model_name, defaults = KINDS[kind]
    cfg = getattr(transformers, cfg_name)(**SHAPE, **(defaults | extra))
    torch.manual_seed(0)
    getattr(transformers, model_name)(cfg).double().save_pretrained(tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_parity_engine_packed_stream(tmp_path, kind):
    model = load(_saved(tmp_path, kind), torch.float64)
    assert model.config._attn_implementation == "longpack" and spec_of(model.config).layers == 2
    docs = [torch.randint(0, 97, (n,)) for n in (30, 7, 51)]
    cu = [0, 30, 37, 88]
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    with torch.no_grad():
        seqs = varlen.Seqs.of_offsets(cu)
        packed = forward_logits(model, torch.cat(docs), pos, lambda _l, q, k, v: varlen.attention(q, k, v, seqs))
        model.set_attn_implementation("sdpa")
        for d, a in zip(docs, cu, strict=False):
            alone = model(input_ids=d[None], use_cache=False).logits[0]
            # observed ~1e-16: the same float64 arithmetic per document; a document seeing another is ~1e-2 off
            assert float((packed[a:a + len(d)] - alone).abs().max()) <= 1e-9


def test_engine_refuses_a_window_shorter_than_the_longest_sample(tmp_path):
    model = load(_saved(tmp_path, "mistral", sliding_window=16), torch.float64)
    check_supported(model, 16)
    with pytest.raises(ValueError, match="sliding_window=16 is shorter than the longest sample"):
        check_supported(model, 40)


def test_engine_attention_outside_the_engine_says_what_to_do(tmp_path):
    model = load(_saved(tmp_path, "llama"), torch.float64)
    with pytest.raises(ValueError, match="set_attn_implementation"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
