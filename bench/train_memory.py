"""Measured activation memory of a real CPU step against the cost model, across checkpointing and vocabularies.

    python bench/train_memory.py [--tokens 2048] [--write]

One micro-batch of four packed 512-token documents through transformers' Llama on the longpack engine, with the
first k of 4 decoder layers checkpointed (torch.utils.checkpoint through transformers' per-layer switch), forward
and backward. Two measurements, gradient buffers allocated beforehand so that neither counts them:

* allocator peak — the peak bytes the CPU allocator holds above the start of the step (``torch.profiler`` memory
  events; the CPU analogue of ``torch.cuda.max_memory_allocated``), temporaries included;
* held for backward — what ``longpack train`` logs each step: distinct storages saved for backward plus the
  inputs checkpointing keeps (runtime/kernel/memory.py).

Beside them the cost model's activation bytes (``act_bytes_per_token(k) · tokens`` at 4 bytes a number), and each
column as a ratio to k = 0: the figure the plan's checkpointing decision rests on.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from _report import write_section


def measure(vocab: int, tokens: int) -> list[dict]:
    import torch

    from longpack.cost import CostModel, TrainConfig
    from longpack.hardware import get_hardware
    from longpack.model import get_model
    from longpack.runtime.kernel import varlen
    from longpack.runtime.kernel.engine import checkpointing, forward_logits
    from longpack.runtime.kernel.memory import ActivationMeter, allocator_peak
    from longpack.runtime.run.hf_model import build

    spec = replace(get_model("tiny-llama"), vocab=vocab)
    model = build(spec, 0, torch.float32).train()
    cost = CostModel(spec, get_hardware("cpu"), TrainConfig(act_bytes=4))
    doc = tokens // 4
    cu = [0, doc, 2 * doc, 3 * doc, 4 * doc]
    ids = torch.randint(0, vocab, (4 * doc,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(doc).repeat(4)
    rows = []
    for k in range(spec.layers + 1):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

        def step(k: int = k) -> None:
            with checkpointing(model, k):
                seqs = varlen.Seqs.of_offsets(cu)
                logits = forward_logits(model, ids, pos, lambda _l, q, kk, v: varlen.attention(q, kk, v, seqs))
            torch.nn.functional.cross_entropy(logits, ids, reduction="sum").backward()

        peak = allocator_peak(step)
        meter = ActivationMeter()
        with meter.measure(model):
            step()
        rows.append({"k": k, "peak": peak, "held": meter.peak, "predicted": cost.act_bytes_per_token(k) * 4 * doc})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    lines = []
    for vocab in (1024, 32000, 151936):
        rows = measure(vocab, args.tokens)
        base = rows[0]
        for r in rows:
            ratio = {c: r[c] / base[c] for c in ("peak", "held", "predicted")}
            off = ratio["peak"] / ratio["predicted"] - 1
            line = (f"| {vocab} | {r['k']} | {r['peak'] / 2**20:.1f} | {r['held'] / 2**20:.1f} | "
                    f"{r['predicted'] / 2**20:.1f} | {ratio['peak']:.3f} | {ratio['held']:.3f} | "
                    f"{ratio['predicted']:.3f} | {off:+.1%} |")
            print(line, flush=True)
            lines.append(line)
    if args.write:
        body = ("| vocab | k ckpt layers | allocator peak MiB | held for backward MiB | predicted MiB | peak / k=0 "
                "| held / k=0 | predicted / k=0 | peak ratio vs predicted ratio |\n"
                "|---|---|---|---|---|---|---|---|---|\n"
                + "\n".join(lines)
                + f"\n\ntiny-llama shape (4 layers, hidden 256, 8 heads / 2 KV heads, ffn 688) at three vocabularies, "
                f"float32, one micro-batch of {args.tokens} tokens (4 documents), the first k layers checkpointed; "
                f"2 threads, torch {torch.__version__}. Predicted: `CostModel.act_bytes_per_token(k)` at 4 bytes.\n\n"
                "Reading it: the ratios are what checkpointing decisions rest on. The runtime checkpoints the "
                "*first* k layers, whose recomputation during backward comes after the later layers' activations "
                "are freed, so each checkpointed layer saves a whole layer less its input until k = all layers, "
                "where the last one's re-expansion is paid; the cost model prices it so (docs/COST_MODEL.md). The "
                "absolute figures sit above the prediction: a float32 CPU layer saves more than the bf16 tensors "
                "the model counts (RMSNorm and RoPE intermediates), and the allocator peak also holds the loss's "
                "backward temporaries (the log-softmax output, its gradient and the logits' gradient, each tokens "
                "x vocab in fp32), of which the cost model counts one copy.")
        write_section("train_memory", "Activation memory: measured vs the cost model (real CPU steps)",
                      "python bench/train_memory.py --write", body)


if __name__ == "__main__":
    main()
