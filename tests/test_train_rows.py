"""`longpack train` on a user's rows and checkpoint: a tiny Llama written by transformers' save_pretrained and a
JSONL of prompt-masked rows train on 2 processes (FSDP2, unified plan, a chunk chain) to the per-step loss and final
weights of plain unpacked training with transformers, in float64; the output loads with from_pretrained."""

import json

import forked
import numpy as np
import pool  # tests/pool.py: warm worker processes
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from longpack.planners import global_batches  # noqa: E402
from longpack.rows import IGNORE, load_rows  # noqa: E402

LR = 1e-3
STEPS, BATCH = 4, 6


def _checkpoint(path):
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(cfg).double().save_pretrained(path)
    return path


def _rows(path, n=24, all_masked=False, seed=3):
    """Rows of 3-60 tokens (one of 150: a chain under a 64-token cap) whose first third is a masked prompt."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 61, n)
    lengths[5] = 150
    with open(path, "w") as f:
        for n_tok in lengths.tolist():
            ids = rng.integers(1, 67, n_tok).tolist()
            prompt = n_tok if all_masked else n_tok // 3
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]}) + "\n")
    return path


def _train(*args, pooled=True):
    """``longpack train ARGS`` on the warm pool, or (``pooled=False``) as its own command with its launcher."""
    if pooled:
        return pool.cli(["train", *args], timeout=600)
    return forked.run(["train", *args], timeout=600)  # tests/forked.py: a real process, without the start-up


def _torch_cosine(opt, warmup):
    """torch's own schedulers, built here: linear warmup from lr/(warmup+1), then cosine to 0 at the last step."""
    from torch.optim import lr_scheduler as sched

    warm = sched.LinearLR(opt, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    decay = sched.CosineAnnealingLR(opt, T_max=STEPS - warmup - 1, eta_min=0.0)
    return sched.SequentialLR(opt, [warm, decay], milestones=[warmup])


def _plain_loss(model, rows_path):
    """The exact mean loss of ``model`` over the rows' targets (no gradient)."""
    rows = [json.loads(x) for x in open(rows_path)]
    total = sum(int((np.array(r["labels"][1:]) != IGNORE).sum()) for r in rows)
    with torch.no_grad():
        return sum(float(torch.nn.functional.cross_entropy(
            model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0][:-1],
            torch.tensor(r["labels"][1:]), ignore_index=IGNORE, reduction="sum")) for r in rows) / total


