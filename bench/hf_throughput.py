"""longpack against the strongest baselines a user would pick, on one attention kernel, with every rank's compute
time measured: real runs side by side, the same rows and checkpoint, one epoch each.

    python bench/hf_throughput.py [--ranks 2,4,8] [--rows 128] [--global-batch 32] [--cap 4096] [--write]

Checkpoint: a random-init tiny Llama (4 layers, hidden 256, GQA 8/2, vocab 1024) written by ``save_pretrained``.
Rows: ``--rows`` tiny-longtail lengths (99% short, a tail to ~4K tokens) of random tokens whose first third is a
masked prompt. Arms at each rank count N (N processes x 1 thread, gloo; start-up excluded):

* ``longpack train --nproc N`` with the unified, isf and random_padded planners (FSDP2, ``--shard auto``), and
  unified at each CP degree of ``--cp`` that divides N (long rows sharded over a CP group);
* LongpackTrainer (unified), and the baselines of bench/_hf_baseline.py under torchrun: Trainer with batch 1 +
  gradient accumulation, Trainer with ``group_by_length``, Trainer with DataCollatorWithFlattening, TRL SFTTrainer
  with ``packing=True, padding_free=True`` (bfd);

every one with AdamW, constant LR, no clipping, and longpack's attention kernel (the baselines through a
registered ``attn_implementation``: each document causal on its own; no arm pays a dense mask). Each arm runs its
own sampler, so a step's rows differ between arms (longpack's arms share one draw of the epoch's rows into steps);
TRL's steps are its packs (N x ``--cap`` tokens).

Figures per arm: tokens/s = the epoch's tokens / the sum of the measured step times (wall; a Trainer step from the
end of the one before, so its batch fetching and collation count as longpack's tensor building does); critical-path
tokens/s = the epoch's tokens / the sum over steps of the slowest rank's compute seconds (each rank's thread CPU
time in the step: waiting costs none, so a busy machine does not blur it); idle = 1 - (mean rank compute) /
(slowest rank compute), summed over steps — what the other ranks' GPUs would sit idle; and for longpack's planners
the same idle share predicted by the simulator (sim/simulate.py) for the plan the run executed.

On GPUs (``--gpu N``, bench/gpu.sh): a Qwen2.5-0.5B-shaped random-init checkpoint in bf16, lmsys-chat-1m lengths,
N processes under torchrun (NCCL); the same arms but group_by_length and TRL, the kernel FlashAttention varlen.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import write_section

HERE = Path(__file__).resolve().parent
BASELINES = {"LongpackTrainer (unified)": "longpack", "Trainer, batch 1 + gradient accumulation": "ga",
             "Trainer, group_by_length (padded)": "group", "Trainer, DataCollatorWithFlattening": "flatten",
             "TRL SFTTrainer, packing + padding_free (bfd)": "trl"}
PLANNERS = ("unified", "isf", "random_padded")  # at --cp 1; unified also at each other degree of --cp


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


def _env() -> dict[str, str]:
    src = str(HERE.parent / "src")
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH",
                                                                                                      "")])}


def run_longpack(model: Path, rows: Path, batch: int, n: int, planner: str, cap: int, gpu: bool,
                 cp: int = 1) -> dict:
    """``longpack train`` (its own --nproc launcher on CPU, torchrun on GPUs); wall and per-rank compute seconds."""
    cmd = ["-m", "longpack.cli", "train", "--data", str(rows), "--model-path", str(model), "--planner", planner,
           "--global-batch", str(batch), "--token-cap", str(cap), "--json", "--threads", "1", "--max-grad-norm",
           "0", "--lr-scheduler", "constant", "--cp", str(cp)]
    if gpu:
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *cmd, "--dtype",
               "bfloat16", "--hardware", "h100"]
    else:
        cmd += ["--nproc", str(n), "--hardware", "cpu"]
    out = _run([sys.executable, *cmd], _env())
    steps = [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]
    return _on_device({"wall": [s["step_seconds"] for s in steps], "compute": [s["compute_seconds"] for s in steps]},
                      gpu)


def _on_device(got: dict, gpu: bool) -> dict:
    """On GPUs a thread's CPU time is the host's launching, not the work: there the step's wall time stands for
    its critical path."""
    return got | {"compute": [[w] for w in got["wall"]]} if gpu else got


def _run(cmd: list[str], env: dict[str, str]) -> str:
    """stdout of ``cmd``; a failed run is said with its stderr's end and run once more (said too)."""
    for attempt in (1, 2):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 0:
            return proc.stdout
        print(f"run {attempt} of {' '.join(cmd[:8])}... failed (exit {proc.returncode}):\n"
              + "\n".join(proc.stderr.strip().splitlines()[-12:]), file=sys.stderr, flush=True)
    raise SystemExit("bench/hf_throughput.py: an arm failed twice (above)")


