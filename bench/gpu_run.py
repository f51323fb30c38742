"""One GPU session in one process: longpack against Hugging Face at its best, inside a deadline.

    python bench/gpu_run.py OUT [--budget 540] [--dry-run] [--write]      (bench/gpu.sh calls it)

Imports, CUDA and the rows are made once; each model's random-init checkpoint is written once and every arm
starts from it. The arms (bench/_gpu_arms.py), headline first — for each model (a Qwen2.5-0.5B shape, then a
Qwen2.5-1.5B shape) and each row set (lmsys-chat-1m lengths, then a long-tailed set up to 32K tokens):
`longpack train` unified · Trainer + DataCollatorWithFlattening on the same varlen kernel · the same with Liger's
kernels · TRL SFTTrainer padding-free BFD · `longpack train` random_padded; last, if time is left and Liger's loss
ran in the headline arm, that arm with `--head-loss longpack` (first model and rows). Every arm's figures go to
OUT/arms.jsonl the moment it ends. Before each arm its expected seconds (its steps at the arm's expected rate,
plus its start-up) are checked against the deadline; an arm that would not fit is skipped and said. Then a
torch.profiler table of two longpack steps (device seconds by kind: matmul, attention, elementwise, loss,
communication, idle), then, if time is left, bf16 parity (bench/gpu_parity.py).

Model FLOPs of a step (MFU = them per second / the GPU's dense bf16 peak), recompute excluded:
3 x [tokens x (layers x linear_flops_per_token + head_flops_per_token) + pairs x layers x attn_flops_per_pair],
where pairs = Σ over documents of s(s+1)/2 (causal). `--dry-run` runs the same driver on the CPU with tiny
shapes and a few steps, and prints the schedule it would run against the budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
ARMS = ("longpack", "hf_flatten", "hf_liger", "trl_bfd", "longpack_padded")
OWN_LOSS = "longpack_own_loss"  # the headline arm with --head-loss longpack, last: where Liger's loss ran in it
# tokens per second each arm is expected to reach on an H100 at 0.5B (lmsys; from the first GPU run, scaled for
# the HF arms' unfused loss), used only to decide whether an arm fits in the time left
EXPECTED_RATE = {"longpack": 40_000, "hf_flatten": 25_000, "hf_liger": 35_000, "trl_bfd": 25_000,
                 "longpack_padded": 12_000, OWN_LOSS: 40_000}


def model_flops(spec, docs: list[int]) -> float:  # noqa: ANN001
    """The module docstring's FLOPs of one step whose documents have lengths ``docs``."""
    tokens = float(sum(docs))
    pairs = float(sum(s * (s + 1) / 2 for s in docs))
    return 3 * (tokens * (spec.layers * spec.linear_flops_per_token + spec.head_flops_per_token)
                + pairs * spec.layers * spec.attn_flops_per_pair)


def setups(dry: bool, models: list[str] | None = None) -> list[dict]:
    """(model, row set) pairs in the order they run, headline first; ``models``: those of these models only (the
    dry run's tiny model stands for each)."""
    if dry:
        return [{"model": "tiny-qwen", "rows": "lmsys-chat-1m", "steps": 3, "batch": 8, "cap": 2048, "max_len": 2048,
                 "ckpt_above": 1024},
                {"model": "tiny-qwen", "rows": "tiny-longtail", "steps": 3, "batch": 8, "cap": 2048, "max_len": 4096,
                 "ckpt_above": 1024}]
    known = ("qwen2.5-0.5b", "qwen2.5-1.5b")
    odd = [m for m in models or () if m not in known]
    if odd:
        raise SystemExit(f"bench/gpu_run.py: --models {','.join(odd)}: choose among {', '.join(known)}")
    out = []
    for model in [m for m in known if not models or m in models]:
        out.append({"model": model, "rows": "lmsys-chat-1m", "steps": 8, "batch": 64, "cap": 16384,
                    "max_len": 16384, "ckpt_above": 16384})
        out.append({"model": model, "rows": "chatqa2-long-sft", "steps": 6, "batch": 16, "cap": 16384,
                    "max_len": 32768, "ckpt_above": 8192})
    return out


