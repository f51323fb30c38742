"""Sharded start-up (runtime/run/shard_load.py): a checkpoint started on a meta model, sharded by FSDP2 over 3 ranks
(rows that do not divide evenly), each rank reading only its rows from the safetensors, holds exactly the weights
and RoPE buffers that ``from_pretrained`` gives — untied and tied embeddings."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pool  # noqa: E402
from dist_workers import shard_load_worker  # noqa: E402

from longpack.runtime.dist import free_port  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_sharded_start_up_reads_the_checkpoint_exactly(tmp_path, tied):
    cls = transformers.LlamaConfig if tied else transformers.Qwen2Config
    cfg = cls(vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    ref.save_pretrained(tmp_path / "ckpt")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    out = tmp_path / "got.pt"
    pool.spawn(shard_load_worker, args=(3, free_port(), str(tmp_path / "ckpt"), str(out)), nprocs=3)
    got = torch.load(out, weights_only=False)
    want = dict(ref.named_parameters())
    assert set(got["params"]) == set(want)
    for name, p in want.items():
        assert torch.equal(got["params"][name], p.detach()), name
    for name, b in ref.named_buffers():
        assert torch.equal(got["buffers"][name], b), name
