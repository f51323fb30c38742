"""The arms of bench/gpu_run.py, each one training run in this process on the same rows and checkpoint, timed
after its warm-up steps, returning one dict of figures.

* ``longpack`` / ``longpack_padded`` — `longpack train` (runtime/run/train.train, in process): the unified plan, and
  random_padded (padded micro-batches) on the same engine; bf16 compute, fp32 masters (FSDP2 on one process),
  fused AdamW, the fused linear cross-entropy.
* ``hf_flatten`` — transformers.Trainer, the model in fp32 under bf16 autocast (``bf16=True``), fused AdamW
  (``adamw_torch_fused``), ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: each micro-batch packs
  consecutive rows up to the same token cap, its documents handed to the attention as ``cu_seq_lens``; gradient
  accumulation to the step's rows; the attention is the same FlashAttention varlen kernel as longpack's
  (:func:`register_kernel`), reading the offsets from those kwargs with no host read.
* ``hf_liger`` — the same with Liger's kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) applied to the
  model, where ``liger_kernel`` imports (skipped and said otherwise).
* ``trl_bfd`` — TRL's SFTTrainer with ``packing=True, packing_strategy="bfd", padding_free=True`` at the same cap,
  completion-only loss from the same targets, where ``trl`` imports.

Every arm: lr 1e-4 constant, gradient clipping at 1.0, the same steps; gradient checkpointing for the HF arms
when the longest row is longer than ``ckpt_above`` tokens (as a user would need to set it to fit). Figures: tokens
per second over the timed steps, the step's model FLOPs (bench/gpu_run.model_flops) per second, peak allocated
GiB, final loss, and the seconds from the arm's start to its first step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

KERNEL = "lp_varlen"


def register_kernel() -> None:
    """The HF arms' attention: documents from DataCollatorWithFlattening's flash kwargs, through longpack's varlen
    backend (torch's FlashAttention varlen kernel on a GPU; its CPU path on the dry run), no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from longpack.runtime.kernel import varlen

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # noqa: ANN001
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        cu = kw.get("cu_seq_lens_q")
        if cu is None:
            cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
            longest = q.shape[0]
        else:
            longest = int(kw["max_length_q"])  # a host int the collator computed
        return varlen.attention_offsets(q, k, v, cu.to(torch.int32), longest)[None], None

    AttentionInterface.register(KERNEL, attention)
    AttentionMaskInterface.register(KERNEL, lambda *a, **k: None)


def cap_batches(lengths: list[int], cap: int) -> list[list[int]]:
    """Consecutive rows packed into micro-batches of at most ``cap`` tokens (a longer row alone)."""
    out: list[list[int]] = []
    cur, tokens = [], 0
    for i, n in enumerate(lengths):
        if cur and tokens + n > cap:
            out.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    return out + ([cur] if cur else [])


class _Clock:
    """Per optimizer step: wall seconds (device synchronised) and tokens, from a Trainer callback and the
    training_step override that counts each micro-batch's tokens on the host (its shape: no device read)."""

    def __init__(self) -> None:
        self.t0, self.tokens, self.steps = time.perf_counter(), 0, []
        self.first: float | None = None

    def step_end(self, loss: float | None) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.first = self.first if self.first is not None else now
        self.steps.append({"seconds": now - self.t0, "tokens": self.tokens, "loss": loss})
        self.t0, self.tokens = now, 0


def hf_arm(name: str, ckpt: Path, rows: list[dict], cap: int, steps: int, batch: int, gpu: bool,
           ckpt_above: int) -> dict[str, Any]:
    """One Hugging Face arm (module docstring)."""
    import transformers

    t_start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=KERNEL)
    model.config.use_cache = False
    modeling = sys.modules[type(model).__module__]
    saved = dict(vars(modeling))  # Liger replaces module-level functions (RoPE): restored for the arms after this
    try:
        if name == "hf_liger":
            import liger_kernel.transformers as liger

            getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}")(
                rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model)
        return _train_hf(name, model, rows, cap, steps, batch, gpu, ckpt_above, t_start)
    finally:
        for key in set(vars(modeling)) - set(saved):
            delattr(modeling, key)
        for key, value in saved.items():
            if vars(modeling).get(key) is not value:
                setattr(modeling, key, value)


def _train_hf(name: str, model: Any, rows: list[dict], cap: int, steps: int, batch: int, gpu: bool,
              ckpt_above: int, t_start: float) -> dict[str, Any]:
    import datasets
    import transformers

    longest = max(len(r["input_ids"]) for r in rows)
    clock = _Clock()
    micro = cap_batches([len(r["input_ids"]) for r in rows], cap)
    accum = max(1, round(len(micro) / max(1, len(rows) // batch)))
    common = dict(output_dir=f"/tmp/gpu_run_{name}", max_steps=steps, learning_rate=1e-4, lr_scheduler_type="constant",
                  max_grad_norm=1.0, weight_decay=0.0, bf16=gpu, optim="adamw_torch_fused" if gpu else "adamw_torch",
                  gradient_accumulation_steps=accum, per_device_train_batch_size=1, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, use_cpu=not gpu, seed=0,
                  gradient_checkpointing=longest > ckpt_above, dataloader_pin_memory=gpu)
    cb = _callback(clock)
    if name == "trl_bfd":
        import trl

        ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "completion_mask":
                                          [int(x != -100) for x in r["labels"]]} for r in rows])
        args = trl.SFTConfig(**common, packing=True, packing_strategy="bfd", padding_free=True, max_length=cap,
                             completion_only_loss=True, dataset_kwargs={"skip_prepare_dataset": False})
        tr: Any = _counting(trl.SFTTrainer)(model=model, args=args, train_dataset=ds, callbacks=[cb])
    else:
        ds = datasets.Dataset.from_list(rows)
        collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        tr = _counting(transformers.Trainer)(model=model, args=transformers.TrainingArguments(**common),
                                             train_dataset=ds, data_collator=collate, callbacks=[cb])
        tr.micro_batches = micro
    tr.clock = clock
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    clock.t0 = time.perf_counter()
    start_up = clock.t0 - t_start
    tr.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"steps": clock.steps, "startup_seconds": start_up, "peak_gib": peak, "accum": accum,
            "checkpointing": longest > ckpt_above}