def rows_for(setup: dict, folder: Path, vocab: int) -> tuple[Path, list[dict]]:
    """The setup's rows (lengths of the named workload, random ids, the first third of each row a masked
    prompt), written once as JSONL."""
    from longpack.workloads import generate

    path = folder / f"rows-{setup['rows']}-{setup['steps'] * setup['batch']}-{vocab}.jsonl"
    n = setup["steps"] * setup["batch"]
    lengths = np.minimum(generate(setup["rows"], n, seed=0), setup["max_len"])
    rng = np.random.default_rng(0)
    rows = []
    for s in lengths.tolist():
        ids = rng.integers(1, vocab, s).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (s // 3) + ids[s // 3:]})
    if not path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def checkpoint(name: str, folder: Path, dry: bool) -> Path:
    """A random-init checkpoint of the preset ``name``, written once (bf16 on a GPU)."""
    import torch

    from longpack.model import get_model
    from longpack.runtime.run.hf_model import build

    path = folder / f"ckpt-{name}"
    if not (path / "config.json").is_file():
        dev = torch.device("cpu" if dry else "cuda")
        model = build(get_model(name), 0, torch.float32 if dry else torch.bfloat16, dev)
        model.config.max_position_embeddings = 32768
        model.save_pretrained(path)
        del model
    return path


def expected_seconds(arm: str, setup: dict, tokens: int, dry: bool) -> float:
    if dry:
        return 20.0
    scale = 3.0 if "1.5b" in setup["model"] else 1.0
    return 25.0 + tokens * scale / EXPECTED_RATE[arm]


def summarise(arm: str, setup: dict, result: dict, spec, docs: list[int], peak: float | None  # noqa: ANN001
              ) -> dict:
    """The arm's figures over its steps after the warm-up (the first two; one of three or fewer). FLOPs: the
    timed tokens at the rows' FLOPs per token (every arm trains the same rows' real tokens)."""
    warm = 2 if len(result["steps"]) > 3 else 1
    timed = result["steps"][warm:]
    seconds = sum(s["seconds"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    rate = model_flops(spec, docs) / max(1, sum(docs)) * tokens / seconds if seconds else 0.0
    return {"arm": arm, "model": setup["model"], "rows": setup["rows"], "tokens_per_s": tokens / seconds if seconds
            else 0.0, "tflops": rate / 1e12, "mfu": rate / peak if peak else None, "peak_gib": result.get("peak_gib"),
            "predicted_gib": result.get("predicted_gib"), "final_loss": timed[-1]["loss"] if timed else None,
            "startup_s": result.get("startup_seconds"), "timed_steps": len(timed),
            **{k: result[k] for k in ("accum", "checkpointing", "head_loss") if k in result}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole script")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b",
                    help="the models to run, in order (both do not fit one 540 s budget: a second GPU session can "
                         "run --models qwen2.5-1.5b)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    from _gpu_arms import hf_arm, longpack_arm, register_kernel

    from longpack.model import get_model

    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        raise SystemExit("bench/gpu_run.py: no CUDA device; --dry-run runs the same driver on the CPU")
    name = torch.cuda.get_device_name() if gpu else "CPU (dry run)"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    env = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda}
    (args.out / "env.json").write_text(json.dumps(env))
    register_kernel()
    have = {"hf_liger": _imports("liger_kernel") and gpu, "trl_bfd": _imports("trl")}  # Liger: Triton on CUDA
    have[OWN_LOSS] = have["hf_liger"]  # else the headline arm ran longpack's own loss already
    chosen = setups(args.dry_run, args.models.split(","))
    schedule = [(s, a) for s in chosen for a in ARMS] + [(chosen[0], OWN_LOSS)]
    print(f"gpu_run: {name}; budget {args.budget:.0f} s; {len(schedule)} arms; "
          f"liger {'yes' if have['hf_liger'] else 'absent' if gpu else 'not on the CPU'}, "
          f"trl {'yes' if have['trl_bfd'] else 'absent'}", flush=True)
    _say_schedule(schedule, have, args.budget, args.dry_run)
    arms_file = args.out / "arms.jsonl"
    arms_file.write_text("")
    profiled = False
    for setup, arm in schedule:
        spec = get_model(setup["model"])
        ckpt = checkpoint(setup["model"], args.out, args.dry_run)
        rows_path, rows = rows_for(setup, args.out, spec.vocab)
        docs = [len(r["input_ids"]) for r in rows]
        need = expected_seconds(arm, setup, sum(len(r["input_ids"]) for r in rows), args.dry_run)
        left = deadline - time.perf_counter()
        line = {"arm": arm, "model": setup["model"], "rows": setup["rows"]}
        if arm in have and not have[arm]:
            line["skipped"] = ("trl is not installed" if arm == "trl_bfd" else "liger_kernel is not installed"
                               if gpu else "Liger's Triton kernels need a CUDA GPU")
            if arm == OWN_LOSS:
                line["skipped"] += ": the longpack arm ran longpack's own loss"
        elif need > left:
            line["skipped"] = f"expected {need:.0f} s, {left:.0f} s left"
        else:
            try:
                if arm.startswith("longpack"):
                    res = longpack_arm("random_padded" if arm == "longpack_padded" else "unified", ckpt, rows_path,
                                       setup["cap"], setup["steps"], setup["batch"], gpu, setup["max_len"],
                                       head_loss="longpack" if arm == OWN_LOSS else "auto")
                else:
                    res = hf_arm(arm, ckpt, rows, setup["cap"], setup["steps"], setup["batch"], gpu,
                                 setup["ckpt_above"])
                line = summarise(arm, setup, res, spec, docs, peak)
            except Exception as exc:  # noqa: BLE001  (the next arm runs; this one's error is kept)
                line["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                (args.out / f"{arm}-{setup['model']}-{setup['rows']}.err").write_text(traceback.format_exc())
        line["elapsed_s"] = round(time.perf_counter() - t0, 1)
        with arms_file.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        if arm == "longpack" and not profiled and "failed" not in line and "skipped" not in line:
            profiled = _profile(setup, ckpt, rows_path, gpu, args.out, deadline)
        _free()
    _parity(args, deadline, gpu)
    _calibrate(args, deadline, gpu)
    report = render(args.out, env)
    (args.out / "report.md").write_text(report)
    print(report)
    print(f"gpu_run: {time.perf_counter() - t0:.0f} s of a {args.budget:.0f} s budget", flush=True)
    if args.write and gpu:
        sys.path.insert(0, str(HERE))
        from _report import write_section

        write_section("gpu-vs-hf", "GPU: longpack against Hugging Face at its best",
                      "bench/gpu.sh (bench/gpu_run.py)", report)


def _say_schedule(schedule: list, have: dict, budget: float, dry: bool) -> None:
    """Each arm's expected seconds and where the budget ends, before anything runs."""
    from longpack.workloads import generate

    at = 0.0
    for setup, arm in schedule:
        if arm in have and not have[arm]:
            continue
        tokens = int(np.minimum(generate(setup["rows"], setup["steps"] * setup["batch"], seed=0),
                                setup["max_len"]).sum())
        at += expected_seconds(arm, setup, tokens, dry)
        mark = "" if at <= budget else "  (past the budget: skipped unless earlier arms are quicker)"
        print(f"  {setup['model']:13s} {setup['rows']:17s} {arm:16s} ~{at:5.0f} s{mark}", flush=True)
    print(f"  then the profile, parity and calibration in what is left of {budget:.0f} s", flush=True)


def _imports(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profile(setup: dict, ckpt: Path, rows_path: Path, gpu: bool, out: Path, deadline: float) -> bool:
    """Two longpack steps under torch.profiler, by kind of kernel, into OUT/profile.json."""
    from _gpu_arms import longpack_arm

    if deadline - time.perf_counter() < (30 if gpu else 20):
        return False
    try:
        longpack_arm("unified", ckpt, rows_path, setup["cap"], 2, setup["batch"], gpu, setup["max_len"],
                     profile=out / "profile.json")
        return True
    except Exception:  # noqa: BLE001
        (out / "profile.err").write_text(traceback.format_exc())
        return False


def _parity(args: argparse.Namespace, deadline: float, gpu: bool) -> None:
    left = int(deadline - time.perf_counter())
    if left < 90:
        (args.out / "parity.txt").write_text(f"skipped: {left} s left\n")
        return
    cmd = [sys.executable, str(HERE / "gpu_parity.py"), str(args.out / "parity")] + ([] if gpu else ["--dry-run"])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left - 10)
        (args.out / "parity.txt").write_text(proc.stdout + proc.stderr[-3000:])
    except subprocess.TimeoutExpired:
        (args.out / "parity.txt").write_text(f"cut at the deadline ({left - 10} s)\n")


def _calibrate(args: argparse.Namespace, deadline: float, gpu: bool) -> None:
    """`longpack calibrate` on this device, if at least two minutes are left."""
    left = int(deadline - time.perf_counter())
    if left < 120:
        (args.out / "calibrate.txt").write_text(f"skipped: {left} s left\n")
        return
    model, grid, dtype = ("qwen2.5-0.5b", "gpu", "bfloat16") if gpu else ("tiny-llama", "cpu", "float32")
    cmd = [sys.executable, "-m", "longpack.cli", "calibrate", "--model", model, "--base", "h100" if gpu else "cpu",
           "--dtype", dtype, "--grid", grid, "--repeats", "3", "--out", str(args.out / "calibrated.json"), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left - 10)
        (args.out / "calibrate.txt").write_text(proc.stdout + proc.stderr[-3000:])
    except subprocess.TimeoutExpired:
        (args.out / "calibrate.txt").write_text(f"cut at the deadline ({left - 10} s)\n")


def render(out: Path, env: dict) -> str:
    """The arms' table and the profile's, as markdown."""
    lines = [f"Device: {env['device']}, torch {env['torch']}, CUDA {env['cuda']}.", "",
             "| model | rows | arm | tokens/s | TFLOP/s | MFU | peak GiB (predicted) | final loss | start-up s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in (json.loads(t) for t in (out / "arms.jsonl").read_text().splitlines()):
        if "skipped" in x or "failed" in x:
            lines.append(f"| {x['model']} | {x['rows']} | {x['arm']} | {x.get('skipped') or x.get('failed')} "
                         "| | | | | |")
            continue
        mfu = f"{100 * x['mfu']:.1f}%" if x.get("mfu") else "—"
        pred = f" ({x['predicted_gib']:.1f})" if x.get("predicted_gib") else ""
        peak = f"{x['peak_gib']:.1f}{pred}" if x.get("peak_gib") is not None else "—"
        loss = f"{x['final_loss']:.4f}" if x.get("final_loss") is not None else "—"
        arm = x["arm"] + (f" ({x['head_loss'].split()[0]} loss)" if "head_loss" in x else "")
        lines.append(f"| {x['model']} | {x['rows']} | {arm} | {x['tokens_per_s']:,.0f} | {x['tflops']:.1f} | "
                     f"{mfu} | {peak} | {loss} | {x['startup_s']:.1f} |")
    prof = out / "profile.json"
    if prof.exists():
        p = json.loads(prof.read_text())
        wall = p.pop("wall") or 1.0
        lines += ["", "Two longpack steps under torch.profiler (device seconds by kind, share of the steps' wall):",
                  "", "| kind | seconds | share |", "|---|---|---|"]
        lines += [f"| {k} | {v:.3f} | {100 * v / wall:.0f}% |" for k, v in p.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
