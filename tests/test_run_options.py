"""The run around the plan: a learning-rate schedule on torch's schedulers that a resumed run continues exactly,
gradient clipping on by default, and their flags checked before anything starts. (The parity of the lr curve and
the gradient norm with plain training: tests/test_train_rows.py; across pipeline stages: tests/test_pipeline.py.)"""

import json
import os
import shutil
import subprocess
import sys

import forked
import pool  # tests/pool.py: warm worker processes
import pytest
from faults import faulty_env  # tests/faults.py

torch = pytest.importorskip("torch")

COMMON = ["--workload", "tiny-longtail", "--model", "tiny", "--planner", "isf", "--global-batch", "6", "--dtype",
          "float64", "--json",
          "--lr-scheduler", "cosine", "--warmup-steps", "1", "--min-lr", "1e-4"]


def _train(*args):
    return pool.cli(["train", *COMMON, *args])


def _steps(proc):
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]


def test_a_resumed_run_continues_the_same_lr_curve_bit_identical(tmp_path):
    from safetensors.torch import load_file

    ck = tmp_path / "ck"
    whole = _steps(_train("--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--output-dir",
                          str(tmp_path / "a")))
    lrs = [s["lr"] for s in whole]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3) and lrs[3] == pytest.approx(1e-4)
    assert all(s["grad_norm"] > 0 for s in whole)
    shutil.rmtree(ck / "step_00000004")  # as if the run had stopped after its checkpoint of step 2
    resumed = _train("--steps", "4", "--checkpoint-dir", str(ck), "--resume", "--output-dir", str(tmp_path / "b"))
    rest = _steps(resumed)
    assert f"resuming step 2 on 1 process, as before: same global batches (from {ck / 'step_00000002'})" \
        in resumed.stderr, resumed.stderr[-2000:]
    assert [s["step"] for s in rest] == [2, 3] and [s["lr"] for s in rest] == lrs[2:]
    a, b = load_file(os.path.join(tmp_path / "a", "model.safetensors")), load_file(
        os.path.join(tmp_path / "b", "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    longer = _train("--steps", "6", "--checkpoint-dir", str(ck), "--resume")
    assert longer.returncode == 2 and "resume with the same --steps" in longer.stderr, longer.stderr[-2000:]


@pytest.mark.parametrize(("kw", "says"), [
    ({"lr_scheduler": "nosuch"}, "--lr-scheduler 'nosuch': choose one of constant, linear, cosine"),
    ({"min_lr": 0.5}, "--min-lr 0.5: must be in [0, --lr 0.001]"),
    ({"max_grad_norm": -1.0}, "--max-grad-norm -1.0: must be >= 0"),
    ({"warmup_ratio": 1.5}, "--warmup-ratio 1.5: give steps >= 0 and a ratio in [0, 1)"),
])
def test_schedule_and_clipping_flags_are_checked_when_given(kw, says):
    from longpack.runtime.run.train import TrainArgs

    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TrainArgs.of(**kw)


def test_clipping_scales_to_the_norm_and_measures_without_it():
    from longpack.runtime.run.optim import clip_gradients

    p, q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([3.0, 4.0], dtype=torch.float64), None
    assert float(clip_gradients([p, q], 0.0)) == 5.0 and p.grad.tolist() == [3.0, 4.0]  # measured only
    assert float(clip_gradients([p, q], 1.0)) == 5.0
    assert p.grad.tolist() == pytest.approx([0.6, 0.8])
    # a parameter another stage counts (a tied LM head) is scaled, not counted
    r = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    r.grad = torch.tensor([12.0], dtype=torch.float64)
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert float(clip_gradients([p, r], 2.5, skip=[r])) == 5.0 and r.grad.tolist() == pytest.approx([6.0])


def test_adamw_is_the_fused_kernel_where_the_device_has_one_and_its_step_is_adamw():
    from longpack.runtime.run.optim import adamw

    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    b.load_state_dict(a.state_dict())
    fused, plain = adamw(a, 1e-2, 0.1), torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] and not plain.defaults["fused"]  # the Trainer's default, adamw_torch_fused
    for _ in range(3):
        for m, o in ((a, fused), (b, plain)):
            m(torch.ones(1, 3, dtype=torch.float64)).square().sum().backward()
            o.step(), o.zero_grad()
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_metrics_file_and_tensorboard_events_per_step(tmp_path):
    out = tmp_path / "out"
    steps = _steps(_train("--steps", "3", "--output-dir", str(out)))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    for line, step in zip(lines, steps, strict=True):
        assert line["loss"] == step["loss"] and line["lr"] == step["lr"] and line["grad_norm"] == step["grad_norm"]
        assert line["tokens_per_second"] > 0 and line["memory_measured_bytes"] > 0
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from longpack.report.run_curves import write_run_report

    png = write_run_report(out, tmp_path / "curves.png")  # `longpack report --run DIR --out curves.png`
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = write_run_report(out, tmp_path / "curves.html")
    assert "data:image/png;base64," in page.read_text() and "3 steps" in page.read_text()
    events = EventAccumulator(str(out))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx([s["loss"] for s in steps], rel=1e-6)  # TensorBoard stores float32
    assert [e.step for e in events.Scalars("train/lr")] == [0, 1, 2]


def test_a_resumed_run_may_find_its_own_metrics_in_the_output_dir(tmp_path):
    from longpack.runtime.run.preflight import check_output_dir

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    check_output_dir(str(tmp_path), None, None, overwrite=False, resuming=True)
    with pytest.raises(ValueError, match="is not empty"):
        check_output_dir(str(tmp_path), None, None, overwrite=False)


def test_progress_line_with_steps_tokens_per_second_and_time_left():
    proc = forked.run(["train", *COMMON, "--steps", "2"], timeout=300,
                      env={**os.environ, "LONGPACK_PROGRESS": "always"})
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: train:")]
    assert proc.returncode == 0 and [x.split(",")[0] for x in lines] == ["longpack: train: 1/2 steps",
                                                                          "longpack: train: 2/2 steps"], proc.stderr
    assert all("left (" in x and x.endswith("tokens/s)") for x in lines)


def test_each_epoch_is_its_own_permutation_of_the_rows():
    from longpack.planners import global_batches

    one = global_batches(10, 4, seed=3)
    two = global_batches(10, 4, seed=3, epochs=2)
    assert [b.tolist() for b in two[:3]] == [b.tolist() for b in one]  # epoch 0 as without epochs
    second = [b.tolist() for b in two[3:]]
    assert sorted(x for b in second for x in b) == list(range(10, 20))  # epoch 1's copies, each once
    assert [[x - 10 for x in b] for b in second] != [b.tolist() for b in one]  # in another order
    assert len(global_batches(10, 4, seed=3, epochs=2, steps=4)) == 4  # --steps counts over the epochs


def _rows(path):
    with open(path, "w") as f:
        for i in range(12):
            ids = [(7 * i + j) % 1000 + 1 for j in range(5 + 3 * i)]
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 2 + ids[2:]}) + "\n")
    return str(path)


