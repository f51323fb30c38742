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


def prepare(root: Path, n_rows: int) -> tuple[Path, Path, Path, int]:
    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from longpack.workloads import generate

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "tiny")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                         eos_token="[PAD]").save_pretrained(root / "tok")
    rng = np.random.default_rng(0)
    lengths = generate("tiny-longtail", n_rows, seed=0)
    with open(root / "rows.jsonl", "w") as f:
        for n in lengths.tolist():
            ids = rng.integers(2, 1024, n).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]}) + "\n")
    return root / "tiny", root / "rows.jsonl", root / "tok", int(lengths.sum())


def run_longpack(model: Path, rows: Path, batch: int) -> list[float]:
    cmd = [sys.executable, "-m", "longpack.cli", "train", "--data", str(rows), "--model-path", str(model),
           "--planner", "unified", "--nproc", "2", "--global-batch", str(batch), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(x)["step_seconds"] for x in out.splitlines() if x.startswith('{"step"')]


def run_baseline(mode: str, model: Path, rows: Path, tok: Path, steps: int, batch: int) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "_hf_baseline.py"),
           mode, str(model), str(rows), str(tok), str(steps), str(batch)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return next(json.loads(x) for x in out.splitlines() if x.startswith('{"mode"'))["step_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=96)  # the padded Trainer takes ~80 s a step at 192
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hf_throughput_"))
    model, rows, tok, tokens = prepare(root, args.rows)
    steps = -(-args.rows // args.global_batch)
    runs = {"longpack (FSDP2, unified)": lambda: run_longpack(model, rows, args.global_batch),
            "transformers.Trainer, padded": lambda: run_baseline("padded", model, rows, tok, steps,
                                                                 args.global_batch),
            "TRL SFTTrainer, packing=True": lambda: run_baseline("trl", model, rows, tok, steps, args.global_batch),
            "transformers.Trainer, DataCollatorWithFlattening": lambda: run_baseline("flatten", model, rows, tok,
                                                                                    steps, args.global_batch),
            "LongpackTrainer (unified)": lambda: run_baseline("longpack", model, rows, tok, steps,
                                                              args.global_batch)}
    got: dict[str, list[tuple[float, int]]] = {k: [] for k in runs}
    for _ in range(args.repeat):
        for name, fn in runs.items():
            times = fn()
            got[name].append((sum(times), len(times)))
            print(f"{name:32s} {tokens / sum(times):8.0f} tokens/s  {len(times)} steps", flush=True)
    med = {k: (tokens / statistics.median(t for t, _ in v), v[0][1]) for k, v in got.items()}
    base = med["transformers.Trainer, padded"][0]
    lines = [f"| {k} | {tps:.0f} | {tps / base:.2f}x | {n} |" for k, (tps, n) in med.items()]
    print("\n".join(lines))
    if args.write:
        import torch
        import transformers
        import trl

        body = ("| run | real tokens/s (median) | vs Trainer padded | optimizer steps |\n|---|---|---|---|\n"
                + "\n".join(lines)
                + f"\n\n{args.rows} rows ({tokens} tokens, tiny-longtail lengths, first third of each row masked), "
                f"one epoch, {args.global_batch} rows a step (TRL: packs sized for about {steps} steps), tiny Llama "
                f"(4 layers, hidden 256, vocab 1024), float32, 2 processes x 1 thread; median of {args.repeat} "
                f"interleaved rounds; torch {torch.__version__}, transformers {transformers.__version__}, trl "
                f"{trl.__version__}.")
        write_section("hf_throughput", "longpack train and LongpackTrainer vs Trainer and TRL (real CPU runs)",
                      "python bench/hf_throughput.py --write", body)


if __name__ == "__main__":
    main()
