"""The shared case of the Hugging Face parity tests: a tiny float64 Qwen2, SFT rows with a masked prompt, the
LongpackTrainer under test and the plain unpacked ``transformers.Trainer`` it is compared with."""

from __future__ import annotations

import os
from typing import Any

import datasets
import numpy as np
import torch
import transformers

from longpack.hf import LongpackConfig, LongpackTrainer, longpack_trainer_class
from longpack.planners import global_batches

# long rows (70..120 tokens) exceed a rank's token cap of 64, so at CP 2 the plan shards them over the CP group
LENGTHS = [37, 5, 120, 12, 90, 17, 33, 3, 48, 110, 9, 26, 70, 14, 8, 100]
GLOBAL_BATCH = 8
STEPS = 2
TOKEN_CAP = 64
VOCAB = 61
LR = 1e-3


def model() -> Any:
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).double()


def rows() -> tuple[list[list[int]], list[list[int]]]:
    """(input_ids, completion_mask): the first third of each row is its prompt (no loss)."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    mask = [[0] * (n // 3) + [1] * (n - n // 3) for n in LENGTHS]
    return ids, mask


def labelled() -> datasets.Dataset:
    ids, mask = rows()
    labels = [[t if m else -100 for t, m in zip(r, k, strict=True)] for r, k in zip(ids, mask, strict=True)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})


def args(out: str, steps: int, ga: int = 1, **kw: Any) -> transformers.TrainingArguments:
    # HF_CASE_GPU=1 (bench/gpu.sh): the processes run on GPUs, where Accelerate applies FSDP2
    cpu = os.environ.get("HF_CASE_GPU", "0") != "1"
    return transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=ga,
                                          max_steps=steps, learning_rate=LR, report_to=[], use_cpu=cpu,
                                          logging_steps=1, dataloader_num_workers=0, seed=0, disable_tqdm=True,
                                          **({"save_strategy": "no"} | kw))


def config(cp: int) -> LongpackConfig:
    # at CP > 1 every step keeps the full degree, so the long rows are sharded over the group beside local ones
    return LongpackConfig(global_batch=GLOBAL_BATCH, token_cap=TOKEN_CAP, cp=cp,
                          options={"degrees": str(cp)} if cp > 1 else {})


def longpack_trainer(out: str, cp: int = 1, kind: str = "trainer", steps: int = STEPS, **kw: Any) -> Any:
    if kind == "trl":
        import trl

        ids, mask = rows()
        ds = datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": mask})
        sft = trl.SFTConfig(output_dir=out, per_device_train_batch_size=1, max_steps=steps, learning_rate=LR,
                            report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, max_length=None,
                            completion_only_loss=True, seed=0, disable_tqdm=True)
        return longpack_trainer_class(trl.SFTTrainer)(model=model(), args=sft, train_dataset=ds,
                                                      processing_class=tokenizer(), longpack=config(cp))
    extra: dict[str, Any] = {}
    if kind == "fsdp":  # Accelerate's FSDP2 (fsdp_version 2), one FSDP unit per decoder layer
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2,
                                                       "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}}
    return LongpackTrainer(model=model(), args=args(out, steps, **extra, **kw), train_dataset=labelled(),
                           longpack=config(cp))


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                                pad_token="t0", eos_token="t1")  # offline, no hub


class _InOrder(transformers.Trainer):
    """Plain Trainer reading the rows in the given order (the reference must see each step's rows)."""

    def _get_train_sampler(self, *a: Any, **k: Any) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)


def float64_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """transformers' causal-LM loss (shifted labels, -100 ignored, sum / items in the whole step), kept in float64:
    its built-in loss casts the logits to float32, which would cap the reference at float32 precision."""
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    target = labels[:, 1:].reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits, target.clamp_min(0), reduction="none") * (target != -100)
    return ce.sum() / num_items_in_batch


def plain(out: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain unpacked training of the same rows, step by step as the plan groups them: (losses, final weights)."""
    ds = labelled()
    order = np.concatenate(global_batches(len(ds), GLOBAL_BATCH, seed=0))
    ordered = ds.select(order.tolist())
    m = model()
    t = _InOrder(model=m, args=args(out, steps, ga=GLOBAL_BATCH), train_dataset=ordered,
                 compute_loss_func=float64_loss)
    t.train()
    losses = [x["loss"] for x in t.state.log_history if "loss" in x]
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}
