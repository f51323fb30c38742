"""Long-context SFT with TRL's SFTTrainer on a longpack plan: completion-only loss, context parallelism 2 x data
parallelism 2, on 4 CPU processes, offline.

    torchrun --nproc-per-node 4 examples/trl_long_sft.py            # CP 2 x DP 2 (gloo)
    torchrun --nproc-per-node 2 examples/trl_long_sft.py --cp 2     # CP 2 alone
    python examples/trl_long_sft.py --cp 1                          # one process

A random-init Qwen2 (no download), a word-level tokenizer built in memory, and prompt-completion rows with the
tiny-longtail length profile (most short, a few long): TRL tokenizes them and masks the prompts; longpack plans
every step over the dp x cp ranks (the long rows sharded zigzag over a CP group, the short ones packed whole on
one rank) and trains with the exact global mean over the completion tokens. What the plan trained and left out is
printed first (`longpack: data: ...`) and kept in ``trainer.longpack_report``.
"""

from __future__ import annotations

import argparse

import datasets
import numpy as np
import torch
import transformers
import trl
from tokenizers import Tokenizer, models, pre_tokenizers

from longpack.hf import LongpackConfig, longpack_trainer_class
from longpack.runtime.dist import leave
from longpack.workloads import generate

WORDS = 1000


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[EOS]": 1} | {f"w{i}": i + 2 for i in range(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


def rows(n: int) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    lengths = generate("tiny-longtail", n, seed=0)
    text = [" ".join(f"w{i}" for i in rng.integers(0, WORDS, int(m))) for m in lengths]
    cut = [max(1, len(t.split()) // 4) for t in text]  # the first quarter of each row is the prompt
    return datasets.Dataset.from_dict({"prompt": [" ".join(t.split()[:c]) for t, c in zip(text, cut, strict=True)],
                                       "completion": [" " + " ".join(t.split()[c:])
                                                      for t, c in zip(text, cut, strict=True)]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--output-dir", default="/tmp/longpack-trl-example")
    args = ap.parse_args()

    tok = tokenizer()
    config = transformers.Qwen2Config(vocab_size=WORDS + 2, hidden_size=64, intermediate_size=172,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    sft = trl.SFTConfig(output_dir=args.output_dir, max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
                        report_to=[], use_cpu=True, save_strategy="no", max_length=None, completion_only_loss=True,
                        disable_tqdm=True)
    trainer = longpack_trainer_class(trl.SFTTrainer)(
        model=model, args=sft, train_dataset=rows(args.rows), processing_class=tok,
        longpack=LongpackConfig(cp=args.cp, global_batch=32, token_cap=1024))
    trainer.train()
    if trainer.args.process_index == 0:  # the plan's steps, planned while training ran
        plan = trainer.plan
        sharded = sum(1 for st in plan.steps for r, rep in enumerate(st.replicas) if st.replica_cp(r) > 1
                      for mb in rep.micro_batches for p in mb.pieces if p.cp_rank is None)
        print(f"plan: {len(plan.steps)} steps at CP degrees {[st.cp for st in plan.steps]}, {sharded} pieces "
              f"sharded over a CP group, {len(plan.lengths)} rows", flush=True)
    if torch.distributed.is_initialized():
        leave()  # the process groups left together, no interpreter teardown (torch 2.13's gloo can hang there)


if __name__ == "__main__":
    main()
