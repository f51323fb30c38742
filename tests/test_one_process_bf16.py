"""One bfloat16 process trains with fp32 weights, gradients and AdamW state (FSDP2's mixed precision on a group
of one, runtime/run/run_plan.sharded): a bf16 AdamW would round away every update below 1/256 of a weight."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_one_bf16_process_keeps_fp32_weights_and_small_updates_land():
    import torch.distributed as dist

    from longpack import jobs
    from longpack.runtime.run.train import train
    from longpack.runtime.run.train_args import TrainArgs

    def run(fsdp: bool) -> tuple[torch.nn.Module, dict]:
        args = TrainArgs.of(run=jobs.RunSpec(model="tiny-llama", workload="tiny-longtail", samples=8, hardware="cpu",
                                          token_cap=1024, global_batch=4, steps=1, seed=0),
                         dtype="bfloat16", lr=1e-6, threads=1, fsdp=fsdp)
        try:
            got = train(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return got["model"], got

    from longpack.runtime.run.hf_model import build
    from longpack.runtime.run.run_plan import model_spec

    before = {k: v.float() for k, v in build(model_spec(TrainArgs.of(run=jobs.RunSpec(model="tiny-llama"))), 0,
                                                   torch.float32).state_dict().items()}
    model, got = run(fsdp=True)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    w = params["model.layers.0.mlp.up_proj.weight"].full_tensor()
    moved = (w - before["model.layers.0.mlp.up_proj.weight"]).abs()
    assert float((moved > 0).float().mean()) > 0.9  # an lr-1e-6 step moves (nearly) every weight
    plain, _ = run(fsdp=False)  # --no-fsdp: bf16 parameters, the same step rounds away
    w16 = dict(plain.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert w16.dtype == torch.bfloat16
    assert float(((w16.float() - before["model.layers.0.mlp.up_proj.weight"].bfloat16().float()) != 0).float()
                 .mean()) < 0.1
