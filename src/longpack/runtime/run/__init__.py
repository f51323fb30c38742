"""A training run around the kernel: `longpack train`'s arguments (train_args.py), its rows and plan
(run_plan.py, ahead.py), the loop (train.py), its logs and metrics (step_log.py, metrics.py), checkpoints and
resume (checkpoint.py, resume.py), the output model (output.py), the launcher (launch.py) and the dry run
(dry_run.py). Every step, evaluation included, goes through the kernel's step runner; nothing here reaches
deeper into the kernel than that and the model's construction (hf_model.py, parallelize)."""
