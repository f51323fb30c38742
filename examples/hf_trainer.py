"""Train a Hugging Face model with longpack's packing and balancing in a few lines (CPU, offline).

    python examples/hf_trainer.py                                   # one process
    torchrun --nproc-per-node 2 examples/hf_trainer.py              # two processes (gloo on CPU)

A tiny random LlamaForCausalLM from a config (no download), a dataset of token rows built offline with the length
profile of the tiny-longtail workload, and LongpackTrainer in place of transformers.Trainer: the plan decides
every process's packed micro-batches, and the loss is the global token mean of each optimizer step.
"""

from __future__ import annotations

import argparse

import datasets
import torch
import transformers

from longpack.hf import LongpackConfig, LongpackTrainer
from longpack.runtime.dist import leave
from longpack.runtime.kernel.data import SyntheticCorpus
from longpack.workloads import generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--planner", default="unified")
    ap.add_argument("--output-dir", default="/tmp/longpack-hf-example")
    args = ap.parse_args()

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)

    corpus = SyntheticCorpus(config.vocab_size, seed=0)
    lengths = generate("tiny-longtail", args.samples, seed=0)
    rows = [corpus.tokens(i, int(n)).tolist() for i, n in enumerate(lengths)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows})

    training_args = transformers.TrainingArguments(output_dir=args.output_dir, max_steps=args.steps,
                                                   learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
                                                   save_strategy="no", per_device_train_batch_size=1)
    trainer = LongpackTrainer(model=model, args=training_args, train_dataset=dataset,
                              longpack=LongpackConfig(planner=args.planner, global_batch=32, token_cap=4096))
    trainer.train()
    if torch.distributed.is_initialized():
        leave()  # the process groups left together, no interpreter teardown (torch 2.13's gloo can hang there)


if __name__ == "__main__":
    main()
