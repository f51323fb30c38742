"""One Trainer run of bench/hf_throughput.py under torchrun, on the bench's rows and checkpoint, one epoch; rank 0
prints one JSON line: each step's wall seconds and every rank's compute seconds per step.

Modes, each the baseline at its best and under its own sampler:

* ``ga`` — transformers.Trainer, one row per process and micro-batch, gradient accumulation to the step's rows: no
  padding, no mask;
* ``group`` — transformers.Trainer with ``train_sampling_strategy="group_by_length"``, micro-batches of rows of
  like length, right-padded;
* ``flatten`` — transformers.Trainer with its DataCollatorWithFlattening: every process's rows of a micro-batch in
  one packed row, position ids restarting per row;
* ``trl`` — TRL's SFTTrainer with ``packing=True, padding_free=True`` and its default ``bfd`` packing, completion-only
  loss from the same mask, packs of ``max_length`` the bench's token cap;
* ``longpack`` — LongpackTrainer (the unified plan on the longpack engine).

Every arm: AdamW, constant LR, no clipping, 1 thread per process, and one attention kernel, registered as
``attn_implementation="per_document"``: longpack's own (runtime/kernel/varlen.attention: each document causal on its
own, FlashAttention varlen on a GPU, batched causal SDPA per length on a CPU), fed each packed row's documents from
its position ids and each padded row's length from its mask. No arm pays a dense mask over a packed row.

Step seconds and compute seconds (the CPU time of the process's own thread, time.thread_time), both from the end
of the step before (a TrainerCallback): fetching and collating the step's rows, forward, backward and AdamW; the
wait in DDP's gradient all-reduce costs no CPU time.

    torchrun --nproc-per-node N bench/_hf_baseline.py MODE MODEL_DIR ROWS.jsonl TOKENIZER_DIR BATCH CAP
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

KERNEL = "per_document"


def per_document_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,  # noqa: ANN001
                           **kwargs):  # noqa: ANN003, ANN201
    """[B, H, T, D] -> ([B, T, H, D], None): a packed row's documents (position ids restarting at 0) or each
    padded row's first n tokens (n from the boolean mask's diagonal: right padding) causally, each on its own."""
    from longpack.runtime.kernel import varlen

    q, k, v = (t.transpose(1, 2).to(value.dtype) for t in (query, key, value))  # [B, T, H, D]
    b, t = q.shape[:2]
    pos = kwargs.get("position_ids")
    if attention_mask is None and pos is not None and b == 1:
        starts = (pos[0] == 0).nonzero().flatten().tolist()
        seqs = varlen.Seqs.of_offsets([*(starts if starts and starts[0] == 0 else [0, *starts]), t])
        return varlen.attention(q[0], k[0], v[0], seqs)[None], None
    if attention_mask is None:
        lengths = [t] * b
    else:
        lengths = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1).sum(-1).tolist()
    rows = [F.pad(varlen.attention(q[i, :n], k[i, :n], v[i, :n], varlen.Seqs([n])), (0, 0, 0, 0, 0, t - n))
            for i, n in enumerate(lengths)]
    return torch.stack(rows), None


def register() -> None:
    """The kernel for the model, and its masks: none for an unpadded batch, the boolean one for a padded batch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        padding = kwargs.get("attention_mask")
        return None if padding is None or bool(padding.all()) else sdpa_mask(*args, **kwargs)

    AttentionInterface.register(KERNEL, per_document_attention)
    AttentionMaskInterface.register(KERNEL, mask)


class _Timer:
    """A TrainerCallback: each optimizer step's wall seconds, and this thread's CPU seconds over it, each from the
    end of the step before (the first from the epoch's start): the Trainer fetches and collates a step's batches
    before its step-begin event, while `longpack train`'s step time includes building its micro-batches' tensors
    from the rows (runtime/kernel/step.py), so both clocks cover the same work."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.t0 = self.c0 = 0.0

    def hook(self):  # noqa: ANN201
        from transformers import TrainerCallback

        timer = self

        class Cb(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
                timer.t0, timer.c0 = time.perf_counter(), time.thread_time()

            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
                t, c = time.perf_counter(), time.thread_time()
                timer.cpu.append(c - timer.c0)
                timer.wall.append(t - timer.t0)
                timer.t0, timer.c0 = t, c

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


def trainer(mode: str, model, rows: list[dict], tok_dir: str, batch: int, cap: int, world: int, gpu: bool,  # noqa: ANN001
            timer: _Timer):  # noqa: ANN201
    import datasets
    import transformers

    common = dict(output_dir=f"/tmp/hf_baseline_{mode}", num_train_epochs=1, learning_rate=1e-3, report_to=[],
                  use_cpu=not gpu, ddp_backend="nccl" if gpu else "gloo", logging_steps=10**6, save_strategy="no",
                  disable_tqdm=True, dataloader_num_workers=0, seed=0, ddp_find_unused_parameters=False,
                  lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, bf16=False,
                  per_device_train_batch_size=batch // world)
    ds = datasets.Dataset.from_list(rows)
    cb = [timer.hook()]
    if mode == "ga":
        common.update(per_device_train_batch_size=1, gradient_accumulation_steps=batch // world)
        return transformers.Trainer(model=model, args=transformers.TrainingArguments(**common), train_dataset=ds,
                                    callbacks=cb)
    if mode == "group":
        args = transformers.TrainingArguments(**common, train_sampling_strategy="group_by_length",
                                              remove_unused_columns=False)
        ds = ds.map(lambda r: {"length": len(r["input_ids"])})
        return transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=_pad, callbacks=cb)
    if mode == "flatten":
        return transformers.Trainer(model=model, args=transformers.TrainingArguments(**common), train_dataset=ds,
                                    data_collator=transformers.DataCollatorWithFlattening(), callbacks=cb)
    if mode == "longpack":
        from longpack.hf import LongpackConfig, LongpackTrainer

        common["per_device_train_batch_size"] = 1
        lp = LongpackConfig(global_batch=batch, token_cap=cap, hardware="h100" if gpu else "cpu")
        return LongpackTrainer(model=model, args=transformers.TrainingArguments(**common), train_dataset=ds,
                               callbacks=cb, longpack=lp)
    if mode == "trl":
        import trl

        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
        ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"],
                                          "completion_mask": [int(x != -100) for x in r["labels"]]} for r in rows])
        common["per_device_train_batch_size"] = 1
        args = trl.SFTConfig(**common, packing=True, padding_free=True, max_length=cap, completion_only_loss=True,
                             dataset_kwargs={})
        return trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=cb)
    raise SystemExit(f"mode {mode!r}: ga, group, flatten, trl or longpack")


def main() -> None:
    import torch.distributed as dist
    import transformers

    mode, model_dir, rows_path, tok_dir, batch, cap = sys.argv[1:7]
    torch.set_num_threads(1)
    register()
    rows = [json.loads(x) for x in open(rows_path)]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = os.environ.get("HF_BASELINE_GPU", "0") == "1"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=KERNEL,
                                                              dtype=torch.bfloat16 if gpu else torch.float32)
    model.config.use_cache = False
    timer = _Timer()
    tr = trainer(mode, model, rows, tok_dir, int(batch), int(cap), world, gpu, timer)
    tr.train()
    cpu = [timer.cpu]
    if dist.is_initialized():
        cpu = [None] * world
        dist.all_gather_object(cpu, timer.cpu)
    if tr.args.process_index == 0:
        print(json.dumps({"mode": mode, "step_seconds": timer.wall, "compute_seconds": cpu}), flush=True)


if __name__ == "__main__":
    main()
