"""Reading data at scale: chat rows to the first training step, against Hugging Face's `load_dataset + map`.

    python bench/data_scale.py [--rows 200000] [--big-rows 1000000] [--write]

Data: ``--rows`` generated conversations (bench/chat_data.py: 1-4 exchanges, 1% of rows 8K-32K tokens, a
byte-level BPE with a ChatML ``{% generation %}`` template) and a random-init tiny Llama (hidden 64, 2 layers,
the tokenizer's vocabulary). Arms, one after another on this machine:

* HF — ``datasets.load_dataset("json") + .map(apply_chat_template(..., return_assistant_tokens_mask=True))``
  with ``num_proc`` 1 and 2 into a fresh cache, then again on that cache (bench/_hf_map.py);
* longpack — ``longpack train --data chats.jsonl --tokenizer tok --model-path model --nproc 2 --steps 1
  --global-batch 64 --max-len 32768`` into a fresh ``--cache-dir`` (first start: the rows are checked and
  tokenized on every core), then the same command again (second start: the store is mapped from the cache).
  Seconds from the command's start to its data line and to its step-0 line (the step's own seconds given);
* memory — the same rows pre-tokenized (``input_ids`` + ``labels``) as JSONL, as Parquet (row groups of 10,000)
  and as a ``datasets.save_to_disk`` folder, each trained by the same command into a fresh cache: the peak
  resident set of each process (launcher, tokenizing workers, ranks) and the peak of the processes' summed
  proportional set size (shared pages split between the processes that map them), sampled every 50 ms;
* scale — ``--big-rows`` conversations through the same first start (time and memory beside ``--rows``').
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _procmem import pss as _pss
from _report import versions, write_section

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("LONGPACK_BENCH_DATA", "/tmp/longpack-data"))


def data(rows: int) -> Path:
    out = ROOT / f"chats-{rows}"
    if not (out / "chats.jsonl").is_file():
        subprocess.run([sys.executable, str(HERE / "chat_data.py"), "--rows", str(rows), "--out", str(out)],
                       check=True)
    return out


def model(folder: Path) -> Path:
    path = folder / "model"
    if not (path / "config.json").is_file():
        import torch
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class Sampler:
    """Every process under ``root`` (the command and its descendants): each one's peak resident set (VmHWM, read
    every 0.1 s) by role, and the peak of their summed proportional set size (every 0.5 s)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.peak: dict[int, int] = {}
        self.threads: dict[int, int] = {}
        self.pss_peak, self.stop = 0, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        tick = 0
        pids: list[int] = []
        while not self.stop:
            if tick % 5 == 0:  # the process tree and the summed PSS every 0.5 s (reading them costs a core's %)
                pids = self._tree()
                self.pss_peak = max(self.pss_peak, sum(_pss(pid) for pid in pids))
            for pid in pids:  # each process's own peak (VmHWM: the kernel keeps it between reads)
                st = _status(pid)
                if st:
                    self.peak[pid] = max(self.peak.get(pid, 0), st.get("VmHWM", 0))
                    self.threads[pid] = max(self.threads.get(pid, 0), st.get("Threads", 1))
            tick += 1
            time.sleep(0.1)

    def _role(self, pid: int) -> str:
        """The launcher; a rank (torch's and gloo's threads); or a tokenizing worker (one thread)."""
        if pid == self.root:
            return "launcher"
        return "rank" if self.threads.get(pid, 1) > 2 else "worker"

    def _tree(self) -> list[int]:
        kids: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.root]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += kids.get(p, [])
        return out

    def close(self) -> dict:
        self.stop = True
        self.thread.join()
        by: dict[str, int] = {}
        for pid, peak in self.peak.items():
            r = self._role(pid)
            by[r] = max(by.get(r, 0), peak)
        return {"peak_rss": by, "pss_peak": self.pss_peak}