def _callback(clock: _Clock) -> Any:
    from transformers import TrainerCallback

    class Cb(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN003
            if logs and "loss" in logs and clock.steps:
                clock.steps[-1]["loss"] = logs["loss"]

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            clock.step_end(None)

    return Cb()


def _counting(base: type) -> type:
    """``base`` with its micro-batches' tokens counted (host shapes) and, when set, its batches of rows given by
    ``micro_batches`` (the token-capped packing)."""

    class Counting(base):  # type: ignore[misc, valid-type]
        micro_batches: list[list[int]] | None = None
        clock: _Clock

        def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001, ANN201
            self.clock.tokens += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

        def get_train_dataloader(self):  # noqa: ANN201
            if self.micro_batches is None:
                return super().get_train_dataloader()
            loader = torch.utils.data.DataLoader(
                self.train_dataset.remove_columns([c for c in self.train_dataset.column_names
                                                   if c not in ("input_ids", "labels")]),
                batch_sampler=self.micro_batches, collate_fn=self.data_collator,
                pin_memory=self.args.dataloader_pin_memory)
            return self.accelerator.prepare(loader)

    return Counting


def longpack_arm(planner: str, ckpt: Path, rows_path: Path, cap: int, steps: int, batch: int, gpu: bool,
                 max_len: int, profile: Path | None = None, head_loss: str = "auto") -> dict[str, Any]:
    """`longpack train` in this process (module docstring); ``profile``: a torch.profiler trace of its steps."""
    import torch.distributed as dist

    from longpack import jobs
    from longpack.runtime.kernel.head_loss import head_loss_name, resolve_head_loss
    from longpack.runtime.run.train import train
    from longpack.runtime.run.train_args import TrainArgs

    run = jobs.RunSpec(model="model", hardware="h100" if gpu else "cpu", global_batch=batch, steps=steps,
                       token_cap=cap, max_len=max_len, seed=0)
    args = TrainArgs.of(planner=planner, run=run, data=str(rows_path), model_path=str(ckpt), lr=1e-4,
                     dtype="bfloat16" if gpu else "float32", plan_ahead=4, timeout=300.0,
                     kernels="compile", head_loss=head_loss)  # compile: as auto on CUDA; on the dry run too
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if profile is None:
        out = train(args)
    else:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with prof(activities=acts) as p:
            out = train(args)
        profile.write_text(json.dumps(_categories(p, sum(r["step_seconds"] for r in out["steps"]))))
    if dist.is_initialized():
        dist.destroy_process_group()
    steps_out = [{"seconds": r["step_seconds"], "tokens": r["tokens"], "loss": r["loss"],
                  "predicted_gib": max(r["memory"]["predicted_bytes"]) / 2**30,
                  "measured_gib": max(r["memory"]["measured_bytes"]) / 2**30} for r in out["steps"]]
    phases = out.get("startup", {})  # in this process its imports are the driver's: the run's own phases only
    return {"steps": steps_out, "startup_seconds": sum(v for k, v in phases.items()
                                                       if k not in ("imports", "first_step", "total")),
            "peak_gib": max(s["measured_gib"] for s in steps_out),
            "predicted_gib": max(s["predicted_gib"] for s in steps_out),
            "head_loss": head_loss_name(resolve_head_loss(head_loss, torch.device("cuda" if gpu else "cpu"),
                                                          torch.bfloat16 if gpu else torch.float32, "token_mean"))}


CATEGORIES = (("communication", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
              ("attention", ("flash", "varlen", "fmha", "attn")),
              ("matmul", ("gemm", "cutlass", "matmul", "sm90_xmma", "sm80_xmma", "cublas", "_mm", "addmm")),
              ("loss", ("logsumexp", "softmax", "cross_entropy", "scatter", "gather")),
              ("elementwise", ("",)))


def _categories(p: Any, wall: float) -> dict[str, float]:
    """Device seconds by category of the kernels in a profile (CPU ops on the dry run), and idle = the steps'
    wall time not covered."""
    out = {c: 0.0 for c, _ in CATEGORIES}
    for ev in p.key_averages():
        dev = getattr(ev, "self_device_time_total", 0) or 0
        t = (dev if dev else ev.self_cpu_time_total) / 1e6
        name = ev.key.lower()
        cat = next(c for c, keys in CATEGORIES if any(k in name for k in keys))
        out[cat] += t
    busy = sum(out.values())
    out["idle"] = max(0.0, wall - busy)
    out["wall"] = wall
    return out
