"""The columnar token store (src/longpack/store/): rows read, checked and tokenized once, cached, mapped by every
process; targets equal to transformers' assistant mask; errors that name the file and line before anything is
tokenized; rows with no target counted and left out."""

import json
import os

import forked
import numpy as np
import pool  # tests/pool.py: warm worker processes
import pytest

transformers = pytest.importorskip("transformers")

from longpack.rows import IGNORE, load_rows, shift_mask  # noqa: E402
from longpack.sources import SourceError  # noqa: E402
from longpack.store.chat import CHATML  # noqa: E402

WORDS = ["the", "model", "learns", "from", "long", "rows", "naïve", "café", "数据", "训练", "🙂", "ok", "yes", "no",
         "tokens", "pack", "über", "straße", "x", "?"]


def _text(rng, n):
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE (multi-byte characters split over several tokens) with a ChatML {% generation %}
    template, trained offline and saved as any Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_text(rng, 30) for _ in range(300)), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("bpe") / "tok"
    fast.save_pretrained(path)
    return path


def _chats(path, n, seed=0, extra=()):
    """``n`` conversations of 1-3 exchanges (a system prompt in some, an empty assistant turn in one), then
    ``extra`` lines as given."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        msgs = [{"role": "system", "content": _text(rng, 5)}] if i % 4 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            msgs += [{"role": "user", "content": _text(rng, int(rng.integers(1, 12)))},
                     {"role": "assistant", "content": "" if i == 3 else _text(rng, int(rng.integers(1, 20)))}]
        lines.append(json.dumps({"messages": msgs}, ensure_ascii=False))
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


@pytest.mark.parametrize("num_proc", [1, 2])
def test_parity_hf_chat_targets_equal_the_templates_assistant_mask(tmp_path, bpe, num_proc):
    """With a {% generation %} template the rows' ids and targets are transformers' own:
    apply_chat_template(..., return_assistant_tokens_mask=True), each mask shifted to next-token targets."""
    path = _chats(tmp_path / "chats.jsonl", 80)
    rows = load_rows(path, tokenizer=str(bpe), num_proc=num_proc, cache_dir=str(tmp_path / "cache"))
    tok = transformers.AutoTokenizer.from_pretrained(bpe)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows.ids) == len(recs) and rows.rows.tolist() == list(range(len(recs)))
    split = 0
    for i, rec in enumerate(recs):
        hf = tok.apply_chat_template(rec["messages"], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = np.array(hf["input_ids"]), np.array(hf["assistant_masks"])
        assert rows.ids[i].tolist() == ids.tolist()
        assert rows.targets[i].tolist() == shift_mask(ids, mask).tolist()
        split += len(ids) > len(tok(rec["messages"][-1]["content"])["input_ids"])
    assert split  # the check ran over real conversations, multi-byte characters included
    assert rows.describe()["targets_from"] == "assistant turns"


def test_prefix_method_finds_the_assistant_turns_without_generation_marks(tmp_path, bpe):
    """A template without {% generation %} (the prefix method): assistant turn i spans from the tokens of the
    conversation before it with the generation prompt to those of the conversation through it; here that is
    its content, its end marker and the newline the template writes after the turn."""
    plain = tmp_path / "plain"
    tok = transformers.AutoTokenizer.from_pretrained(bpe)
    tok.chat_template = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.save_pretrained(plain)
    path = _chats(tmp_path / "chats.jsonl", 30)
    rows = load_rows(path, tokenizer=str(plain), cache_dir=str(tmp_path / "c"))

    def n_tokens(msgs, prompt):
        return len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt, return_dict=False))

    for i, line in enumerate(path.read_text().splitlines()):
        msgs = json.loads(line)["messages"]
        ids = np.array(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
        mask = np.zeros(ids.size, int)
        for t, m in enumerate(msgs):
            if m["role"] == "assistant":
                mask[n_tokens(msgs[:t], True) if t else 3:n_tokens(msgs[: t + 1], False)] = 1
        assert rows.ids[i].tolist() == ids.tolist() and rows.targets[i].tolist() == shift_mask(ids, mask).tolist()


def _trace(tmp_path, monkeypatch):
    log = tmp_path / "trace.jsonl"
    monkeypatch.setenv("LONGPACK_DATA_TRACE", str(log))
    return lambda: [json.loads(x)["event"] for x in log.read_text().splitlines()] if log.exists() else []


def test_cache_is_reused_and_rebuilt_when_the_file_tokenizer_or_an_option_changes(tmp_path, bpe, monkeypatch):
    events = _trace(tmp_path, monkeypatch)
    path = _chats(tmp_path / "chats.jsonl", 20)
    first = load_rows(path, tokenizer=str(bpe))
    assert (tmp_path / ".longpack-cache").is_dir() and not first.status["from_cache"]  # beside the data
    again = load_rows(path, tokenizer=str(bpe))
    assert again.status["from_cache"] and again.digest() == first.digest() and events() == ["build", "map"]
    # 1. the file's content changes (one more row)
    _chats(path, 21)
    changed = load_rows(path, tokenizer=str(bpe))
    assert not changed.status["from_cache"] and len(changed.ids) == 21
    # 2. the tokenizer changes (its chat template gets a system default)
    other = tmp_path / "tok2"
    tok = transformers.AutoTokenizer.from_pretrained(bpe)
    tok.chat_template = CHATML.replace("{% for message", "{{ 'SYS' }}{% for message")
    tok.save_pretrained(other)
    retok = load_rows(path, tokenizer=str(other))
    assert not retok.status["from_cache"] and retok.digest() != changed.digest()
    # 3. an option that changes the targets (--mask-column) on pre-tokenized rows
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": [1, 2, 3, 4], "m": [0, 1, 1, 0]}) + "\n" for _ in range(3)))
    plain, masked = load_rows(ids), load_rows(ids, mask_column="m")
    assert not masked.status["from_cache"] and masked.targets[0].tolist() == [2, 3, IGNORE, IGNORE]
    assert plain.targets[0].tolist() == [2, 3, 4, IGNORE]
    assert load_rows(ids, mask_column="m").status["from_cache"]
    assert events() == ["build", "map", "build", "build", "build", "build", "map"]


def test_a_malformed_line_late_in_the_file_is_named_before_anything_is_tokenized(tmp_path, bpe, monkeypatch):
    from longpack.store.encode import Encoder

    calls = []
    real = Encoder.encode
    monkeypatch.setattr(Encoder, "encode", lambda self, recs: calls.append(len(recs)) or real(self, recs))
    bad = '{"messages": [{"role": "user", "content": "a\tb"}]}'  # a raw tab inside a JSON string
    path = _chats(tmp_path / "chats.jsonl", 3000, extra=[bad])
    with pytest.raises(SourceError) as err:
        load_rows(path, tokenizer=str(bpe), num_proc=1)
    assert str(err.value).startswith(f"{path}:3001: malformed JSON line (Invalid control character at column ")
    assert str(err.value).endswith("; fix or remove that line")  # said whole, not cut mid-sentence
    assert calls == []  # the first pass named it: no row was tokenized
    path.write_text(path.read_text().replace(bad, '{"messages": "hi"}'))
    with pytest.raises(SourceError, match=r"chats.jsonl:3001: messages must be a list of"):
        load_rows(path, tokenizer=str(bpe), num_proc=1)
    assert calls == []


def test_a_template_error_names_the_file_and_line(tmp_path, bpe):
    tool = json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]})
    path = _chats(tmp_path / "chats.jsonl", 500, extra=[tool])
    for n in (1, 2):
        with pytest.raises(SourceError) as err:
            load_rows(path, tokenizer=str(bpe), num_proc=n, cache_dir=str(tmp_path / f"c{n}"))
        assert str(err.value) == f"{path}:501: the chat template refused the row: Unknown role: tool"
    assert not list((tmp_path / "c2").glob("*.tmp-*"))  # a failed build leaves nothing behind


def test_rows_with_no_target_are_counted_located_and_left_out(tmp_path, bpe):
    from longpack import jobs
    from longpack.runtime.run.accounting import data_report
    from longpack.runtime.run.run_plan import plan_stream
    from longpack.runtime.run.train_args import TrainArgs

    user_only = json.dumps({"messages": [{"role": "user", "content": "is anyone there"}]})
    path = tmp_path / "chats.jsonl"
    _chats(path, 6, extra=[user_only, "", user_only])
    rows = load_rows(path, tokenizer=str(bpe))
    d = rows.describe()
    assert len(rows.ids) == 6 and d["rows"] == 9 and d["rows_without_target"] == 2 and d["empty_dropped"] == 1
    assert d["untargeted_at"] == [f"{path}:7", f"{path}:9"] and d["untargeted_dropped"] == 2
    kept = load_rows(path, tokenizer=str(bpe), keep_untargeted=True)
    assert len(kept.ids) == 8 and kept.describe()["untargeted_dropped"] == 0 and kept.digest() != rows.digest()
    args = TrainArgs.of(data=str(path), tokenizer=str(bpe), run=jobs.RunSpec(model="tiny-llama", hardware="cpu",
                                                                          token_cap=512, global_batch=4))
    stream, _ = plan_stream(args, 1, rows, note=None)
    line = data_report(stream.plan, rows)["line"]
    assert f"2 rows have no target (no assistant turn): {path}:7, {path}:9 — left out" in line
    assert "1 empty rows left out" in line and len(stream.plan.lengths) == 6


def test_rows_that_mix_labels_with_rows_without_are_refused_naming_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    recs = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5, 6], "labels": [-100, 5, 6]},
            {"input_ids": [7, 8, 9]}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(SourceError, match=r"r.jsonl:3: no labels, while other rows have them \(the first: .*"
                                          r"r.jsonl:1\)"):
        load_rows(tmp_path / "r.jsonl")
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "r.parquet")
    with pytest.raises(SourceError, match=r"r.parquet row 2: no labels, while other rows have them"):
        load_rows(tmp_path / "r.parquet")


def test_parquet_is_read_in_record_batches_into_the_same_store_as_jsonl(tmp_path):
    """Parquet of several row groups (and a dataset folder) gives the JSONL store's digest, read a batch at a
    time: never a whole table of Python lists."""
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    from longpack.store import read

    rng = np.random.default_rng(1)
    recs = []
    for i in range(5000):
        ids = rng.integers(0, 500, 0 if i % 997 == 5 else int(rng.integers(1, 60))).tolist()
        recs.append({"input_ids": ids, "labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2:]})
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "r.parquet", row_group_size=700)
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "r_disk"))
    log = tmp_path / "batches"  # the batches are read in a forked reading process: it appends their sizes here
    real = read.DataSource.batches

    def logged(self, cols, size=read.ARROW_BATCH):
        for a, b in real(self, cols, size):
            with open(log, "a") as f:
                f.write(f"{b.num_rows} {os.getpid()}\n")
            yield a, b

    read.DataSource.batches = logged
    try:
        got = [load_rows(tmp_path / n, cache_dir=str(tmp_path / "c")) for n in ("r.jsonl", "r.parquet", "r_disk")]
    finally:
        read.DataSource.batches = real
    seen = [int(x.split()[0]) for x in log.read_text().splitlines()]
    assert os.getpid() not in {int(x.split()[1]) for x in log.read_text().splitlines()}  # never in this process
    assert got[0].digest() == got[1].digest() == got[2].digest() and got[0].empty == got[1].empty == got[2].empty
    assert max(seen) <= read.ARROW_BATCH and sum(seen) == 2 * len(recs)
    assert got[1].where(got[1].empty[0]) == f"{tmp_path / 'r.parquet'} row {got[1].empty[0]}"


def _tiny_model(path):
    import torch

    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_two_processes_read_the_store_once_the_launcher_builds_and_the_ranks_map(tmp_path, bpe):
    """`--nproc 2`: the launcher builds the store; the ranks, forked from it, use its mapping (the same pages)
    and its plan: the data is read once in the whole run."""
    path = _chats(tmp_path / "chats.jsonl", 40, extra=[json.dumps({"messages": [{"role": "user", "content": "?"}]})])
    model = _tiny_model(tmp_path / "tiny")
    env = {**os.environ, "LONGPACK_DATA_TRACE": str(tmp_path / "trace.jsonl")}
    proc = forked.run(["train", "--data", str(path), "--tokenizer", str(bpe), "--model-path", str(model), "--nproc",
                       "2", "--steps", "1", "--global-batch", "8", "--token-cap", "256"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trace = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [t["event"] for t in trace] == ["build"]  # once: no rank opened or read the data again
    assert proc.stderr.count("tokenized 41 rows of chats.jsonl") == 1 and "from cache" not in proc.stderr
    assert f"1 rows have no target (no assistant turn): {path}:41 — left out" in proc.stdout


def test_under_torchrun_one_rank_builds_while_the_other_waits(tmp_path, bpe):
    """Under torchrun (no launcher): the first rank to take the store's lock builds it, the other maps it."""
    path = _chats(tmp_path / "chats.jsonl", 40)
    model = _tiny_model(tmp_path / "tiny")
    trace = tmp_path / "trace.jsonl"
    proc = pool.cli(["train", "--data", path, "--tokenizer", bpe, "--model-path", model, "--nproc", "2", "--steps",
                     "1", "--global-batch", "8", "--token-cap", "256"], env={"LONGPACK_DATA_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(json.loads(x)["event"] for x in trace.read_text().splitlines()) == ["build", "map"]


def test_the_reading_process_passes_items_and_names_its_errors(tmp_path):
    """Arrow batches are read in a forked process (store/build._from_child): its items arrive in order; a bad row
    keeps its record; any other error, or the process dying, is one line naming the source."""
    from longpack.store import build
    from longpack.store.check import RowError
    from longpack.store.read import DataSource

    src = DataSource(tmp_path / "rows.parquet", "parquet")
    assert list(build._from_child(lambda: iter(range(5)), src)) == [0, 1, 2, 3, 4]

    def bad_row():
        yield 1
        raise RowError(7, "labels holds -5")

    got = []
    with pytest.raises(RowError) as row:
        got.extend(build._from_child(bad_row, src))
    assert got == [1] and (row.value.record, row.value.message) == (7, "labels holds -5")

    def broken():
        raise OSError("Couldn't deserialize thrift: TProtocolException: Invalid data\nmore")
        yield

    with pytest.raises(SourceError, match=r"rows.parquet: reading failed: OSError: Couldn't deserialize thrift"):
        list(build._from_child(broken, src))
    with pytest.raises(SourceError, match="ended at exit code 3 without a word"):
        list(build._from_child(lambda: (os._exit(3) for _ in [0]), src))