def run_baseline(mode: str, model: Path, rows: Path, tok: Path, batch: int, n: int, cap: int, gpu: bool) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           str(HERE / "_hf_baseline.py"), mode, str(model), str(rows), str(tok), str(batch), str(cap)]
    env = _env() | ({"HF_BASELINE_GPU": "1"} if gpu else {})
    out = _run(cmd, env)
    got = next(json.loads(x) for x in out.splitlines() if x.startswith('{"mode"'))
    return _on_device({"wall": got["step_seconds"],
                       "compute": [list(s) for s in zip(*got["compute_seconds"], strict=True)]}, gpu)


def predicted_compute(model: Path, rows: Path, batch: int, n: int, planner: str, cap: int,
                      cp: int = 1) -> list[list[float]]:
    """The simulator's compute seconds per step and rank for the plan ``longpack train`` makes of these rows on
    ``n`` ranks."""
    from longpack import jobs
    from longpack.runtime.run.run_plan import build_plan
    from longpack.runtime.run.train_args import TrainArgs
    from longpack.sim.simulate import simulate

    args = TrainArgs.of(planner=planner, data=str(rows), model_path=str(model),
                     run=jobs.RunSpec(workload="tiny-longtail", model="tiny-llama", hardware="cpu", token_cap=cap,
                                      global_batch=batch, cp=cp))
    plan, cost = build_plan(args, n, note=None)
    return [list(s.compute_s) for s in simulate(plan, cost, bounds=False).steps]


def idle_share(compute: list[list[float]]) -> float:
    """1 - sum of steps' mean rank compute / sum of steps' slowest rank compute."""
    worst = sum(max(s) for s in compute)
    return 1 - sum(sum(s) / len(s) for s in compute) / worst if worst else 0.0


