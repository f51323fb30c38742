"""Every seed's reproduction with ``unified`` beside the seed's own planner, and one verdict table.

For each seed setup (Skrull: three datasets × two models; ChunkFlow: 7B at 32K and 256K; HBP: LLaMA3.1-8B on
tulu3-longcite at 128K) the verdict row holds the seed planner's and unified's simulated time on the same samples,
their ratio (> 1: unified faster) and unified's efficiency where the simulator reports it. The full seed results
stay under their own keys, exactly as ``longpack reproduce <seed> --json`` prints them.
"""

from __future__ import annotations

from typing import Any

from . import chunkflow, hbp, skrull

__all__ = ["reproduce", "SKRULL_STEPS", "CHUNKFLOW_STEPS"]

SKRULL_STEPS = 16  # the defaults of `reproduce skrull` and `reproduce chunkflow`
CHUNKFLOW_STEPS = 8


def reproduce(*, steps: int | None = None, samples: int = 50_000, hbp_samples: int = 200_000, seed: int = 0
              ) -> dict[str, Any]:
    """``steps`` None: each seed's own default, so a cell here is the same figure as in ``reproduce <seed>``."""
    s = skrull.reproduce(steps=steps or SKRULL_STEPS, samples=samples, seed=seed, sweeps=False)
    c = chunkflow.reproduce(steps=steps or CHUNKFLOW_STEPS, samples=samples, seed=seed)
    h = hbp.reproduce(samples=hbp_samples, seed=seed, packers=False)
    rows = []
    for cell in s["cells"]:
        t = cell["step_time_s"]
        rows.append({"seed": "skrull", "setup": f"{cell['model']} {cell['dataset']} DP{cell['dp']}xCP{cell['cp']}",
                     "seed_planner": "skrull", "seed_s": t["skrull"], "unified_s": t["unified"],
                     "unified_vs_seed": t["skrull"] / t["unified"], "unified_efficiency": cell["unified_efficiency"]})
    for label, r in c["speedups"].items():
        rows.append({"seed": "chunkflow", "setup": f"qwen2.5-7b lmsys-chat-1m {label}", "seed_planner": "chunkflow",
                     "seed_s": r["chunkflow"]["step_time_s"], "unified_s": r["unified"]["step_time_s"],
                     "unified_vs_seed": r["unified_vs_chunkflow"], "unified_oom_steps": r["unified"]["oom_steps"]})
    hb = h["table6"]["hierarchical+balance"]
    rows.append({"seed": "hbp", "setup": "llama3.1-8b tulu3-longcite 128K DP4xCP8 (total seconds)",
                 "seed_planner": "hbp", "seed_s": hb["total_s"], "unified_s": h["unified"]["total_s"],
                 "unified_vs_seed": h["unified"]["vs_hbp"], "unified_efficiency": h["unified"]["efficiency"]})
    ratios = [r["unified_vs_seed"] for r in rows]
    return {"verdict": rows, "unified_never_slower": all(x >= 1 - 1e-9 for x in ratios),
            "unified_faster_somewhere": any(x > 1 + 1e-9 for x in ratios),
            "skrull": s, "chunkflow": c, "hbp": h}