def test_two_epochs_train_other_batches_and_resume_mid_epoch_bit_identical(tmp_path):
    """The issue's run: 2 processes with FSDP2, cosine after 2 warmup steps, clipping at 1.0, 2 epochs, held-out
    rows every 2 steps. 12 rows, 6 a step: epoch 1 is steps 0-1, epoch 2 steps 2-3; every step logs lr, grad norm
    and loss, steps 1 and 3 the held-out loss; each step trains exactly its global batch's rows (tokens summed
    from the plan's permutation). Rank 0 killed as it starts its 4th checkpoint (after step 3, mid-epoch 2), the
    run resumed: the uninterrupted run's weights bit for bit."""
    from safetensors.torch import load_file

    from longpack.planners import global_batches

    rows, held = _rows(tmp_path / "rows.jsonl"), _rows(tmp_path / "held.jsonl")
    lengths = [5 + 3 * i for i in range(12)]
    ck = tmp_path / "ck"
    flags = ["--data", rows, "--epochs", "2", "--nproc", "2", "--warmup-steps", "2", "--max-grad-norm", "1.0",
             "--eval-data", held, "--eval-every", "2"]
    whole = _steps(_train(*flags, "--output-dir", str(tmp_path / "a")))
    assert all({"lr", "grad_norm", "loss"} <= set(s) for s in whole) and whole[2]["lr"] == pytest.approx(1e-3)
    assert [s["step"] for s in whole if "eval_loss" in s] == [1, 3]
    batches = global_batches(12, 6, seed=0, epochs=2)
    assert [s["tokens"] for s in whole] == [sum(lengths[i % 12] for i in b) for b in batches]
    assert {int(i) % 12 for i in batches[2]} != {int(i) % 12 for i in batches[0]}  # epoch 2 reshuffled
    flags += ["--checkpoint-dir", str(ck)]  # the real launcher, rank 0 killed entering its 4th checkpoint
    killed = forked.run(["train", *COMMON, *flags, "--checkpoint-every", "1"], timeout=300,
                        env=faulty_env(tmp_path, "kill", rank=0, at=4))
    trained = [x for x in killed.stdout.splitlines() if x.startswith('{"step"')]
    assert killed.returncode == 2 and len(trained) == 4, killed.stderr[-2000:]
    assert "rank 0: the process was killed (SIGKILL)" in killed.stderr, killed.stderr[-2000:]
    assert all((ck / f"step_0000000{i}").is_dir() for i in (1, 2, 3))
    resumed = _train(*flags, "--resume", "--output-dir", str(tmp_path / "b"))
    assert f"resuming step 3 on 2 processes, as before: same global batches (from {ck / 'step_00000003'})" \
        in resumed.stderr, resumed.stderr[-2000:]
    rest = _steps(resumed)
    assert [s["step"] for s in rest] == [3] and rest[0]["loss"] == whole[3]["loss"]
    assert rest[0]["eval_loss"] == whole[3]["eval_loss"] and rest[0]["lr"] == whole[3]["lr"]
    a, b = load_file(os.path.join(tmp_path / "a", "model.safetensors")), load_file(
        os.path.join(tmp_path / "b", "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_report_to_wandb_offline(tmp_path):
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "longpack.cli", "train", *COMMON, "--steps", "2", "--log-dir",
                           str(tmp_path / "logs"), "--report-to", "wandb"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_report_to_an_unknown_service_is_refused():
    from longpack.runtime.run.train import TrainArgs

    with pytest.raises(ValueError, match="--report-to 'comet': choose wandb"):
        TrainArgs.of(report_to="comet")
