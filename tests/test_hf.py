"""Hugging Face integration: LongpackTrainer (and TRL's SFTTrainer through it) on the shared engine equals plain
unpacked ``transformers.Trainer`` training of the same rows, in float64, at CP 1, CP 2 and CP 2 x DP 2."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_case  # noqa: E402
import pool  # noqa: E402  (tests/pool.py: warm worker processes)

from longpack.hf import LongpackConfig, LongpackTrainer, config_message, longpack_trainer_class  # noqa: E402

LOSS_RTOL = 1e-6  # the Trainer logs float32 losses; ours are float64
WEIGHT_ATOL = 1e-8  # float64: packing, sharding and reduction change only the order of additions


def _weights_close(a: dict, b: dict) -> float:
    return max(float((a[k] - v).abs().max()) for k, v in b.items())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return hf_case.plain(str(tmp_path_factory.mktemp("plain")))


def _check(losses, state, reference):
    ref_losses, ref_state = reference
    assert len(losses) == len(ref_losses) == hf_case.STEPS
    for ours, ref in zip(losses, ref_losses, strict=True):
        assert ours == pytest.approx(ref, rel=LOSS_RTOL)
    assert _weights_close(state, ref_state) <= WEIGHT_ATOL


def test_hf_parity_one_process_trainer_with_labels(tmp_path, reference):
    trainer = hf_case.longpack_trainer(str(tmp_path))
    metrics = trainer.train().metrics
    _check([s["loss"] for s in trainer.longpack_steps], trainer.model.state_dict(), reference)
    # the Trainer's throughput counts the plan's samples (global batch per step), not its one-step batches
    samples = hf_case.GLOBAL_BATCH * hf_case.STEPS
    assert metrics["train_samples_per_second"] == pytest.approx(samples / metrics["train_runtime"], rel=0.02)
    logged = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    assert logged == pytest.approx([s["loss"] for s in trainer.longpack_steps], rel=LOSS_RTOL)
    assert trainer.model.config._attn_implementation == "sdpa"  # the model's own attention after training


def test_hf_parity_one_process_trl_completion_only(tmp_path, reference):
    pytest.importorskip("trl")
    trainer = hf_case.longpack_trainer(str(tmp_path), kind="trl")
    trainer.train()
    # TRL 1.16 writes labels from its completion_mask while preparing the dataset; either is read as targets
    assert trainer.longpack_report["rows"]["targets_from"] in ("labels", "completion_mask")
    _check([s["loss"] for s in trainer.longpack_steps], trainer.model.state_dict(), reference)


def test_hf_parity_completion_mask_column_without_labels(tmp_path, reference):
    ids, mask = hf_case.rows()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": mask})
    trainer = LongpackTrainer(model=hf_case.model(), args=hf_case.args(str(tmp_path), hf_case.STEPS),
                              train_dataset=ds, longpack=hf_case.config(1))
    trainer.train()
    assert trainer.longpack_report["rows"]["targets_from"] == "completion_mask"
    _check([s["loss"] for s in trainer.longpack_steps], trainer.model.state_dict(), reference)


def test_hf_trl_truncation_by_max_length_is_said(tmp_path):
    trl = pytest.importorskip("trl")
    ids, mask = hf_case.rows()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": mask})
    sft = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                        max_length=64, completion_only_loss=True, disable_tqdm=True)
    with pytest.warns(UserWarning, match=r"5 rows are exactly max_length=64 tokens long: TRL truncated them"):
        longpack_trainer_class(trl.SFTTrainer)(model=hf_case.model(), args=sft, train_dataset=ds,
                                               processing_class=hf_case.tokenizer(),
                                               longpack=hf_case.config(1))


def _torchrun(tmp_path, nproc: int, cp: int, kind: str) -> dict:
    out = tmp_path / "run.pt"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_run.py")
    proc = pool.script(script, [out, cp, kind], nproc=nproc, env={"OMP_NUM_THREADS": "1"})  # as torchrun runs it
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False) | {"stderr": proc.stderr}


def test_hf_fsdp_asked_on_cpu_is_said_and_training_stays_exact(tmp_path, reference):
    """Accelerate enables FSDP on GPU process groups only (its MULTI_CPU state never becomes FSDP): on CPU the
    request is said once and the run is replicated; bench/gpu.sh checks FSDP2 parity on several GPUs."""
    run = _torchrun(tmp_path, 2, 1, "fsdp")
    assert run["fsdp_modules"] == 0 and "Accelerate did not shard the model" in run["stderr"]
    _check(run["losses"], run["state"], reference)


def test_hf_resume_from_a_trainer_checkpoint_continues_at_the_next_step(tmp_path):
    ids, _ = hf_case.rows()
    ds = _rows_dataset(ids)
    cfg = LongpackConfig(global_batch=4, token_cap=64)

    class _StopAt(transformers.TrainerCallback):  # the run is interrupted after step 2 (its checkpoint written)
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    def run(out, resume=None, stop=False):
        args = hf_case.args(str(out), 4, save_strategy="steps", save_steps=2)
        t = LongpackTrainer(model=hf_case.model(), args=args, train_dataset=ds, longpack=cfg,
                            callbacks=[_StopAt()] if stop else None)
        t.train(resume_from_checkpoint=resume)
        return t

    whole = run(tmp_path / "whole")
    run(tmp_path / "first", stop=True)
    resumed = run(tmp_path / "again", resume=str(tmp_path / "first" / "checkpoint-2"))
    assert [s["step"] for s in whole.longpack_steps] == [0, 1, 2, 3]
    assert [s["step"] for s in resumed.longpack_steps] == [2, 3]  # the plan continues at its exact next step
    assert [s["loss"] for s in resumed.longpack_steps] == pytest.approx([s["loss"] for s in whole.longpack_steps[2:]],
                                                                        rel=1e-12)
    assert _weights_close(resumed.model.state_dict(), whole.model.state_dict()) <= WEIGHT_ATOL


def test_hf_parity_a_two_process_trainer_checkpoint_resumed_on_one_process(tmp_path):
    """Elastic resume through the Trainer: a 2-process run (replicated on CPU: Accelerate's DDP) saves a checkpoint
    every step; its checkpoint-1 resumed on 1 process trains the same global batches, re-planned for one rank:
    every later step's loss and the final weights equal the 2-process run's (float64, only reduction order
    differs). The Trainer's optimizer.pt and scheduler.pt hold whole tensors, so they load on any process count;
    its per-process RNG files are read where they exist (Accelerate's own rule)."""
    out = tmp_path / "run.pt"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_run.py")
    proc = pool.script(script, [out, 1, "trainer", 3, 1], nproc=2, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = torch.load(out, weights_only=False)
    assert (tmp_path / "checkpoint-1").is_dir() and len(two["losses"]) == 3
    one = hf_case.longpack_trainer(str(tmp_path / "one"), steps=3)
    one.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert [s["step"] for s in one.longpack_steps] == [1, 2]
    for a, b in zip([s["loss"] for s in one.longpack_steps], two["losses"][1:], strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (a, b)
    state = {k: v.detach() for k, v in one.model.state_dict().items()}
    worst = max(float((state[k] - v).abs().max() / v.abs().max()) for k, v in two["state"].items())
    assert worst <= 1e-9, worst


@pytest.mark.parametrize("nproc,kind", [(2, "trainer"), (4, "trainer"), (4, "trl")],
                         ids=["cp2", "cp2xdp2", "trl-completion-only-cp2xdp2"])
def test_hf_parity_context_parallel(tmp_path, reference, nproc, kind):
    if kind == "trl":
        pytest.importorskip("trl")
    run = _torchrun(tmp_path, nproc, 2, kind)
    assert run["sharded"] > 0  # the long rows ran split zigzag over their CP group
    _check(run["losses"], run["state"], reference)
    assert run["logged"] == pytest.approx(run["losses"], rel=LOSS_RTOL)


def _rows_dataset(rows, labels=None):
    cols = {"input_ids": rows}
    if labels is not None:
        cols["labels"] = labels
    return datasets.Dataset.from_dict(cols)


def test_hf_all_labels_masked_is_refused_when_built(tmp_path):
    ids, _ = hf_case.rows()
    ds = _rows_dataset(ids, [[-100] * len(r) for r in ids])
    with pytest.raises(ValueError, match="train_dataset: no row has a target"):
        LongpackTrainer(model=hf_case.model(), args=hf_case.args(str(tmp_path), 2), train_dataset=ds,
                        longpack=hf_case.config(1))


def test_hf_empty_and_overlong_rows_are_counted_and_reported(tmp_path, capsys):
    ids, _ = hf_case.rows()
    ds = _rows_dataset(ids[:6] + [[], []] + ids[6:])
    trainer = LongpackTrainer(model=hf_case.model(), args=hf_case.args(str(tmp_path), 1), train_dataset=ds,
                              longpack=LongpackConfig(global_batch=8, token_cap=64, max_len=60, overlong="drop"))
    rep = trainer.longpack_report
    long = sum(1 for n in hf_case.LENGTHS if n > 60)
    assert rep["empty_rows_dropped"] == 2 and rep["rows"]["empty_rows"] == [6, 7]
    assert rep["dropped_samples"] == long and rep["dropped_tokens"] == sum(n for n in hf_case.LENGTHS if n > 60)
    assert "2 empty rows left out" in rep["line"] and f"{long} dropped" in rep["line"]
    err = capsys.readouterr().err
    assert "longpack: data:" in err and "longpack: head loss: longpack fused linear cross-entropy" in err
    trainer.train()
    first = next(x for x in trainer.state.log_history if "loss" in x)
    assert first["longpack/empty_rows_dropped"] == 2 and first["longpack/dropped_samples"] == long
    assert first["longpack/rows"] == len(hf_case.LENGTHS) + 2
    # steps are planned on a thread while earlier ones train: every training log says what its steps waited
    logs = [x for x in trainer.state.log_history if "loss" in x]
    assert logs and all(x["longpack/planner_wait_seconds"] >= 0 for x in logs)
    assert [s["step"] for s in trainer.longpack_steps] == [0]  # max_steps=1
    assert all(s["planner_wait_seconds"] >= 0 for s in trainer.longpack_steps)


def test_hf_errors_name_the_config_fields_of_this_path(tmp_path):
    ids, _ = hf_case.rows()
    with pytest.raises(ValueError) as err:
        LongpackTrainer(model=hf_case.model(), args=hf_case.args(str(tmp_path), 1), train_dataset=_rows_dataset(ids),
                        longpack=LongpackConfig(global_batch=8, token_cap=64, overlong="error"))
    msg = str(err.value)
    assert "LongpackConfig.overlong" in msg and "LongpackConfig.cp" in msg and "--" not in msg
    with pytest.raises(ValueError, match=r"LongpackConfig\(overlong='cut'\)"):
        LongpackConfig(overlong="cut")
    with pytest.raises(ValueError, match=r"LongpackConfig\(cp=0\)"):
        LongpackConfig(cp=0)
    with pytest.raises(ValueError, match=r"LongpackConfig\(head_loss='fast'\): choose one of auto, longpack, liger"):
        LongpackConfig(head_loss="fast")
    with pytest.raises(ValueError, match=r"LongpackConfig\(head_loss='liger'\): Liger's Triton kernels run on CUDA, "
                                         r"this run on cpu; use head_loss='auto' or 'longpack'"):
        LongpackTrainer(model=hf_case.model(), args=hf_case.args(str(tmp_path), 1), train_dataset=_rows_dataset(ids),
                        longpack=LongpackConfig(global_batch=8, token_cap=64, head_loss="liger"))
    assert config_message("use --max-len or --token-cap") == \
        "use LongpackConfig.max_len or LongpackConfig.token_cap"
    # planner, hardware and options are checked when the config is made, not inside the Trainer
    with pytest.raises(ValueError, match=r"LongpackConfig\(planner='nosuch'\): unknown planner 'nosuch'; choose"):
        LongpackConfig(planner="nosuch")
    with pytest.raises(ValueError, match=r"LongpackConfig\(hardware='tpu'\): unknown hardware 'tpu'"):
        LongpackConfig(hardware="tpu")
    with pytest.raises(ValueError, match=r"LongpackConfig\(options=\{'nosuch': 1\}\): LongpackConfig.options"):
        LongpackConfig(options={"nosuch": 1})


def _example(out_dir, nproc: int = 1):
    """examples/hf_trainer.py as ``python`` (``nproc`` 1) or ``torchrun --nproc-per-node NPROC`` runs it, on the
    warm pool; its logged losses."""
    import re
    from pathlib import Path

    script = str(Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py")
    proc = pool.script(script, ["--steps", "3", "--output-dir", str(out_dir)], nproc=nproc, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(x) for x in re.findall(r"\{'loss': '([0-9.]+)'", proc.stdout + proc.stderr)]


def test_hf_example_one_and_two_processes_train_the_same_losses(tmp_path):
    """The example as one process and as 2 CPU ranks (gloo): the same samples per step and the exact global token
    mean give the same loss curve (test_trust.py runs `longpack train` under the real torchrun)."""
    single = _example(tmp_path / "one")
    double = _example(tmp_path / "two", nproc=2)
    assert len(single) == 3 and single == pytest.approx(double, rel=1e-3)


def test_hf_trl_long_sft_example_runs_as_written(tmp_path):
    """README: `torchrun --nproc-per-node 4 examples/trl_long_sft.py` (TRL, completion-only, 4 CPU ranks on the warm
    pool, as torchrun runs them; test_trust.py runs `longpack train` under the real torchrun)."""
    import re
    from pathlib import Path

    pytest.importorskip("trl")
    script = str(Path(__file__).resolve().parent.parent / "examples" / "trl_long_sft.py")
    proc = pool.script(script, ["--output-dir", tmp_path], nproc=4, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    plan = re.search(r"plan: 3 steps at CP degrees \[[\d, ]+\], (\d+) pieces sharded over a CP group", out)
    assert plan and int(plan.group(1)) > 0, out[-2000:]
    assert "longpack: data: 96 rows read, 96 samples in this run" in out
    assert len(re.findall(r"\{'loss': '([0-9.]+)'", out)) == 3


def test_hf_two_epochs_train_other_global_batches(tmp_path):
    """num_train_epochs=2: the Trainer's second epoch trains the plan's second permutation of the rows (each step
    exactly its global batch's tokens), not the first epoch's batches again."""
    from longpack.planners import global_batches

    trainer = LongpackTrainer(model=hf_case.model(), args=hf_case.args(str(tmp_path), -1, num_train_epochs=2),
                              train_dataset=hf_case.labelled(), longpack=hf_case.config(1))
    trainer.train()
    n = len(hf_case.LENGTHS)
    batches = global_batches(n, hf_case.GLOBAL_BATCH, seed=0, epochs=2)
    assert [s["step"] for s in trainer.longpack_steps] == [0, 1, 2, 3]
    assert [s["tokens"] for s in trainer.longpack_steps] == [sum(hf_case.LENGTHS[i % n] for i in b) for b in batches]
    assert [sorted(int(i) % n for i in b) for b in batches[2:]] != [sorted(int(i) for i in b) for b in batches[:2]]
