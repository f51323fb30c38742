"""A seeded sweep of the planners over random small workloads and layouts, through the CLI's job
(jobs.run_plan) and each planner's Python API (Planner.plan): every call must return a plan that validates or raise
the project's refusal (a ValueError subclass with a message). Used by tests/test_planner_fuzz.py for a few seconds;
run alone for a longer sweep:

    python tests/fuzz_planners.py --seconds 600
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections import Counter

import numpy as np

from longpack import jobs
from longpack.planners import PLANNERS, PlanContext, get_planner, global_batches

OVERLONG = ("split", "truncate", "drop", "error")


def one(rng: np.random.Generator) -> tuple[str, str]:
    """One random call; ("ok" | "refused", planner) or raises what it must not."""
    name = str(rng.choice(sorted(PLANNERS)))
    n = int(rng.integers(1, 14))
    kind = rng.random()
    if kind < 0.1:
        lengths = np.zeros(n, dtype=np.int64)  # all empty
    elif kind < 0.2:
        lengths = np.full(n, int(rng.choice([1, 4096, 10**5])))  # all alike
    else:
        lengths = rng.integers(0 if rng.random() < 0.1 else 1, int(rng.choice([64, 2048, 40000])), n)
    cp, dp = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 3]))
    spec = jobs.RunSpec(workload=None, lengths_file="fuzz", model="qwen2.5-0.5b", hardware="h100", dp=dp, cp=cp,
                        global_batch=int(rng.integers(1, 9)), steps=int(rng.integers(1, 4)),
                        token_cap=None if rng.random() < 0.3 else int(rng.choice([16, 256, 1024, 8192])),
                        max_len=None if rng.random() < 0.4 else int(rng.choice([8, 512, 1024, 8192])),
                        overlong=str(rng.choice(OVERLONG)), seed=int(rng.integers(0, 1000)))
    try:
        if rng.random() < 0.5:
            jobs.run_plan(name, lengths, spec, jobs.build_cost(spec), note=None)
        else:  # the Python API, as a user of the library calls it
            cost = jobs.build_cost(spec)
            batches = global_batches(len(lengths), spec.global_batch, seed=spec.seed, steps=spec.steps)
            plan = get_planner(name).plan(lengths, batches, PlanContext(cost=cost, seed=spec.seed),
                                          max_len=spec.max_len, overlong=spec.overlong)
            plan.validate()
    except ValueError as exc:
        assert str(exc), f"{name}: a refusal without a message"
        return "refused", name
    return "ok", name


def sweep(seconds: float, seed: int = 0) -> tuple[int, Counter, list[str]]:
    """Calls made, outcomes counted, and the tracebacks of every call that raised anything else."""
    rng = np.random.default_rng(seed)
    end = time.monotonic() + seconds
    calls, outcomes, bad = 0, Counter(), []
    while time.monotonic() < end:
        calls += 1
        try:
            outcomes[one(rng)[0]] += 1
        except Exception:  # noqa: BLE001  (what the sweep is looking for)
            outcomes["unexpected"] += 1
            bad.append(traceback.format_exc())
    return calls, outcomes, bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    n, counts, errors = sweep(a.seconds, a.seed)
    print(f"{n} calls in {a.seconds:.0f} s: {dict(counts)}")
    for e in errors[:5]:
        print(e)