def _plain_training(model_dir, rows_path, warmup=None, max_norm=None, eval_rows=None):
    """transformers alone: every row unpacked, its own labels, the step's real targets averaged, AdamW; with
    ``warmup``, torch's warmup + cosine schedule; with ``max_norm``, torch's clip_grad_norm_."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                              attn_implementation="sdpa")
    model.train()
    rows = [json.loads(x) for x in open(rows_path)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = _torch_cosine(opt, warmup) if warmup is not None else None
    losses, lrs, norms, evals = [], [], [], []
    for batch in global_batches(len(rows), BATCH, seed=0, steps=STEPS):
        total = sum(int((np.array(rows[i]["labels"][1:]) != IGNORE).sum()) for i in batch)
        loss = torch.zeros((), dtype=torch.float64)
        for i in batch.tolist():
            ids, labels = torch.tensor([rows[i]["input_ids"]]), torch.tensor(rows[i]["labels"])
            logits = model(input_ids=ids, use_cache=False).logits[0]
            loss = loss + torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE,
                                                            reduction="sum") / max(total, 1)
        loss.backward()
        lrs.append(opt.param_groups[0]["lr"])
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if eval_rows is not None:
            evals.append(_plain_loss(model, eval_rows))
    return losses, model.state_dict(), lrs, norms, evals


def _run_longpack(tmp_path, rows, *flags):
    out = tmp_path / "out"
    proc = _train("--data", str(rows), "--model-path", str(tmp_path / "tiny"), "--output-dir", str(out),
                  "--planner", "unified", "--nproc", "2", "--steps", str(STEPS), "--global-batch", str(BATCH),
                  "--token-cap", "64", "--dtype", "float64", "--lr", str(LR), "--json", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "step" in x], next(x["data"] for x in lines if "data" in x), out


def test_hf_parity_fsdp_chunk_train_rows_and_checkpoint(tmp_path):
    """Also the run around the plan: torch's warmup + cosine schedule (the logged lr per step equals it), the
    global gradient norm over both FSDP2 ranks' shards (equal to torch's clip_grad_norm_ on the unpacked model,
    clipping at 0.5, below every step's norm) and the held-out loss every 2 steps."""
    _checkpoint(tmp_path / "tiny")
    rows = _rows(tmp_path / "rows.jsonl")
    held = _rows(tmp_path / "eval.jsonl", n=6, seed=9)
    steps, data, out = _run_longpack(tmp_path, rows, "--lr-scheduler", "cosine", "--warmup-steps", "2",
                                     "--max-grad-norm", "0.5", "--eval-data", str(held), "--eval-every", "2")
    ref_losses, ref_state, ref_lrs, ref_norms, ref_evals = _plain_training(tmp_path / "tiny", rows, warmup=2,
                                                                           max_norm=0.5, eval_rows=held)
    # the held-out loss after steps 2 and 4, on the engine (FSDP2, a chain among the held-out rows too)
    assert [s.get("eval_loss") for s in steps] == [None, pytest.approx(ref_evals[1], rel=1e-6), None,
                                                   pytest.approx(ref_evals[3], rel=1e-6)]
    assert data["split_samples"] >= 1 and data["rows"]["targets_from"] == "labels"
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert min(ref_norms) > 0.5 and ref_lrs[-1] == 0.0 and max(ref_lrs) == LR  # clipped, warmed up, decayed
    for s, ref, lr, norm in zip(steps, ref_losses, ref_lrs, ref_norms, strict=True):
        assert s["loss"] == pytest.approx(ref, rel=1e-6)
        assert s["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15)
        assert s["grad_norm"] == pytest.approx(norm, rel=1e-6)
    trained = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    got = trained.state_dict()
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float64).state_dict()
    err = max(float((got[k] - v).abs().max()) for k, v in ref_state.items())
    moved = max(float((v - start[k]).abs().max()) for k, v in ref_state.items())
    print(f"weights after {STEPS} steps: max |longpack - plain| = {err:.2e}, max move {moved:.2e}")
    assert got.keys() == ref_state.keys() and err <= 1e-8
    assert moved > 1e-4  # the weights really moved in 4 steps


def test_all_labels_masked_is_refused_in_one_line_before_training(tmp_path):
    _checkpoint(tmp_path / "tiny")
    rows = _rows(tmp_path / "rows.jsonl", all_masked=True)
    proc = _train("--data", str(rows), "--model-path", str(tmp_path / "tiny"), "--nproc", "2", "--steps", "1",
                  pooled=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("longpack: error:")]
    assert len(lines) == 1 and "no row has a target" in lines[0] and "Traceback" not in proc.stderr


def test_labels_and_completion_mask_give_the_same_targets(tmp_path):
    """A prompt-masked row trains only its completion, whether the mask comes as labels or as a 0/1 column."""
    ids = [5, 6, 7, 8, 9]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"input_ids": ids, "labels": [IGNORE, IGNORE, 7, 8, 9]}) + "\n")
    b.write_text(json.dumps({"input_ids": ids, "completion_mask": [0, 0, 1, 1, 1]}) + "\n")
    ra, rb = load_rows(a), load_rows(b, mask_column="completion_mask")
    assert ra.next_targets(0, 5).tolist() == rb.next_targets(0, 5).tolist() == [IGNORE, 7, 8, 9, IGNORE]
    assert ra.target_count(0, 5) == 3 and ra.target_count(0, 3) == 1  # truncated to 3 tokens: 6 -> 7 only


