"""Host memory at start-up: 4 ranks starting a ~0.5B checkpoint under FSDP2, sharded start-up against loading it
whole on every rank.

    python bench/startup_memory.py [--ranks 4] [--write]

A Qwen2.5-0.5B-shaped checkpoint (random weights, bf16 safetensors, written once to /tmp) is started by ``--ranks``
gloo processes as `longpack train` starts it with FSDP2:

* sharded — the model built on ``meta``, sharded, each rank reading its rows of every weight from the
  safetensors (runtime/run/shard_load.py);
* whole — ``from_pretrained`` in fp32 on every rank, then sharded (the start-up before sharded loading).

Per rank, the peak resident set (``VmHWM``) and the resident set before the model (imports done, the model's
class included), read from /proc; the table sums them over ranks beside one fp32 copy of the model. Summed RSS
counts the shared libraries' pages (libtorch and the rest) once per rank; the host's own total is the sum of the
proportional set sizes (``Pss`` in /proc/PID/smaps_rollup, shared pages split between the processes that map
them), sampled every 20 ms across all ranks at once by the parent: its peak is the table's last columns.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from _procmem import pss as _pss
from _report import versions, write_section

CKPT = Path("/tmp/longpack-bench-qwen0.5b")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def checkpoint() -> Path:
    if (CKPT / "model.safetensors").is_file():
        return CKPT
    import torch

    from longpack.model import get_model
    from longpack.runtime.run.hf_model import build

    model = build(get_model("qwen2.5-0.5b"), 0, torch.bfloat16)
    model.save_pretrained(CKPT)
    return CKPT


def rank_main(rank: int, world: int, port: int, mode: str, out: str) -> None:
    import json

    import torch

    from longpack.runtime.dist import init_distributed
    from longpack.runtime.kernel.parallelize import parallelize

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu")
    import transformers  # noqa: F401  (imports counted in the baseline, as in a run)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (the model's class: an import, not the weights)

    before = _status("VmRSS")
    cpu = torch.device("cpu")
    if mode == "sharded":
        from longpack.model import get_model
        from longpack.runtime.run.hf_model import config_of
        from longpack.runtime.run.shard_load import load_shards, meta_model, restore_buffers

        config = config_of(get_model("qwen2.5-0.5b"), CKPT)
        model = parallelize(meta_model(config, torch.float32), world, cpu, torch.bfloat16)
        model.to_empty(device=cpu)
        load_shards(model, CKPT)
        restore_buffers(model)
    else:
        from longpack.runtime.run.hf_model import load

        model = parallelize(load(CKPT, torch.float32), world, cpu, torch.bfloat16)
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps({"before": before, "peak": _status("VmHWM")}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def spawn_sampled(fn, args: tuple, nprocs: int) -> int:  # noqa: ANN001
    """``mp.spawn(fn, args, nprocs)``, returning the peak over time of the ranks' summed proportional set size."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    peak = 0
    while not ctx.join(timeout=0.02):
        peak = max(peak, sum(_pss(p.pid) for p in ctx.processes))
    return peak


def torch_alone() -> int:
    """Bytes resident in a python that has imported torch and nothing else: the least any rank's interpreter holds."""
    import subprocess
    import sys

    code = "import torch; print(open('/proc/self/status').read())"
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("VmRSS:"))


def main() -> None:
    import json
    import tempfile

    from longpack.model import get_model
    from longpack.runtime.dist import free_port

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    checkpoint()
    fp32 = get_model("qwen2.5-0.5b").total_params * 4
    g = 2**30
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for mode in ("whole", "sharded"):
            pss = spawn_sampled(rank_main, (args.ranks, free_port(), mode, out), args.ranks)
            recs = [json.loads(Path(out, f"{mode}-{r}.json").read_text()) for r in range(args.ranks)]
            peak, base = sum(r["peak"] for r in recs), sum(r["before"] for r in recs)
            rows.append(f"| {mode} | {peak / g:.2f} GiB | {base / g:.2f} GiB | {(peak - base) / g:.2f} GiB | "
                        f"{peak / fp32:.2f}x | {(peak - base) / fp32:.2f}x | {pss / g:.2f} GiB | "
                        f"{pss / fp32:.2f}x |")
            print(rows[-1], flush=True)
    params = get_model("qwen2.5-0.5b").total_params / 1e9
    bare = torch_alone()
    body = (f"{versions()}. {args.ranks} gloo ranks start Qwen2.5-0.5B ({params:.2f}B "
            f"parameters; one fp32 copy {fp32 / g:.2f} GiB) from bf16 safetensors:\n\n| start-up | peak RSS, sum "
            "over ranks | RSS before the weights (imports) | peak above that | peak / fp32 copy | above / fp32 copy | "
            "peak of the summed PSS | PSS / fp32 copy |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
            + f"\n\nBefore the weights, each interpreter (python, torch with FSDP2, transformers and the model's "
            f"class, which imports torch._dynamo, scipy and accelerate) is {base / args.ranks / 2**20:.0f} MiB "
            "resident; above that a sharded rank holds its fp32 shard, and the ranks' shards together one fp32 "
            "copy; the whole start-up held an fp32 copy per rank, and its transient copies, before sharding. With "
            f"{args.ranks} interpreters of this size, no start-up that keeps fp32 weights can total under "
            f"{(base + fp32) / fp32:.2f}x RSS; a python that imports torch alone is {bare / 2**20:.0f} MiB resident, "
            f"so even {args.ranks} such interpreters and one fp32 copy make "
            f"{(args.ranks * bare + fp32) / fp32:.2f}x.\n")
    if args.write:
        write_section("startup_memory", "Host memory at start-up (sharded loading)",
                      f"python bench/startup_memory.py --ranks {args.ranks} --write", body)


if __name__ == "__main__":
    main()
