"""Parity of every execution path on the GPU, in bf16, against transformers' own unpacked training of the same rows.

    python bench/gpu_parity.py OUT [--ngpu N] [--steps 3] [--write]
    python bench/gpu_parity.py OUT --dry-run [--ngpu 2]   # CPU: float32 against float64, to check the script

The checkpoint is a random-init Qwen2-shaped model (4 layers, hidden 256, GQA 8/2 heads, vocab 4096) written by
``save_pretrained``; the rows are 24 prompt-masked rows of 16-400 tokens and two of 2,500 and 3,000, trained as
3 steps of 8 rows (every row once). Paths, each a real ``longpack train`` (unified plan) on those files:

* documents — one process, token cap 4,096: whole documents packed, one varlen call per layer, longpack's own fused
  loss (``--head-loss longpack``);
* chain — one process, token cap 1,024: the long rows run as chunk chains over the K/V store; this path and the
  next ones on ``--head-loss auto`` (Liger's fused loss where ``liger_kernel`` is installed), each named;
* with 2 GPUs or more: FSDP2 over 2 ranks, CP 2 (sharded pieces and sharded chains at cap 1,024), PP 2;
* LongpackTrainer — the Trainer path in this process (constant LR, no clipping, as the reference).

Reference: ``AutoModelForCausalLM`` (sdpa), each row alone, the step's loss the sum of its rows' token
cross-entropies over the step's targets, AdamW — once exact (float32 on the GPU, float64 in the dry run) and once
in the bench dtype: transformers' own rounding. A path passes when every step's loss is within max(2 x
transformers' own deviation, 1e-3; 1e-6 in the dry run) of the exact curve, relative.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LR, BATCH, VOCAB, IGNORE = 1e-4, 8, 4096, -100
LONG = (2500, 3000)


def prepare(root: Path) -> tuple[Path, Path]:
    import numpy as np
    import torch
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(16, 401, 3 * BATCH - len(LONG)).tolist(), *LONG]
    with open(root / "rows.jsonl", "w") as f:
        for n in lengths:
            ids = rng.integers(1, VOCAB, n).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE] * (n // 3) + ids[n // 3:]}) + "\n")
    return root / "model", root / "rows.jsonl"


def reference(model_dir: Path, rows_path: Path, steps: int, dtype: str, device: str) -> list[float]:
    """transformers alone: every row its own batch, the step's targets averaged, AdamW; per-step losses."""
    import torch
    import transformers

    from longpack.planners import global_batches

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                              attn_implementation="sdpa").to(device).train()
    rows = [json.loads(x) for x in open(rows_path)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for batch in global_batches(len(rows), BATCH, seed=0, steps=steps):
        total = sum(sum(t != IGNORE for t in rows[i]["labels"][1:]) for i in batch.tolist())
        step = 0.0
        for i in batch.tolist():
            ids = torch.tensor([rows[i]["input_ids"]], device=device)
            labels = torch.tensor(rows[i]["labels"], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE,
                                                     reduction="sum") / max(total, 1)
            loss.backward()  # row by row: the step's graph is never held whole
            step += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(step)
    return losses


def longpack_train(model_dir: Path, rows: Path, steps: int, dtype: str, nproc: int, gpu: bool, cap: int,
                   *flags: str) -> tuple[list[float], str]:
    """One ``longpack train`` run (torchrun on GPUs, its own --nproc launcher on CPU); per-step losses, and an
    error or the head loss that ran (its first record)."""
    cmd = ["-m", "longpack.cli", "train", "--data", str(rows), "--model-path", str(model_dir), "--planner", "unified",
           "--dtype", dtype, "--steps", str(steps), "--global-batch", str(BATCH), "--token-cap", str(cap),
           "--lr", str(LR), "--lr-scheduler", "constant", "--max-grad-norm", "0", "--json", *flags]
    if gpu and nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd]
    elif nproc > 1:
        cmd += ["--nproc", str(nproc)]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return [], proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else f"exit {proc.returncode}"
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]
    run = next((json.loads(x)["run"] for x in proc.stdout.splitlines() if x.startswith('{"run"')), {})
    return [float(x["loss"]) for x in lines], f"head loss: {run.get('head_loss', '?')}"


def trainer(model_dir: Path, rows_path: Path, steps: int, dtype: str, gpu: bool) -> list[float]:
    """LongpackTrainer in this process, with the reference's optimizer: constant LR, no clipping."""
    import datasets
    import torch
    import transformers

    from longpack.hf import LongpackConfig, LongpackTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    rows = [json.loads(x) for x in open(rows_path)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps,
                                              learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
                                              weight_decay=0.0, optim="adamw_torch", report_to=[], use_cpu=not gpu,
                                              save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
        tr = LongpackTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             longpack=LongpackConfig(global_batch=BATCH, token_cap=4096))
        tr.train()
    return [float(s["loss"]) for s in tr.longpack_steps]


def deviation(losses: list[float], exact: list[float]) -> float:
    if len(losses) != len(exact):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, exact, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    import torch

    gpu = not a.dry_run
    if gpu and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_parity.py: no CUDA device; run it on a GPU machine, or with --dry-run")
    dtype, exact_dtype, device = ("bfloat16", "float32", "cuda") if gpu else ("float32", "float64", "cpu")
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    model, rows = prepare(root)
    exact = reference(model, rows, a.steps, exact_dtype, device)
    own = reference(model, rows, a.steps, dtype, device)
    tol = max(2 * deviation(own, exact), 1e-3 if gpu else 1e-6)  # bf16 on the GPU; float32 in the dry run
    arms: list[tuple[str, list[float], str]] = [(f"transformers, unpacked ({dtype})", own, "")]
    # documents on longpack's own fused loss, the rest on --head-loss auto: Liger's where it is installed
    arms.append(("documents", *longpack_train(model, rows, a.steps, dtype, 1, gpu, 4096, "--head-loss", "longpack")))
    arms.append(("chain", *longpack_train(model, rows, a.steps, dtype, 1, gpu, 1024)))
    if a.ngpu >= 2:
        arms.append(("FSDP2, 2 ranks", *longpack_train(model, rows, a.steps, dtype, 2, gpu, 4096)))
        arms.append(("CP 2", *longpack_train(model, rows, a.steps, dtype, 2, gpu, 1024, "--cp", "2")))
        arms.append(("PP 2", *longpack_train(model, rows, a.steps, dtype, 2, gpu, 1024, "--pp", "2")))
    arms.append(("LongpackTrainer", trainer(model, rows, a.steps, dtype, gpu), ""))
    lines = [f"Exact curve: transformers unpacked in {exact_dtype}: "
             + ", ".join(f"{x:.5f}" for x in exact) + f". Tolerance: {tol:.2e} relative.", "",
             "| path | losses per step | max relative deviation | within tolerance |", "|---|---|---|---|"]
    failed = 0
    for name, losses, error in arms:
        dev = deviation(losses, exact)
        ok = dev <= tol or name.startswith("transformers")
        failed += not ok
        shown = ", ".join(f"{x:.5f}" for x in losses) + (f" ({error})" if losses and error else "") \
            if losses else error
        lines.append(f"| {name} | {shown} | {dev:.2e} | {'yes' if ok else 'NO'} |")
    body = "\n".join(lines)
    print(body)
    if a.write:
        from _report import write_section

        gpu_name = torch.cuda.get_device_name() if gpu else "CPU dry run"
        write_section("gpu-parity", f"GPU parity ({dtype}, {gpu_name}, {a.ngpu} GPU(s))",
                      f"python bench/gpu_parity.py OUT --ngpu {a.ngpu}", body)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