def _tokenizer(path):
    """A word-level tokenizer with a chat template, built offline and saved like any Hugging Face tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|", "|>", "user", "assistant", "end", "hi", "there", "hello", "you", "how", "are"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    fast.save_pretrained(path)
    return path


def test_chat_rows_train_on_assistant_turns_only(tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    chat = tmp_path / "chat.jsonl"
    convo = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"},
             {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "hi"}]
    chat.write_text(json.dumps({"messages": convo}) + "\n" + json.dumps({"messages": convo[:2]}) + "\n")
    rows = load_rows(chat, tokenizer=str(tok))
    words = transformers.AutoTokenizer.from_pretrained(tok).convert_ids_to_tokens(rows.ids[0].tolist())
    targets = [words[t + 1] for t, x in enumerate(rows.next_targets(0, len(words)).tolist()) if x != IGNORE]
    # each assistant turn's content and its end marker, nothing of the user turns or the role headers
    assert targets == ["hello", "you", "<|", "end", "|>", "hi", "<|", "end", "|>"]
    _checkpoint(tmp_path / "tiny")
    proc = _train("--data", str(chat), "--tokenizer", str(tok), "--model-path", str(tmp_path / "tiny"),
                  "--output-dir", str(tmp_path / "out"), "--steps", "1", "--global-batch", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = next(json.loads(x)["data"] for x in proc.stdout.splitlines() if x.startswith('{"data"'))
    assert data["trained_targets"] == 9 + 5 and data["rows"]["targets_from"] == "assistant turns"
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    transformers.AutoTokenizer.from_pretrained(tmp_path / "out")


def test_train_counts_empty_dropped_and_truncated_rows(tmp_path):
    _checkpoint(tmp_path / "tiny")
    rows = tmp_path / "rows.jsonl"
    lines = [{"input_ids": list(range(1, n + 1))} for n in (5, 0, 50, 8, 60, 9)]
    rows.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--data", str(rows), "--model-path", str(tmp_path / "tiny"), "--max-len", "40", "--global-batch", "5"]
    for policy, key in (("drop", "dropped"), ("truncate", "truncated")):
        proc = _train(*common, "--overlong", policy, "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        data = next(json.loads(x)["data"] for x in proc.stdout.splitlines() if x.startswith('{"data"'))
        assert data["empty_rows_dropped"] == 1 and data["rows"]["empty_rows"] == [1]
        assert data[f"{key}_samples"] == 2
        assert data[f"{key}_tokens"] == (50 + 60 if policy == "drop" else 10 + 20)
        assert data["trained_tokens"] == data["tokens"] - data[f"{key}_tokens"]
        steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')]
        assert sum(s["tokens"] for s in steps) == data["trained_tokens"]
    text = _train(*common, "--overlong", "drop")
    assert "2 dropped (110 tokens)" in text.stdout and "1 empty rows left out of the plan" in text.stdout


def test_rows_read_alike_from_jsonl_parquet_and_save_to_disk(tmp_path):
    import datasets

    recs = [{"input_ids": [5, 6, 7, 8], "labels": [IGNORE, 6, 7, 8]}, {"input_ids": [9, 10], "labels": [9, 10]},
            {"input_ids": [], "labels": []}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    datasets.Dataset.from_list(recs).to_parquet(str(tmp_path / "r.parquet"))
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "r_disk"))
    got = [load_rows(tmp_path / name) for name in ("r.jsonl", "r.parquet", "r_disk")]
    for rows in got:
        assert [a.tolist() for a in rows.ids] == [[5, 6, 7, 8], [9, 10]] and rows.empty == [2]
        assert [t.tolist() for t in rows.targets] == [[6, 7, 8, IGNORE], [10, IGNORE]]
