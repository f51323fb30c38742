"""``longpack report``: one self-contained HTML page showing where the time of a plan goes.

For a setup (workload, model, hardware, layout) and a set of planners on the same global batches: the comparison
table, and for one step of each planner four pictures (matplotlib, embedded as PNG data URIs, so the page is a
single file with no network): per-rank load bars (compute / exposed communication / idle), a Gantt chart of the step
(per rank and micro-batch: local compute, the communication hidden behind it, sharded compute, idle), memory per
rank against the device's capacity, and the workload's length histogram with the packing lengths marked.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .. import jobs  # noqa: E402
from ..cost import CostModel  # noqa: E402
from ..plan import Plan  # noqa: E402
from ..sim.simulate import StepReport, micro_batch_times  # noqa: E402

__all__ = ["build_report"]


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def load_bars(plan: Plan, s: StepReport) -> str:
    step = s.step
    compute = np.array(s.compute_s)
    exposed = np.array(s.comm_s) - np.array(s.overlap_s)
    idle = np.array(s.idle_s)
    ranks = np.arange(len(compute))
    fig, ax = plt.subplots(figsize=(max(5, len(ranks) * 0.25), 2.6))
    ax.bar(ranks, compute, label="compute", color="#4c72b0")
    ax.bar(ranks, exposed, bottom=compute, label="exposed comm", color="#dd8452")
    ax.bar(ranks, idle, bottom=compute + exposed, label="idle", color="#cccccc")
    ax.set_xlabel("rank")
    ax.set_ylabel("seconds")
    ax.set_title(f"{plan.planner}: step {step} per rank")
    ax.legend(fontsize=7, loc="upper right")
    return _png(fig)


def gantt(plan: Plan, cost: CostModel, step: int, max_ranks: int = 64) -> tuple[str, str]:
    """(PNG, caption) of one step's Gantt chart: a row per rank, a bar per micro-batch. Every rank is drawn up to
    ``max_ranks``; beyond that the replicas that finish last are drawn (whole CP groups) and the caption names the
    ranks shown, so the slowest ranks are never the ones hidden."""
    st = plan.steps[step]
    spans = st.spans()  # (first rank, degree) of each replica's group
    world = sum(d for _, d in spans)
    bars = []  # per replica: (first rank, cp, finish time, [(rank offset, start, local, hidden, exposed, dist)])
    for rep, (first, cp) in zip(st.replicas, spans, strict=True):
        at = cost.at_cp(cp)  # the exchange spans this group
        t0 = np.zeros(cp)
        segs = []
        for mb in rep.micro_batches:
            if not mb.pieces:
                continue
            time, local, dist, comm, *_ = micro_batch_times(mb, cp, at)
            span = float(time.max())
            for j in range(cp):
                lo, cm = float(local[j]), float(comm[j])
                segs.append((j, float(t0[j]), lo, min(cm, lo), max(0.0, cm - lo), float(dist[j]), max(cm, lo)))
                t0[j] += span
        bars.append((first, cp, float(t0.max()) if cp else 0.0, segs))
    chosen = bars
    if world > max_ranks:
        chosen, rows = [], 0
        for b in sorted(bars, key=lambda b: -b[2]):
            if rows + b[1] > max_ranks and chosen:
                continue
            chosen.append(b)
            rows += b[1]
        chosen.sort(key=lambda b: b[0])
    shown = sum(b[1] for b in chosen)
    fig, ax = plt.subplots(figsize=(8, 0.22 * shown + 1))
    labels, row = [], 0
    for first, cp, _, segs in chosen:
        for j, start, lo, hidden, exposed, sharded, busy in segs:
            y = row + j
            ax.barh(y, lo, left=start, color="#4c72b0", height=0.8)
            ax.barh(y, hidden, left=start, color="#55a868", height=0.3)
            ax.barh(y, exposed, left=start + lo, color="#dd8452", height=0.8)
            ax.barh(y, sharded, left=start + busy, color="#8172b3", height=0.8)
        labels += [str(first + j) for j in range(cp)]
        row += cp
    slowest = max((b[2] for b in bars), default=0.0)
    allreduce = cost.grad_allreduce_s() if slowest > 0 else 0.0
    ax.barh(range(shown), [allreduce] * shown, left=slowest, color="#999999", height=0.8)  # after the slowest
    ax.set_yticks(range(shown), labels, fontsize=6 if shown > 32 else 8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_ylabel("rank")
    ax.set_title(f"{plan.planner}: step {step} — local (blue), comm hidden (green) / exposed (orange), sharded "
                 "(purple), gradient reduction (grey)", fontsize=8)
    if shown == world:
        caption = f"all {world} ranks"
    else:
        caption = (f"the {shown} ranks of the replicas that finish last, of {world}: "
                   + ", ".join(f"{f}-{f + c - 1}" if c > 1 else str(f) for f, c, _, _ in chosen))
    return _png(fig), caption


def memory_bars(plan: Plan, cost: CostModel, s: StepReport) -> str:
    step = s.step
    mem = np.array(s.peak_mem_bytes) / 2**30
    fig, ax = plt.subplots(figsize=(max(5, len(mem) * 0.25), 2.4))
    ax.bar(np.arange(len(mem)), mem, color="#4c72b0")
    ax.axhline(cost.hw.memory_gib, color="red", linestyle="--", label=f"{cost.hw.name} memory")
    ax.set_xlabel("rank")
    ax.set_ylabel("GiB")
    ax.set_title(f"{plan.planner}: peak memory per rank, step {step}")
    ax.legend(fontsize=7)
    return _png(fig)


def length_histogram(lengths: np.ndarray, marks: dict[str, int]) -> str:
    fig, ax = plt.subplots(figsize=(7, 2.6))
    bins = np.logspace(0, np.log10(max(2, lengths.max()) + 1), 60).tolist()
    ax.hist(lengths, bins=bins, color="#4c72b0")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for label, x in marks.items():
        ax.axvline(x, color="red", linestyle="--")
        ax.text(x, ax.get_ylim()[1] * 0.5, f" {label}", color="red", fontsize=7, rotation=90, va="top")
    ax.set_xlabel("tokens")
    ax.set_ylabel("samples")
    ax.set_title("sequence lengths")
    return _png(fig)


def build_report(spec: jobs.RunSpec, planners: list[str], baseline: str) -> str:
    """The HTML page for ``spec`` (see the module docstring)."""
    comparison = jobs.compare_plans(spec, planners, baseline)
    result, plans, lengths, cost = comparison.result, comparison.plans, comparison.lengths, comparison.cost
    cap = cost.token_cap()
    marks = {f"token cap x cp = {cap * spec.cp}": cap * spec.cp}
    sections = []
    for name, (plan, report) in plans.items():
        slowest = max(report.steps, key=lambda s: s.time_s)  # every picture shows the slowest simulated step
        step = slowest.step
        if plan.meta.get("hbp"):
            for tag in plan.meta["hbp"].get("groups", []):
                marks[f"hbp {tag}"] = int(tag.split("/")[0].rstrip("K")) * (1024 if "K/" in tag else 1)
        chart, caption = gantt(plan, cost, step)
        images = [load_bars(plan, slowest), chart, memory_bars(plan, cost, slowest)]
        sections.append(f"<h2>{html.escape(name)}</h2><p>slowest simulated step: {step} ({slowest.time_s:.4f} s); "
                        f"Gantt chart: {html.escape(caption)}</p>"
                        + "".join(f'<img src="{src}" alt="{html.escape(name)}">' for src in images))
    hist = length_histogram(np.asarray(lengths), marks)
    return _page(result, hist, sections)


def _page(result: dict[str, Any], hist: str, sections: list[str]) -> str:
    setup = result["setup"]
    head = ("<tr>" + "".join(f"<th>{h}</th>" for h in ("planner", "steps", "step s",
                                                        f"speedup vs {result['baseline']}", "efficiency", "DBR",
                                                        "ABR", "PR", "CR", "peak GiB", "OOM"))
            + "</tr>")
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{r['steps']}</td><td>{r['step_time_s']:.4f}</td><td>{r['speedup']:.2f}x</td>"
        f"<td>{r['efficiency']:.3f}</td><td>{r['dbr']:.3f}</td><td>{r['abr']:.3f}</td><td>{r['pr']:.3f}</td>"
        f"<td>{r['cr']:.3f}</td><td>{r['peak_mem_gib']:.1f}</td><td>{r['oom_steps']}</td></tr>"
        for n, r in sorted(result["planners"].items(), key=lambda kv: kv[1]["step_time_s"]))
    title = (f"longpack report: {setup['workload']} on {setup['model']} / {setup['hardware']}, "
             f"DP{setup['dp']} x CP{setup['cp']}")
    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{display:block;margin:8px 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>global batch {setup['global_batch']}, token cap {setup['token_cap']} per rank, "
            f"{setup['steps']} steps, seed {setup['seed']}</p><table>{head}{rows}</table>"
            "<p>speedup = simulated time to train the same samples relative to the baseline; a planner whose steps "
            "column differs regroups them into other optimizer steps (a different training run)</p>"
            f"<h2>Sequence lengths</h2><img src='{hist}' alt='length histogram'>" + "".join(sections)
            + "</body></html>")