def per_step(arms: dict, names: list[str]) -> str:
    """Each step's idle share, measured beside predicted, for the arms ``names``."""
    n = max(len(arms[a][0]["compute"]) for a in names)
    head = "| step | " + " | ".join(f"{a}: measured | predicted" for a in names) + " |"
    rows = [head, "|---|" + "---|---|" * len(names)]
    for i in range(n):
        cells = []
        for a in names:
            got, pred = arms[a]
            cells += [f"{idle_share(got['compute'][i:i + 1]):.1%}" if i < len(got["compute"]) else "-",
                      f"{idle_share(pred[i:i + 1]):.1%}" if pred is not None and i < len(pred) else "-"]
        rows.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def pair(args: argparse.Namespace) -> None:
    """`longpack train --nproc 2` and LongpackTrainer, unified, the same rows and plan, interleaved rounds."""
    import statistics

    import torch

    root = Path(tempfile.mkdtemp(prefix="hf_throughput_pair_"))
    model, rows, tok, tokens = prepare(root, args.rows)
    got: dict[str, list[tuple[float, float]]] = {"longpack train --nproc 2": [], "LongpackTrainer": []}
    for r in range(args.pair):
        for name in got:
            run = (run_longpack(model, rows, args.global_batch, 2, "unified", args.cap, False) if name[0] == "l"
                   else run_baseline("longpack", model, rows, tok, args.global_batch, 2, args.cap, False))
            got[name].append((tokens / sum(run["wall"]), tokens / sum(max(s) for s in run["compute"])))
            print(f"round {r}: {name:26s} {got[name][-1][0]:.0f} tokens/s, critical path {got[name][-1][1]:.0f}",
                  flush=True)
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in got.items()}
    (lw, lc), (tw, tc) = med["longpack train --nproc 2"], med["LongpackTrainer"]
    ratios = [a / b for (a, _), (b, _) in zip(got["longpack train --nproc 2"], got["LongpackTrainer"], strict=True)]
    body = ("| run | tokens/s (median) | critical-path tokens/s (median) | rounds (tokens/s) |\n|---|---|---|---|\n"
            + "\n".join(f"| {k} | {med[k][0]:.0f} | {med[k][1]:.0f} | {', '.join(f'{a:.0f}' for a, _ in v)} |"
                        for k, v in got.items())
            + f"\n\nlongpack train / LongpackTrainer: {lw / tw:.3f}x tokens/s (per round {min(ratios):.2f}-"
            f"{max(ratios):.2f}x), {lc / tc:.3f}x critical path. "
            f"{args.rows} rows ({tokens} tokens), {args.global_batch} rows a step, unified plan, token cap {args.cap},"
            " 2 processes x 1 thread, AdamW (fused in both), constant LR, no clipping; `longpack train` with its "
            "defaults otherwise "
            f"(FSDP2, --shard auto); {args.pair} interleaved rounds; torch {torch.__version__}.")
    print(body)
    if args.write:
        write_section("hf_throughput_pair", "longpack train against LongpackTrainer (same rows, same plan)",
                      f"python bench/hf_throughput.py --pair {args.pair} --write", body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--cp", default="2,4", help="CP degrees of the unified arm (those dividing the rank count)")
    ap.add_argument("--cap", type=int, default=4096, help="longpack's token cap per micro-batch; TRL's pack length")
    ap.add_argument("--gpu", type=int, default=0, help="GPUs (processes): the GPU arms, bf16, Qwen2.5-0.5B shape")
    ap.add_argument("--repeat", type=int, default=1, help="(kept for bench/gpu.sh; one round)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="one GPU's dense bf16 peak (H100/H200: 989)")
    ap.add_argument("--pair", type=int, default=0, help="instead: `longpack train --nproc 2` against LongpackTrainer "
                    "on the same rows and plan, this many interleaved rounds (medians)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.pair:
        return pair(args)
    gpu = bool(args.gpu)
    counts = [args.gpu] if gpu else [int(x) for x in args.ranks.split(",")]
    root = Path(tempfile.mkdtemp(prefix="hf_throughput_"))
    model, rows, tok, tokens = prepare(root, args.rows, gpu=gpu)
    batch, cap = args.global_batch, args.cap
    blocks = []
    for n in counts:
        arms: dict[str, tuple[dict, float | None]] = {}
        runs = [("unified", c) for c in map(int, args.cp.split(",")) if c > 1 and n % c == 0]
        for planner, c in [(p, 1) for p in PLANNERS] + runs:
            name = f"longpack train, {planner}" + (f", --cp {c}" if c > 1 else "")
            arms[name] = (run_longpack(model, rows, batch, n, planner, cap, gpu, c),
                          None if gpu else predicted_compute(model, rows, batch, n, planner, cap, c))
            print(f"{n} ranks  {name:48s} done", flush=True)
        for name, mode in BASELINES.items():
            if gpu and mode in ("group", "trl"):
                continue
            arms[name] = (run_baseline(mode, model, rows, tok, batch, n, cap, gpu), None)
            print(f"{n} ranks  {name:48s} done", flush=True)
        print(json.dumps({"ranks": n, "tokens": tokens, "arms": arms}), flush=True)  # the raw figures
        best = max((a for a in arms if a in BASELINES and BASELINES[a] != "longpack"),
                   key=lambda a: tokens / sum(max(s) for s in arms[a][0]["compute"]))
        lines = [f"**{n} ranks** (strongest baseline by critical path: {best})", "",
                 "| arm | steps | tokens/s | critical-path tokens/s | critical path vs strongest baseline | idle "
                 "measured | idle predicted |", "|---|---|---|---|---|---|---|"]
        base = sum(max(s) for s in arms[best][0]["compute"])
        for name, (got, pred) in arms.items():
            crit = sum(max(s) for s in got["compute"])
            lines.append(f"| {name} | {len(got['wall'])} | {tokens / sum(got['wall']):.0f} | {tokens / crit:.0f} | "
                         f"{crit / base:.2f}x time | {idle_share(got['compute']):.1%} | "
                         f"{'-' if pred is None else f'{idle_share(pred):.1%}'} |")
        if not gpu:
            lines += ["", f"Idle share per step at {n} ranks, measured beside the simulator's:", "",
                      per_step(arms, [a for a in arms if a.startswith("longpack train, unified")
                                      or a == "longpack train, random_padded"])]
        blocks.append("\n".join(lines))
        print(blocks[-1], flush=True)
    import torch
    import transformers
    import trl

    setting = (f"Qwen2.5-0.5B shape (random init), bf16, {args.gpu} GPU(s) ({torch.cuda.get_device_name()}), "
               "lmsys-chat-1m lengths, kernel FlashAttention varlen (torch.nn.attention.varlen)" if gpu else
               "tiny Llama (4 layers, hidden 256, vocab 1024), float32, N processes x 1 thread (gloo) on this "
               "machine's cores, tiny-longtail lengths, kernel longpack's per-document causal SDPA in every arm")
    body = ("\n\n".join(blocks)
            + f"\n\n{args.rows} rows ({tokens} tokens, first third of each row masked), one epoch, {batch} rows a "
            f"step (TRL: packs of {cap} tokens, one per rank a step), longpack token cap {cap}; {setting}; AdamW, "
            "constant LR, no clipping in every arm; each arm under its own sampler. Critical path: the sum over "
            "steps of the slowest rank's thread CPU seconds; idle: the other ranks' shortfall against it. "
            f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}.")
    if args.write:
        name, title = (("hf_throughput_gpu", "longpack vs Trainer on GPUs (bf16)") if gpu else
                       ("hf_throughput", "longpack vs the strongest baselines, one kernel, per-rank compute "
                        "(real CPU runs)"))
        cmd = f"python bench/hf_throughput.py {'--gpu ' + str(args.gpu) if gpu else '--ranks ' + args.ranks} --write"
        write_section(name, title, cmd, body)


if __name__ == "__main__":
    main()
