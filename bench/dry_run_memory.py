"""Memory at scale, dry-run: per-rank peaks of `longpack train --dry-run` beside the cost model's prediction.

    python bench/dry_run_memory.py [--configs 7b-32k,7b-64k,7b-128k,72b-32k] [--jobs 2] [--write]

Each configuration is the command a user would type for 8 (or 32) H100s — Qwen2.5 shapes from their presets, the
unified planner with the token cap the cost model derives from 80 GiB, bf16 — run with ``--dry-run``
(runtime/run/dry_run.py): one step on fake tensors, one process per group of ranks (``--jobs`` at once), no weights
read. The step's rows (``--lengths``, one global batch): 63 lengths drawn from the workload's published
distribution (longpack.workloads) and one sample of exactly the configuration's length, so that a 32K, 64K or 128K
sample is played (the published distributions rarely reach their cap in one batch). The table gives per rank the
counted peak (FSDPMemTracker), the prediction (static state + the largest micro-batch's activations, without the
fragmentation margin) and the peak's share of 80 GiB; and the static bytes per rank before (ZeRO-2 pricing of the
gather-once runtime: whole bf16 weights and fp32 gradients) and after (ZeRO-3) for 7B, 32B and 72B.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from _report import versions, write_section

CONFIGS = {  # name: (model, workload, world, CP degree, max_len, ranks played; None: all)
    "7b-32k": ("qwen2.5-7b", "lmsys-chat-1m", 8, 1, 32768, None),
    "7b-32k-long": ("qwen2.5-7b", "chatqa2-long-sft", 8, 1, 32768, None),
    "7b-64k": ("qwen2.5-7b", "chatqa2-long-sft", 8, 1, 65536, None),
    "7b-128k": ("qwen2.5-7b", "chatqa2-long-sft", 8, 1, 131072, None),
    # the first rank of each of the 4 CP groups (see the section's text below)
    "72b-32k": ("qwen2.5-72b", "chatqa2-long-sft", 32, 8, 32768, [0, 8, 16, 24]),
}
BATCH = 64


def lengths_file(name: str, folder: str) -> str:
    """The step's lengths (see the module docstring), one per line, in ``folder``."""
    from longpack.workloads import generate

    _, workload, _, _, max_len, _ = CONFIGS[name]
    drawn = [min(int(n), max_len) for n in generate(workload, BATCH - 1, seed=0)]
    path = os.path.join(folder, f"{name}.txt")
    with open(path, "w") as f:
        f.write("\n".join(map(str, [max_len, *drawn])) + "\n")
    return path


def command(name: str, ranks: list[int] | None, lengths: str = "LENGTHS.txt") -> list[str]:
    model, _, world, cp, max_len, _ = CONFIGS[name]
    cmd = ["train", "--model", model, "--lengths", lengths, "--global-batch", str(BATCH), "--max-len", str(max_len),
           "--nproc", str(world), *(["--cp", str(cp)] if cp > 1 else []), "--hardware", "h100", "--dtype",
           "bfloat16", "--planner", "unified", "--token-cap", "0", "--dry-run"]
    return cmd + (["--dry-run-ranks", ",".join(map(str, ranks))] if ranks else [])


def run(name: str, ranks: list[int], lengths: str) -> list[dict]:
    argv = [sys.executable, "-m", "longpack.cli", *command(name, ranks, lengths), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{name}: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["dry_run"]


def static_table() -> str:
    from longpack.cost import CostModel, TrainConfig
    from longpack.hardware import get_hardware
    from longpack.model import get_model

    g = 2**30
    lines = ["| model | ranks | before: gather once (bf16 weights + fp32 grads whole, AdamW sharded) | "
             "priced before (ZeRO-2) | after: ZeRO-3 per layer (runtime-priced, incl. gathered root/layer, "
             "head temporaries) |", "|---|---|---|---|---|"]
    for name, world in (("qwen2.5-7b", 8), ("qwen2.5-32b", 8), ("qwen2.5-72b", 32)):
        spec = get_model(name)
        before = CostModel(spec, get_hardware("h100"), TrainConfig(dp=world, zero_stage=2))
        after = CostModel(spec, get_hardware("h100"), TrainConfig(dp=world, zero_stage=3, runtime=True))
        p = before.stage_params
        held = (2 + 4) * p + 12 * p / world  # the old runtime: bf16 weights and fp32 grads whole, AdamW sharded
        lines.append(f"| {name} | {world} | {held / g:.1f} GiB | {before.static_bytes / g:.1f} GiB | "
                     f"{after.static_bytes / g:.1f} GiB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="7b-32k,7b-64k,7b-128k,72b-32k")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--rows", help="a file of table rows this script printed: write them (no dry runs)")
    args = ap.parse_args()
    g, rows = 2**30, []
    if args.rows:
        rows = [line.rstrip() for line in open(args.rows) if line.startswith("| ") and line.count("|") == 8]
    for name in [] if args.rows else args.configs.split(","):
        world, ranks = CONFIGS[name][2], CONFIGS[name][5]
        ranks = ranks or list(range(world))
        groups = [ranks[i::args.jobs] for i in range(args.jobs) if ranks[i::args.jobs]]
        t0 = time.time()
        with ThreadPoolExecutor(args.jobs) as pool, tempfile.TemporaryDirectory() as tmp:
            lengths = lengths_file(name, tmp)
            parts = pool.map(run, [name] * len(groups), groups, [lengths] * len(groups))
            recs = sorted((r for part in parts for r in part), key=lambda r: r["rank"])
        print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        for r in recs:
            ratio = r["predicted_bytes"] / r["peak_bytes"]
            rows.append(f"| {name} | {r['rank']} | {r['longest_sample']:,} | {r['peak_bytes'] / g:.1f} | "
                        f"{r['predicted_bytes'] / g:.1f} | {ratio:.3f} | {r['peak_bytes'] / r['capacity_bytes']:.0%} |")
            print(rows[-1], flush=True)
    body = (f"{versions()}. Per rank, step 0 (`longpack " + " ".join(command("7b-32k", None))
            + "` and its siblings: see the script's CONFIGS):\n\n| config | rank | its longest sample (tokens) | "
            "dry-run peak (GiB) | predicted (GiB) | predicted / peak | peak / 80 GiB |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(rows)
            + "\n\nEach configuration's step plays one sample of exactly its length (32K, 64K, 128K tokens) beside "
            "63 lengths drawn from the workload; a sample longer than the token cap runs as a chain of chunks (the "
            "longest-sample column names it whole). The planner sizes its token caps for 80 GiB less a tenth "
            "(HardwareSpec.for_runtime) with activations x 1.1 for fragmentation; the prediction is the simulator's "
            "peak without that margin. Qwen2.5-72B runs 4 CP groups of 8 (`--cp 8`); one rank of each group is "
            "played (0, 8, 16, 24), the first of the group; its other ranks hold the same sharded pieces' equal "
            "zigzag shares and differ only in the local pieces placed on them, within the same token cap. The 28 "
            "others were not played: a 72B rank takes about 13 minutes of CPU here.\n\nStatic bytes per rank:\n\n"
            + static_table())
    print(static_table())
    if args.write:
        write_section("dry_run_memory", "Memory at scale (dry run)",
                      f"python bench/dry_run_memory.py --configs {args.configs} --write", body)


if __name__ == "__main__":
    main()
