"""What a run trains of its data, and what it does not: every empty, dropped or truncated row counted.

:func:`data_report` reads the plan (samples the over-long policy dropped or cut) and the source (rows the reader
kept out of the plan because they were empty; targets per sample) and returns counts of samples, tokens and
targets, and of samples the over-long policy splits into chunk chains, plus one line for a person. It needs only
the plan's header, so it is said before the first step is planned. :func:`chained_samples` counts, per step, the
samples it runs as chains (the policy's splits and the planner's own, such as ChunkFlow's chunks). Nothing the
plan leaves out goes unreported.
"""

from __future__ import annotations

from typing import Any

from ...plan import Plan
from ..kernel.data import Source

__all__ = ["data_report", "chained_samples", "step_samples"]


def data_report(plan: Plan, source: Source) -> dict[str, Any]:
    """Counts of what the plan trains and leaves out of its samples (see the module docstring)."""
    samples = list(plan.lengths)
    dropped = [s for s in samples if s in plan.dropped]
    cut = {s: plan.truncated[s] for s in samples if s in plan.truncated}
    full_targets = {s: source.target_count(s, plan.lengths[s]) for s in samples}
    kept_targets = sum(source.target_count(s, plan.effective_length(s)) for s in samples)
    rows: dict[str, Any] = source.describe() if hasattr(source, "describe") else {"source": "synthetic"}
    out: dict[str, Any] = {"samples": len(samples), "tokens": sum(plan.lengths.values()),
           "trained_tokens": sum(plan.effective_length(s) for s in samples), "targets": sum(full_targets.values()),
           "trained_targets": kept_targets,
           "dropped_samples": len(dropped), "dropped_tokens": sum(plan.lengths[s] for s in dropped),
           "dropped_targets": sum(full_targets[s] for s in dropped),
           "truncated_samples": len(cut), "truncated_tokens": sum(plan.lengths[s] - k for s, k in cut.items()),
           "truncated_targets": sum(full_targets[s] - source.target_count(s, k) for s, k in cut.items()),
           "split_samples": int(plan.meta.get("overlong", {}).get("split", 0)),
           "empty_rows_dropped": int(rows.get("empty_dropped", 0)),
           "untargeted_rows_dropped": int(rows.get("untargeted_dropped", 0)), "rows": rows}
    reasons = sorted({plan.dropped[s] for s in dropped})
    head = f"{out['samples']} samples"
    if "rows" in rows:  # the user's rows: how many were read, and how many samples this run's steps take of them
        head = f"{rows['rows']:,} rows read, {out['samples']:,} samples in this run"
    line = (f"{head}, {out['trained_tokens']:,} of {out['tokens']:,} tokens and "
            f"{out['trained_targets']:,} of {out['targets']:,} targets trained; {out['dropped_samples']} dropped "
            f"({out['dropped_tokens']:,} tokens), {out['truncated_samples']} truncated ({out['truncated_tokens']:,} "
            f"tokens cut), {out['split_samples']} longer than {plan.meta.get('overlong', {}).get('limit', 0):,} tokens "
            "split into chunks")
    if out["empty_rows_dropped"]:
        at = ", ".join(rows["empty_at"]) + (", ..." if out["empty_rows_dropped"] > len(rows["empty_at"]) else "")
        line += f"; {out['empty_rows_dropped']} empty rows left out of the plan ({at})"
    untargeted = int(rows.get("rows_without_target", 0))
    if untargeted:
        at = ", ".join(rows["untargeted_at"]) + (", ..." if untargeted > len(rows["untargeted_at"]) else "")
        why = " (no assistant turn)" if "assistant" in str(rows.get("targets_from")) else ""
        fate = "left out" if rows.get("untargeted_dropped") else "kept (--keep-untargeted)"
        line += f"; {untargeted} rows have no target{why}: {at} — {fate}"
    if reasons:
        line += f"; why dropped: {'; '.join(reasons[:3])}"
    out["line"] = line
    return out


def step_samples(plan: Plan, step: int) -> list[int]:
    """The sample ids ``step`` of ``plan`` trains, ascending (a sample id of epoch e is e * rows + its row): the
    run's JSON records count with them that every sample is trained once per epoch, across resumes too."""
    return sorted({p.sample for rep in plan.steps[step].replicas for mb in rep.micro_batches for p in mb.pieces})


def chained_samples(plan: Plan, step: int) -> set[int]:
    """Samples that ``step`` of ``plan`` runs as chunk chains."""
    return {p.sample for rep in plan.steps[step].replicas for mb in rep.micro_batches for p in mb.pieces
            if plan.is_chunk(p)}

