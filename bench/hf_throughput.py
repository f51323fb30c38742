"""Real CPU tokens/s of `longpack train` and LongpackTrainer against transformers.Trainer (padded, and with its
DataCollatorWithFlattening) and TRL's SFTTrainer with packing: the same rows, the same checkpoint, one epoch each,
2 processes, side by side in one run.

    python bench/hf_throughput.py [--rows 96] [--global-batch 32] [--repeat 2] [--write]

The checkpoint is a random-init tiny Llama (tiny-llama's shape, vocab 1024) written by ``save_pretrained``; the
rows are tiny-longtail lengths of random tokens whose first third is a masked prompt (``labels`` -100). Runs:

* longpack — ``longpack train --data rows.jsonl --model-path tiny --nproc 2`` (FSDP2 over both ranks, the unified
  plan, the longpack attention), global batch ``--global-batch`` rows;
* Trainer, padded — ``transformers.Trainer`` under torchrun (DDP over gloo), the same rows per step, each
  micro-batch padded to its longest row, sdpa;
* TRL, packed — ``trl.SFTTrainer(packing=True, packing_strategy="bfd_split")`` under torchrun, packs sized so the
  epoch takes about as many steps, completion-only loss from the same mask, sdpa;
* Trainer, flattened — ``transformers.Trainer`` with ``DataCollatorWithFlattening`` (each process's rows of a step
  in one packed row; sdpa masks the documents apart with a dense mask over the row);
* LongpackTrainer — ``LongpackTrainer`` under torchrun (the unified plan, the longpack engine), the same rows per
  step.

Tokens/s = the epoch's real tokens / the sum of measured step times (each run's own step timer; start-up, model
loading and planning excluded), median over ``--repeat`` interleaved rounds; 1 thread per process.

On GPUs (``--gpu N``, bench/gpu.sh): a Qwen2.5-0.5B-shaped random-init checkpoint in bf16, lmsys-chat-1m lengths,
N processes under torchrun (NCCL), token cap ``--cap``; arms: ``longpack train`` (unified, FSDP2), Trainer with
DataCollatorWithFlattening and Trainer with one row per micro-batch and gradient accumulation (both on
``flash_attention_2`` where flash_attn is installed, else sdpa), LongpackTrainer; MFU beside tokens/s (model FLOPs
of the rows' tokens and causal attention pairs over the GPUs' dense bf16 peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import write_section

HERE = Path(__file__).resolve().parent


def prepare(root: Path, n_rows: int, gpu: bool = False) -> tuple[Path, Path, Path, int]:
    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from longpack.workloads import generate

    if gpu:  # Qwen2.5-0.5B's shape
        cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       max_position_embeddings=32768, tie_word_embeddings=True)
        vocab, workload = 151936, "lmsys-chat-1m"
    else:
        cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
        vocab, workload = 1024, "tiny-longtail"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "tiny")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                         eos_token="[PAD]").save_pretrained(root / "tok")
    rng = np.random.default_rng(0)
    lengths = generate(workload, n_rows, seed=0)
    with open(root / "rows.jsonl", "w") as f:
        for n in lengths.tolist():
            ids = rng.integers(2, vocab, n).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]}) + "\n")
    return root / "tiny", root / "rows.jsonl", root / "tok", int(lengths.sum())


def run_longpack(model: Path, rows: Path, batch: int, gpus: int = 0, cap: int = 4096) -> list[float]:
    cmd = [sys.executable, "-m", "longpack.cli", "train", "--data", str(rows), "--model-path", str(model),
           "--planner", "unified", "--global-batch", str(batch), "--json"]
    if gpus:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
               *cmd[1:], "--dtype", "bfloat16", "--hardware", "h100", "--token-cap", str(cap)]
    else:
        cmd += ["--nproc", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(x)["step_seconds"] for x in out.splitlines() if x.startswith('{"step"')]


def run_baseline(mode: str, model: Path, rows: Path, tok: Path, steps: int, batch: int, gpus: int = 0,
                 cap: int = 4096) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus or 2),
           str(HERE / "_hf_baseline.py"), mode, str(model), str(rows), str(tok), str(steps), str(batch)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if gpus:
        import importlib.util

        attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        env |= {"HF_BASELINE_GPU": "1", "HF_BASELINE_ATTN": attn, "HF_BASELINE_CAP": str(cap)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return next(json.loads(x) for x in out.splitlines() if x.startswith('{"mode"'))["step_seconds"]


def mfu_flops(rows: Path) -> float:
    """Model FLOPs of one epoch of ``rows`` on Qwen2.5-0.5B: 3 x forward per token of the linears and the head, and
    per (query, key) pair of each row's causal attention."""
    from longpack.model import get_model

    spec = get_model("qwen2.5-0.5b")
    lengths = [len(json.loads(x)["input_ids"]) for x in open(rows)]
    tokens, pairs = sum(lengths), sum(n * (n + 1) / 2 for n in lengths)
    return 3 * (tokens * (spec.layers * spec.linear_flops_per_token + spec.head_flops_per_token)
                + pairs * spec.layers * spec.attn_flops_per_pair)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=96)  # the padded Trainer takes ~80 s a step at 192
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--gpu", type=int, default=0, help="GPUs (processes): the GPU arms, bf16, Qwen2.5-0.5B shape")
    ap.add_argument("--cap", type=int, default=4096, help="longpack's token cap per rank and micro-batch")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="one GPU's dense bf16 peak (H100/H200: 989)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hf_throughput_"))
    g, cap, batch = args.gpu, args.cap, args.global_batch
    model, rows, tok, tokens = prepare(root, args.rows, gpu=bool(g))
    steps = -(-args.rows // batch)
    runs = {"longpack (FSDP2, unified)": lambda: run_longpack(model, rows, batch, g, cap),
            "transformers.Trainer, padded": lambda: run_baseline("padded", model, rows, tok, steps, batch),
            "TRL SFTTrainer, packing=True": lambda: run_baseline("trl", model, rows, tok, steps, batch),
            "transformers.Trainer, DataCollatorWithFlattening": lambda: run_baseline("flatten", model, rows, tok,
                                                                                    steps, batch, g, cap),
            "transformers.Trainer, 1 row per micro-batch + gradient accumulation":
                lambda: run_baseline("ga", model, rows, tok, steps, batch, g, cap),
            "LongpackTrainer (unified)": lambda: run_baseline("longpack", model, rows, tok, steps, batch, g, cap)}
    if g:  # the arms on the GPUs' own kernels: no padded batches, no TRL run
        runs = {k: v for k, v in runs.items() if "padded" not in k and "TRL" not in k}
    got: dict[str, list[tuple[float, int]]] = {k: [] for k in runs}
    for _ in range(args.repeat):
        for name, fn in runs.items():
            times = fn()
            got[name].append((sum(times), len(times)))
            print(f"{name:32s} {tokens / sum(times):8.0f} tokens/s  {len(times)} steps", flush=True)
    med = {k: (tokens / statistics.median(t for t, _ in v), v[0][1]) for k, v in got.items()}
    base_name = "transformers.Trainer, DataCollatorWithFlattening" if g else "transformers.Trainer, padded"
    base = med[base_name][0]
    flops = mfu_flops(rows) if g else 0.0
    lines = []
    for k, (tps, n) in med.items():
        mfu = f" {flops * tps / tokens / (g * args.peak_tflops * 1e12):.1%} |" if g else ""
        lines.append(f"| {k} | {tps:.0f} | {tps / base:.2f}x | {n} |{mfu}")
    print("\n".join(lines))
    if args.write:
        import torch
        import transformers
        import trl

        head = ("| run | real tokens/s (median) | vs " + base_name.split(", ")[-1] + " | optimizer steps |"
                + (" MFU |\n|---|---|---|---|---|\n" if g else "\n|---|---|---|---|\n"))
        setting = (f"Qwen2.5-0.5B shape (random init), bf16, {g} GPU(s) ({torch.cuda.get_device_name()}), "
                   f"lmsys-chat-1m lengths, longpack token cap {cap}" if g else
                   "tiny Llama (4 layers, hidden 256, vocab 1024), float32, 2 processes x 1 thread, tiny-longtail "
                   "lengths")
        body = (head + "\n".join(lines)
                + f"\n\n{args.rows} rows ({tokens} tokens, first third of each row masked), one epoch, "
                f"{batch} rows a step (TRL: packs sized for about {steps} steps), {setting}; constant LR, no "
                f"clipping in every arm; median of {args.repeat} interleaved rounds; torch {torch.__version__}, "
                f"transformers {transformers.__version__}, trl {trl.__version__}.")
        name, title = (("hf_throughput_gpu", "longpack vs Trainer on GPUs (bf16)") if g else
                       ("hf_throughput", "longpack train and LongpackTrainer vs Trainer and TRL (real CPU runs)"))
        write_section(name, title, f"python bench/hf_throughput.py {'--gpu ' + str(g) + ' ' if g else ''}--write",
                      body)


if __name__ == "__main__":
    main()