def _status(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS"):
            out[k] = int(v.split()[0]) * 1024
        elif k == "Threads":
            out[k] = int(v)
    return out


def run_train(data_path: Path, tok: Path | None, mdl: Path, cache: Path) -> dict:
    """One ``longpack train`` start, timed line by line and sampled."""
    out = Path(tempfile.mkdtemp(prefix="lp-out-"))
    cmd = [sys.executable, "-m", "longpack.cli", "train", "--data", str(data_path), "--model-path", str(mdl),
           "--output-dir", str(out / "m"), "--nproc", "2", "--steps", "1", "--global-batch", "64", "--max-len",
           "32768", "--cache-dir", str(cache), "--json"] + (["--tokenizer", str(tok)] if tok else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    err_lines: list[str] = []
    errs = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    errs.start()
    marks: dict[str, float] = {}
    step: dict = {}
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith('{"data"'):
            marks["data_line"] = time.perf_counter() - t0
        elif line.startswith('{"step"'):
            marks["step0_line"] = time.perf_counter() - t0
            step = json.loads(line)
    proc.wait()
    errs.join()
    mem = sampler.close()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(err_lines)[-3000:]}")
    return {**marks, "step0_seconds": step.get("step_seconds"), **mem, "notes": [x.strip() for x in err_lines
                                                                                 if "tokenized" in x]}


def hf_map(path: Path, tok: Path, num_proc: int, cache: Path) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "_hf_map.py"), str(path), str(tok), str(num_proc), str(cache)],
                         capture_output=True, text=True, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def pretokenized(folder: Path, cache: Path) -> dict[str, Path]:
    """The rows of ``folder``'s chats (their store in ``cache``, built by the first start) as input_ids + labels:
    JSONL, Parquet and a save_to_disk folder."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from longpack.rows import load_rows

    paths = {"jsonl": folder / "pre.jsonl", "parquet": folder / "pre.parquet", "dataset": folder / "pre_ds"}
    if all(p.exists() for p in paths.values()):
        return paths
    rows = load_rows(folder / "chats.jsonl", tokenizer=str(folder / "tok"), cache_dir=str(cache))
    writer = None
    with open(paths["jsonl"], "w") as f:
        batch: dict[str, list] = {"input_ids": [], "labels": []}
        for i in range(len(rows.ids)):
            ids, tgt = rows.ids[i], rows.targets[i]
            labels = np.full(ids.size, -100, np.int64)
            labels[1:] = tgt[:-1]  # position t's target is labels[t + 1]
            f.write(json.dumps({"input_ids": ids.tolist(), "labels": labels.tolist()}) + "\n")
            batch["input_ids"].append(ids.astype(np.int32))
            batch["labels"].append(labels.astype(np.int32))
            if len(batch["input_ids"]) == 10_000 or i == len(rows.ids) - 1:
                table = pa.table({k: pa.array([a.tolist() for a in v], pa.list_(pa.int32())) for k, v in batch.items()})
                writer = writer or pq.ParquetWriter(paths["parquet"], table.schema)
                writer.write_table(table)
                batch = {"input_ids": [], "labels": []}
    writer.close()
    import datasets

    datasets.Dataset.from_parquet(str(paths["parquet"]), cache_dir=str(folder / "hf-cache")).save_to_disk(
        str(paths["dataset"]))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--big-rows", type=int, default=1_000_000, help="0: skip the scale arm")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-from", type=Path, help="a result.json of an earlier run: its HF arms, not run again")
    ap.add_argument("--write-from", type=Path, help="write the section from a result.json, running nothing")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.write_from:
        write(json.loads(args.write_from.read_text()), args)
        return
    folder = data(args.rows)
    mdl = model(folder)
    tmp = Path(tempfile.mkdtemp(prefix="lp-bench-"))
    res: dict = {"rows": args.rows, "jsonl_mb": (folder / "chats.jsonl").stat().st_size / 1e6}
    if args.hf_from:
        res.update({k: v for k, v in json.loads(args.hf_from.read_text()).items() if k.startswith("hf")})
        res["hf_from"] = str(args.hf_from)
    elif not args.skip_hf:
        for n in (1, 2):
            first = hf_map(folder / "chats.jsonl", folder / "tok", n, tmp / f"hf{n}")
            again = hf_map(folder / "chats.jsonl", folder / "tok", n, tmp / f"hf{n}")
            res[f"hf{n}"] = {"first": first, "again": again}
            print(f"HF num_proc {n}: {first}, again {again}", flush=True)
    res["first"] = run_train(folder / "chats.jsonl", folder / "tok", mdl, tmp / "store")
    print("longpack first start", res["first"], flush=True)
    res["second"] = run_train(folder / "chats.jsonl", folder / "tok", mdl, tmp / "store")
    print("longpack second start", res["second"], flush=True)
    res["formats"] = {}
    for fmt, path in pretokenized(folder, tmp / "store").items():
        res["formats"][fmt] = run_train(path, None, mdl, tmp / f"pre-{fmt}")
        print(fmt, res["formats"][fmt], flush=True)
    if args.big_rows:
        big = data(args.big_rows)
        res["big"] = {"rows": args.big_rows, "jsonl_mb": (big / "chats.jsonl").stat().st_size / 1e6,
                      **run_train(big / "chats.jsonl", big / "tok", model(big), tmp / "big")}
        print("big", res["big"], flush=True)
    (tmp / "result.json").write_text(json.dumps(res, indent=1))
    print(f"results in {tmp / 'result.json'}")
    if args.write:
        write(res, args)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def write(res: dict, args: argparse.Namespace) -> None:
    f, s = res["first"], res["second"]
    lines = [f"{res['rows']:,} generated conversations ({res['jsonl_mb']:.0f} MB of JSONL) on this 2-core machine; "
             f"{versions()}.", "",
             "| arm | data line (s) | step-0 line (s) | step 0 itself (s) | again, from the cache (s) |",
             "|---|---|---|---|---|"]
    for n in (1, 2):
        if f"hf{n}" in res:
            h = res[f"hf{n}"]
            lines.append(f"| HF `load_dataset` + `map`, num_proc {n} | {h['first']['total']:.1f} (map "
                         f"{h['first']['map']:.1f}) | — | — | {h['again']['total']:.1f} |")
    lines.append(f"| longpack train --nproc 2, first start | {f['data_line']:.1f} | {f['step0_line']:.1f} | "
                 f"{f['step0_seconds']:.1f} | — |")
    lines.append(f"| longpack train --nproc 2, second start | {s['data_line']:.1f} | {s['step0_line']:.1f} | "
                 f"{s['step0_seconds']:.1f} | (this row) |")
    if "hf1" in res:
        lines += ["", f"First start to the data line: {f['data_line'] / res['hf1']['first']['total']:.2f}x HF's "
                      f"single-process load + map ({f['data_line']:.0f} s against {res['hf1']['first']['total']:.0f}"
                      f" s); to the step-0 line {f['step0_line'] / res['hf1']['first']['total']:.2f}x."]
    lines += ["", "Memory while reading (peak resident set per process; summed proportional set size of all of them):",
              "", "| data | launcher | worker (tokenizing, or Arrow's reading process) | rank | summed PSS "
                  "| data line (s) |",
              "|---|---|---|---|---|---|"]
    for name, r in [("chats, JSONL (first start)", f), ("chats, JSONL (second start)", s)] + [
            (f"pre-tokenized, {k}", v) for k, v in res.get("formats", {}).items()]:
        p = r["peak_rss"]
        worker = f"{_gib(p['worker'])} GiB" if "worker" in p else "—"
        lines.append(f"| {name} | {_gib(p.get('launcher', 0))} GiB | {worker} | "
                     f"{_gib(p.get('rank', 0))} GiB | {_gib(r['pss_peak'])} GiB | {r['data_line']:.1f} |")
    if "formats" in res and {"jsonl", "parquet"} <= res["formats"].keys():
        fj, fp = res["formats"]["jsonl"], res["formats"]["parquet"]
        lines += ["", f"Parquet against JSONL, summed PSS: {fp['pss_peak'] / fj['pss_peak']:.2f}x; launcher peak "
                      f"{fp['peak_rss']['launcher'] / fj['peak_rss']['launcher']:.2f}x."]
    if "big" in res:
        b = res["big"]
        k = b["rows"] / res["rows"]
        lines += ["", f"Scale: {b['rows']:,} conversations ({b['jsonl_mb']:.0f} MB): first start to the data line "
                      f"{b['data_line']:.0f} s ({b['data_line'] / f['data_line']:.2f}x the {res['rows']:,} rows' "
                      f"time for {k:.0f}x the rows); launcher peak {_gib(b['peak_rss'].get('launcher', 0))} GiB, "
                      f"worker {_gib(b['peak_rss'].get('worker', 0))} GiB, rank {_gib(b['peak_rss'].get('rank', 0))}"
                      f" GiB, summed PSS {_gib(b['pss_peak'])} GiB."]
    if res.get("hf_from"):
        lines += ["", "The HF rows come from an earlier run of this benchmark on this machine with the same rows and "
                      "tokenizer (`--hf-from`), not from this run."]
    cmd = (f"python bench/data_scale.py --rows {args.rows} --big-rows {args.big_rows}"
           + (" --hf-from RESULT.json" if res.get("hf_from") else "") + " --write")
    write_section("data-scale", "Reading data at scale", cmd, "\n".join(lines))


if __name__ == "__main__":
    main()
