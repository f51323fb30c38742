"""Hugging Face integration: the longpack Trainer's packed step equals plain unpacked Trainer training."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from longpack.hf import LongpackConfig, LongpackTrainer, check_document_masking  # noqa: E402

LENGTHS = [37, 5, 64, 12, 90, 17, 33, 3, 48, 70, 9, 26]
RTOL = 1e-6  # float64; packing changes only the order of additions


def _model(attn="sdpa"):
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def _dataset():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 61, (n,), generator=g).tolist() for n in LENGTHS]
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})


class _Grab(transformers.TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {k: p.grad.detach().clone() for k, p in self.model.named_parameters()}


def _args(tmp_path, ga):
    return transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1,
                                          gradient_accumulation_steps=ga, max_steps=1, learning_rate=1e-3,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                                          dataloader_num_workers=0, seed=0)


@pytest.mark.parametrize("planner", ["skrull", "unified"])
def test_hf_parity_packed_trainer_step_equals_plain_trainer(tmp_path, planner):
    plain_model = _model()
    grab = _Grab(plain_model)
    ds = _dataset()
    plain = transformers.Trainer(model=plain_model, args=_args(tmp_path / "plain", len(LENGTHS)), train_dataset=ds,
                                 callbacks=[grab])
    plain.train()

    packed_model = _model()
    grab2 = _Grab(packed_model)
    trainer = LongpackTrainer(model=packed_model, args=_args(tmp_path / "packed", 1),
                              train_dataset=ds.remove_columns("labels"), callbacks=[grab2],
                              longpack=LongpackConfig(planner=planner, global_batch=len(LENGTHS), token_cap=128))
    assert len(trainer.plan.steps) == 1 and trainer.args.gradient_accumulation_steps < len(LENGTHS)
    trainer.train()
    plain_loss = next(x["loss"] for x in plain.state.log_history if "loss" in x)
    packed_loss = next(x["loss"] for x in trainer.state.log_history if "loss" in x)
    assert packed_loss == pytest.approx(plain_loss, rel=1e-4)  # logged values are rounded by transformers
    for name, g in grab.grads.items():
        err = float((grab2.grads[name] - g).norm() / g.norm())
        assert err <= RTOL, (name, err)


def test_hf_refuses_attention_that_mixes_documents():
    model = _model("sdpa")
    check_document_masking(model)  # sdpa with position ids honours document boundaries
    model.config._attn_implementation = "eager"
    check_document_masking(model)


class _MixingModel(torch.nn.Module):
    """Attention that ignores document boundaries (a running mean over the whole row)."""

    def __init__(self):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config._attn_implementation = "mixing"
        self.emb = torch.nn.Embedding(32, 8)

    def forward(self, input_ids, position_ids=None, use_cache=False, **kwargs):
        x = self.emb(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return transformers.modeling_outputs.CausalLMOutput(logits=x)


def test_hf_guard_refuses_an_implementation_that_mixes_documents():
    with pytest.raises(ValueError, match="attn_implementation='mixing' lets packed documents attend"):
        check_document_masking(_MixingModel())


def test_hf_trl_sft_trainer_with_longpack_matches_longpack_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    from longpack.hf import longpack_trainer_class

    ds = _dataset().remove_columns("labels")
    cfg = LongpackConfig(planner="isf", global_batch=len(LENGTHS), token_cap=128)
    base_model, sft_model = _model(), _model()
    grab, grab2 = _Grab(base_model), _Grab(sft_model)
    LongpackTrainer(model=base_model, args=_args(tmp_path / "a", 1), train_dataset=ds, callbacks=[grab],
                    longpack=cfg).train()
    sft_args = trl.SFTConfig(output_dir=str(tmp_path / "b"), per_device_train_batch_size=1, max_steps=1,
                             learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", max_length=None)
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(61)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                               pad_token="t0", eos_token="t1")  # offline, no hub
    sft = longpack_trainer_class(trl.SFTTrainer)(model=sft_model, args=sft_args, train_dataset=ds, callbacks=[grab2],
                                                 processing_class=tok, longpack=cfg)
    sft.train()
    for name, g in grab.grads.items():
        assert float((grab2.grads[name] - g).norm() / g.norm()) <= RTOL, name


def _example(out_dir, *launcher):
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py")
    args = [script, "--steps", "3", "--output-dir", str(out_dir)]
    cmd = [*launcher, *args] if launcher else [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        # torchrun's own traceback fills the tail; the failing worker's message comes before it
        lines = proc.stderr.splitlines()
        cause = [ln for ln in lines if re.search(r"Error|error|terminate|what\(\)|Abort|abort", ln)]
        raise AssertionError("\n".join(cause[:40]) + "\n--- tail ---\n" + proc.stderr[-1500:])
    return [float(x) for x in re.findall(r"\{'loss': '([0-9.]+)'", proc.stdout + proc.stderr)]


def test_hf_example_one_and_two_processes_train_the_same_losses(tmp_path):
    """The example under python and under torchrun with 2 CPU processes (gloo): the same samples per step and the
    exact global token mean give the same loss curve."""
    import shutil
    import sys
    from pathlib import Path

    single = _example(tmp_path / "one")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    # --standalone: the rendezvous takes a free port, not the fixed 29500 another job on the machine may hold
    double = _example(tmp_path / "two", torchrun, "--standalone", "--nproc-per-node", "2")
    assert len(single) == 3 and single == pytest.approx(double, rel=1e-3)
