"""One run of LongpackTrainer (or TRL's SFTTrainer through longpack) on the rows of tests/hf_case.py, for the
multi-process tests: ``torchrun --nproc-per-node N tests/hf_run.py OUT CP {trainer|trl} [STEPS]``.

Rank 0 saves {"losses": per-step losses, "logged": the Trainer's logged losses, "state": final weights,
"sharded": pieces sharded over a CP group, "report": the data report} to OUT with torch.save.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_case  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    out, cp, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else hf_case.STEPS
    torch.set_num_threads(1)
    trainer = hf_case.longpack_trainer(os.path.dirname(out), cp=cp, kind=kind, steps=steps)
    trainer.train()
    if trainer.args.process_index == 0:
        sharded = sum(1 for st in trainer.plan.steps if st.cp > 1 or st.degrees for r in st.replicas
                      for mb in r.micro_batches for p in mb.pieces if p.cp_rank is None)
        logged = [x["loss"] for x in trainer.state.log_history if "loss" in x]
        torch.save({"losses": [s["loss"] for s in trainer.longpack_steps], "logged": logged,
                    "state": {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()},
                    "sharded": sharded, "report": trainer.longpack_report}, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
