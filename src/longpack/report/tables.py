"""Rich tables for the CLI: length statistics and planner comparisons (plain dicts in, terminal out)."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["METRICS", "stats_table", "compare_table", "skrull_tables", "chunkflow_tables", "hbp_tables"]


def _console() -> Console:
    # Off a terminal (a pipe, CI) rich assumes 80 columns; give it 120 unless COLUMNS says otherwise.
    c = Console()
    return c if c.is_terminal or os.environ.get("COLUMNS") else Console(width=120)


def _k(n: float) -> str:
    return f"{n / 1024:.1f}K" if n >= 1024 else f"{n:.0f}"


def stats_table(data: dict[str, Any], title: str, console: Console | None = None) -> None:
    console = console or _console()
    console.print(f"[bold]{title}[/]: {data['samples']:,} samples, {data['tokens']:,} tokens, "
                  f"mean {data['mean']:.0f}, min {data['min']}, max {_k(data['max'])}")
    q = Table("quantile", "tokens", title="quantiles")
    for name, v in data["quantiles"].items():
        q.add_row(name, _k(v))
    b = Table("length", "share", title="share of samples below")
    for name, v in data["share_below"].items():
        b.add_row(name, f"{100 * v:.2f}%")
    h = Table("from", "to", "count", "", title="histogram (log2 bins)")
    top = max(r["count"] for r in data["histogram"])
    for r in data["histogram"]:
        h.add_row(_k(r["from"]), _k(r["to"]), f"{r['count']:,}", "#" * max(1, round(30 * r["count"] / top)))
    console.print(q, b, h)


METRICS = ("efficiency = the step-time lower bound / the simulated step time (1.0: no schedule of these samples "
           "on this setup can be faster); DBR, ABR = data, attention balance ratio: Σ(max − load) / (replicas · max) "
           "of tokens, of attention pairs, per micro-batch slot across data-parallel replicas (0: balanced); PR = pad "
           "tokens / padded tokens; CR = share of tokens sharded over a CP group; Ave-T = mean real tokens per "
           "micro-batch; empty slots = micro-batch slots with no work")


def _setup_line(result: dict[str, Any]) -> str:
    s = result["setup"]
    cap = s.get("token_cap")
    steps = s.get("steps")
    epoch = s.get("epoch_steps")
    scope = ""
    if steps is not None and epoch is not None:
        scope = (f", {steps} of {epoch:,} steps of the epoch" + (" (--epoch for all)" if steps < epoch else "")
                 if steps != epoch else f", the whole epoch ({epoch:,} steps)")
    return (f"[bold]{s['workload']}[/] on {s['model']} / {s['hardware']}: dp {s['dp']} x cp {s['cp']} "
            f"(tp {s['tp']}, pp {s['pp']}), global batch {s['global_batch']}"
            + (f", token cap {cap}" if cap is not None else "") + f", seed {s['seed']}{scope}")


def compare_table(result: dict[str, Any], console: Console | None = None, all_columns: bool = False) -> None:
    """The comparison: by default the columns a choice rests on (planner, steps, the CP degrees its steps use,
    step s, speedup, efficiency, peak GiB, OOM steps); ``all_columns`` adds the balance metrics, bound and optimum
    gaps, empty slots and plan seconds. Planners that regroup the samples into a different number of optimizer
    steps than the baseline are a different training run and get a table of their own below."""
    console = console or _console()
    console.print(_setup_line(result))
    ov = result.get("samples", {})
    if ov:
        sched = ov.get("scheduled_samples")
        console.print(f"over-long ({ov.get('policy')}, limit {ov.get('limit')}): {ov.get('split', 0)} split, "
                      f"{ov.get('truncated', 0)} truncated, {ov.get('dropped', 0)} dropped"
                      + (f" of {sched:,} scheduled samples" if sched is not None else ""))
    base = result["baseline"]
    rows = result["planners"]
    base_steps = rows[base]["steps"] if base in rows else None
    mark = "" if result.get("baseline_oom_steps", 0) == 0 else " (OOM base)"
    same = {n: r for n, r in rows.items() if base_steps is None or r["steps"] == base_steps}
    other = {n: r for n, r in rows.items() if n not in same}
    console.print(_table(same, base, mark, all_columns))
    if other:
        console.print(_table(other, base, mark, all_columns,
                             title="planners that make their own optimizer steps (a different training run)"))
    if mark:
        b = rows[base]
        console.print(f"(OOM base): the baseline {base} runs out of memory on {b['oom_steps']} of {b['steps']} steps, "
                      "so its time is not one it could achieve; the speedups against it are marked")
    if len(rows) > 1:
        n_samples = ov.get("scheduled_samples")
        what = f"the same {n_samples:,} samples" if n_samples is not None else "the same samples"
        steps_note = ("the first table trains" if other else "all train") + \
            f" them in the same {base_steps} optimizer steps as {base}"
        if other:
            steps_note += "; the second in other step counts, so its loss curve differs"
        console.print(f"speedup = simulated time to train {what} relative to {base} (> 1: faster); {steps_note}")
    if all_columns:
        console.print(METRICS)
        ex = result.get("exact") or {}
        if ex.get("steps"):
            console.print(f"gap to optimum: over {ex['steps']} step(s) solved exactly (MILP, mean optimal step "
                          f"{ex['optimal_step_s']:.4f} s); scope: {ex['scope']}; a planner outside that scope "
                          "(mixed CP degrees, chains, more micro-batches) can beat it, shown as a negative gap")
        elif ex:
            console.print(f"gap to optimum: not computed ({ex['note']})")
    else:
        console.print("more columns (balance, bound gaps, plan seconds): --all-columns; everything: --json")


def _table(rows: dict[str, dict[str, Any]], base: str, mark: str, all_columns: bool, title: str | None = None
           ) -> Table:
    head = ["planner", "steps", "CP degrees", "step s", f"speedup vs {base}", "efficiency", "peak GiB", "OOM steps"]
    if all_columns:
        head += ["gap to bound", "gap to optimum", "DBR", "ABR", "PR", "CR", "Ave-T", "empty slots", "plan s"]
    t = Table(*head, title=title)
    for name, r in sorted(rows.items(), key=lambda kv: kv[1]["total_s"]):
        degrees = ",".join(str(d) for d in r.get("cp_degrees", []))
        cells = [name, str(r["steps"]), degrees, f"{r['step_time_s']:.4f}", f"{r['speedup']:.2f}x{mark}",
                 f"{r['efficiency']:.3f}", f"{r['peak_mem_gib']:.1f}", str(r["oom_steps"])]
        if all_columns:
            gap_opt = r.get("gap_to_optimum")
            plan_s = r.get("plan_seconds")
            cells += [f"{r['gap_to_bound']:+.1%}", "-" if gap_opt is None else f"{gap_opt:+.1%}",
                      f"{r['dbr']:.3f}", f"{r['abr']:.3f}", f"{r['pr']:.3f}", f"{r['cr']:.3f}", _k(r["ave_t"]),
                      f"{r.get('empty_slots', 0.0):.0%}", "-" if plan_s is None else f"{plan_s:.3f}"]
        t.add_row(*cells)
    return t


def _x(v: Any) -> str:
    return v if isinstance(v, str) else f"{v:.2f}x"


def skrull_tables(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    t = Table("model", "dataset", "layout", "vs fixed_cp (DeepSpeed)", "paper", "vs sorted", "paper",
              "vs fixed_cp packed", "unified vs skrull", title="Skrull speedups (Fig. 3)")
    for c in result["cells"]:
        t.add_row(c["model"], c["dataset"], f"DP{c['dp']}xCP{c['cp']} BS{c['batch_size']}",
                  _x(c["speedup_vs_fixed_cp"]), _x(c["paper_vs_fixed_cp"]), _x(c["speedup_vs_sorted"]),
                  _x(c["paper_vs_sorted"]), _x(c["speedup_vs_fixed_cp_packed"]), _x(c["unified_vs_skrull"]))
    t.add_row("average", "", "", _x(result["average_vs_fixed_cp"]), _x(result["paper_average_vs_fixed_cp"]),
              _x(result["average_vs_sorted"]), _x(result["paper_average_vs_sorted"]), "", "")
    console.print(t)
    t3 = Table("strategy", "ours", "paper", title="Table 3 (0.5B, ChatQA2, DP1xCP8, BS64)")
    for k, v in result["table3"]["ours"].items():
        t3.add_row(k, _x(v), _x(result["table3"]["paper"].get(k, "-")))
    console.print(t3)
    if "fig4a" in result:
        f = Table("sweep", "value", "speedup vs fixed_cp", title="Fig. 4a (0.5B, ChatQA2, DP1xCP8)")
        for bs, v in result["fig4a"]["batch_size"].items():
            f.add_row("BatchSize", str(bs), _x(v))
        for b, v in result["fig4a"]["token_cap"].items():
            f.add_row("token cap", _k(float(b)), _x(v))
        console.print(f)


def chunkflow_tables(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    toy = result["toy"]
    t = Table("schedule (lengths 4,2,1,1, PP 4)", "bubble ours", "paper", title="Pipeline toy (ChunkFlow Fig. 2)")
    for key, label in (("1f1b", "1F1B"), ("k2", "state-aware, ChunkSize 2, K=2"),
                       ("k1", "state-aware, ChunkSize 2, K=1"), ("chunk4_k1", "state-aware, ChunkSize 4, K=1")):
        t.add_row(label, f"{100 * toy[key]:.2f}%", f"{100 * toy['paper'][key]:.1f}%")
    t.add_row("state-aware, K=1, recompute after the gradient arrives", f"{100 * toy['k1_late_recompute']:.2f}%",
              f"{100 * toy['paper']['k1']:.1f}%")
    console.print(t, toy["note"])
    s = Table("context", "one_seq s/step", "chunkflow s/step", "speedup", "paper", "bubble one_seq/chunkflow",
              "unified s/step", "unified vs chunkflow",
              title="Qwen2.5-7B on lmsys-chat-1m vs one_seq (ChunkFlow's results)")
    for label, r in result["speedups"].items():
        s.add_row(label, f"{r['one_seq']['step_time_s']:.3f}", f"{r['chunkflow']['step_time_s']:.3f}",
                  _x(r["speedup_vs_one_seq"]), _x(r["paper"]),
                  f"{r['one_seq']['bubble_ratio']:.3f} / {r['chunkflow']['bubble_ratio']:.3f}",
                  f"{r['unified']['step_time_s']:.3f}", _x(r["unified_vs_chunkflow"]))
    console.print(s)
    w = Table("(ChunkSize, K)", "ours ms", "paper ms",
              title="256K sensitivity, ChunkSize x K = 32K (ChunkFlow's sweep)")
    for key, ms in result["sweep"]["ours_ms"].items():
        w.add_row(key, f"{ms:.0f}", str(result["sweep"]["paper_ms"].get(key, "-")))
    console.print(w)
    m = Table("context", "chunkflow GiB", "one_seq GiB", title="Peak memory vs context (" +
              result["memory"]["setup"] + ")")
    mem = result["memory"]["peak_mem_gib"]
    for ctx in mem["chunkflow"]:
        m.add_row(_k(float(ctx)), f"{mem['chunkflow'][ctx]:.1f}", f"{mem['one_seq'][ctx]:.1f}")
    console.print(m)


def hbp_tables(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    t = Table("configuration", "groups", "ABR", "CR", "DBR", "PR", "Ave-T", "speedup", "paper ABR / CR / speedup",
              title="HBP Table 6 (LLaMA3.1-8B, 32 H100, tulu3-longcite, 128K)")
    for name, r in result["table6"].items():
        p = result["paper"].get(name)
        paper = f"{p['abr']} / {p['cr']} / {p['speedup']}x" if p else "-"
        t.add_row(name, ", ".join(r["groups"] or []), f"{r['abr']:.4f}", f"{r['cr']:.3f}", f"{r['dbr']:.4f}",
                  f"{r['pr']:.3f}", _k(r["ave_t"]), _x(r["speedup"]), paper)
    console.print(t)
    u = result.get("unified")
    if u:
        console.print(f"unified, same samples in {u['steps']} steps: speedup {u['speedup']:.2f}x vs ISF, "
                      f"{u['vs_hbp']:.2f}x vs hierarchical+balance (ABR {u['abr']:.4f}, efficiency "
                      f"{u['efficiency']:.3f})")
    sel = result["selection"]
    console.print(f"auto-selected groups (cost model): {', '.join(sel['auto']['groups'])}")
    console.print(f"selected from the paper's Table 19 profiles: {', '.join(sel['from_table19']['groups'])}; "
                  f"paper (Table 11): {', '.join(sel['paper'])}")
    if result.get("table13"):
        p13 = result["table13"]["paper_speedup_vs_none"]
        t13 = Table("packer", "DBR", "ABR", "speedup vs none", "paper", title="Table 13 packers at 128K, SP 8")
        for name, r in result["table13"]["ours"].items():
            t13.add_row(name, f"{r['dbr']:.3f}", f"{r['abr']:.3f}", _x(r["speedup_vs_none"]), _x(p13.get(name, 1.0)))
        console.print(t13)


def verdict_table(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    t = Table("seed", "setup", "seed planner s", "unified s", "unified vs seed", "unified efficiency",
              title="unified on every seed's own setup (simulated)")
    for r in result["verdict"]:
        eff = r.get("unified_efficiency")
        t.add_row(r["seed"], r["setup"], f"{r['seed_s']:.3f}", f"{r['unified_s']:.3f}", _x(r["unified_vs_seed"]),
                  "-" if eff is None else f"{eff:.3f}")
    console.print(t)
    console.print(f"never slower than the seed: {result['unified_never_slower']}; faster somewhere: "
                  f"{result['unified_faster_somewhere']}")
