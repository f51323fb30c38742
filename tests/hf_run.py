"""One run of LongpackTrainer (or TRL's SFTTrainer through longpack) on the rows of tests/hf_case.py, for the
multi-process tests: ``torchrun --nproc-per-node N tests/hf_run.py OUT CP {trainer|trl} [STEPS [SAVE_STEPS]]``
(SAVE_STEPS: the Trainer's checkpoints every SAVE_STEPS steps, in OUT's folder).

Rank 0 saves {"losses": per-step losses, "logged": the Trainer's logged losses, "state": final weights (FSDP2
shards gathered), "sharded": pieces sharded over a CP group, "fsdp_modules": FSDP2 units, "report": the data
report} to OUT with torch.save. KIND: trainer, trl, or fsdp (LongpackTrainer under Accelerate's FSDP2).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_case  # noqa: E402
import torch  # noqa: E402


def compare(path: str) -> None:
    """``hf_run.py --compare OUT``: exit 1 unless the run used FSDP2 units and matches plain float64 training."""
    import tempfile

    run = torch.load(path, weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        losses, state = hf_case.plain(tmp)
    diff = max(float((run["state"][k].cpu() - v).abs().max()) for k, v in state.items())
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], losses, strict=True))
    ok = run["fsdp_modules"] > 0 and diff <= 1e-8 and loss <= 1e-6
    print(f"hf fsdp2 parity: {run['fsdp_modules']} FSDP2 units, weights max diff {diff:.1e}, loss rel {loss:.1e}: "
          f"{'ok' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


def main() -> None:
    if sys.argv[1] == "--compare":
        compare(sys.argv[2])
        return
    out, cp, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else hf_case.STEPS
    save = {"save_strategy": "steps", "save_steps": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    torch.set_num_threads(1)
    trainer = hf_case.longpack_trainer(os.path.dirname(out), cp=cp, kind=kind, steps=steps, **save)
    trainer.train()
    from longpack.runtime.kernel.parallelize import fsdp_modules

    net = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    fsdp = len(fsdp_modules(net))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
             for k, v in net.state_dict().items()}  # every rank takes part in gathering FSDP2's shards
    if trainer.args.process_index == 0:
        sharded = sum(1 for st in trainer.plan.steps if st.cp > 1 or st.degrees for r in st.replicas
                      for mb in r.micro_batches for p in mb.pieces if p.cp_rank is None)
        logged = [x["loss"] for x in trainer.state.log_history if "loss" in x]
        torch.save({"losses": [s["loss"] for s in trainer.longpack_steps], "logged": logged,
                    "state": state, "sharded": sharded, "fsdp_modules": fsdp, "report": trainer.longpack_report}, out)
    if torch.distributed.is_initialized():
        from longpack.runtime.dist import leave

        leave()


if __name__ == "__main__":
    main()
