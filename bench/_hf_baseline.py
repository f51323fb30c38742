"""One Trainer run of bench/hf_throughput.py under torchrun, on the bench's rows and checkpoint, one epoch; rank 0
prints one JSON line of measured step times. Modes: ``padded`` (transformers.Trainer, each micro-batch padded),
``flatten`` (transformers.Trainer with its DataCollatorWithFlattening: every process's rows of a step in one packed
row, position ids restarting per row), ``ga`` (transformers.Trainer, one row per process and micro-batch, gradient
accumulation to the step's rows: no padding and no mask), ``trl`` (TRL's SFTTrainer with packing), ``longpack``
(LongpackTrainer, the unified plan on the longpack engine). Every arm: constant LR, no clipping, AdamW.

On GPUs (``HF_BASELINE_GPU=1``): bf16 weights, NCCL, and ``HF_BASELINE_ATTN`` (``flash_attention_2`` where the
flash_attn package is installed, else ``sdpa``) as the baselines' attention.

    torchrun --nproc-per-node 2 bench/_hf_baseline.py MODE MODEL_DIR ROWS.jsonl TOKENIZER_DIR STEPS BATCH
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


class _Timer:
    """A TrainerCallback that times each optimizer step and counts the real tokens it trained."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0

    def hook(self):  # noqa: ANN201
        from transformers import TrainerCallback

        timer = self

        class Cb(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
                timer.times.append(time.perf_counter() - timer.t0)

        return Cb()


def _pad(rows: list[dict]) -> dict:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main() -> None:
    import datasets
    import transformers

    mode, model_dir, rows_path, tok_dir, steps, batch = sys.argv[1:7]
    torch.set_num_threads(1)
    rows = [json.loads(x) for x in open(rows_path)]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = os.environ.get("HF_BASELINE_GPU", "0") == "1"
    attn = os.environ.get("HF_BASELINE_ATTN", "sdpa")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn,
                                                              dtype=torch.bfloat16 if gpu else torch.float32)
    model.config.use_cache = False
    timer = _Timer()
    common = dict(output_dir=f"/tmp/hf_baseline_{mode}", num_train_epochs=1, learning_rate=1e-3, report_to=[],
                  use_cpu=not gpu, ddp_backend="nccl" if gpu else "gloo", logging_steps=10**6, save_strategy="no",
                  disable_tqdm=True, dataloader_num_workers=0, seed=0, ddp_find_unused_parameters=False,
                  lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                  per_device_train_batch_size=int(batch) // world)
    tokens = None
    if mode == "padded":
        args = transformers.TrainingArguments(**common, remove_unused_columns=False)
        ds = datasets.Dataset.from_list(rows)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=_pad,
                                       callbacks=[timer.hook()])
    elif mode == "flatten":
        args = transformers.TrainingArguments(**common)
        ds = datasets.Dataset.from_list(rows)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[timer.hook()],
                                       data_collator=transformers.DataCollatorWithFlattening())
    elif mode == "ga":
        common.update(per_device_train_batch_size=1, gradient_accumulation_steps=int(batch) // world)
        args = transformers.TrainingArguments(**common)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                       callbacks=[timer.hook()])
    elif mode == "longpack":
        from longpack.hf import LongpackConfig, LongpackTrainer

        common["per_device_train_batch_size"] = 1
        args = transformers.TrainingArguments(**common)
        ds = datasets.Dataset.from_list(rows)
        cap = int(os.environ.get("HF_BASELINE_CAP", "4096"))
        lp = LongpackConfig(global_batch=int(batch), token_cap=cap, hardware="h100" if gpu else "cpu")
        trainer = LongpackTrainer(model=model, args=args, train_dataset=ds, callbacks=[timer.hook()], longpack=lp)
    elif mode == "trl":
        import trl

        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
        ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"],
                                          "completion_mask": [int(x != -100) for x in r["labels"]]} for r in rows])
        total = sum(len(r["input_ids"]) for r in rows)
        # packs of the size that trains the rows in the same number of steps as the other runs
        pack = max(max(len(r["input_ids"]) for r in rows), total // (int(steps) * world) + 1)
        common["per_device_train_batch_size"] = 1
        args = trl.SFTConfig(**common, packing=True, packing_strategy="bfd_split", max_length=pack,
                             completion_only_loss=True, dataset_kwargs={})
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                 callbacks=[timer.hook()])
        tokens = pack
    else:
        raise SystemExit(f"mode {mode!r}: padded, flatten, ga, trl or longpack")
    trainer.train()
    if trainer.args.process_index == 0:
        print(json.dumps({"mode": mode, "step_seconds": timer.times, "pack": tokens}), flush=True)


if __name__ == "__main__":
    main()
