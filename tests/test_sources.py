"""Loading lengths from real-data formats, and refusing bad data with a line that names the record."""

import json

import numpy as np
import pytest

from longpack.sources import SourceError, check_lengths, load_lengths


def test_text_npy_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("5\n\n7\n")
    np.save(tmp_path / "b.npy", np.array([3, 4]))
    (tmp_path / "c.jsonl").write_text('{"length": 9}\n{"input_ids": [1, 2, 3]}\n\n{"text": "a b c d"}\n')
    assert load_lengths(tmp_path / "a.txt").tolist() == [5, 7]
    assert load_lengths(tmp_path / "b.npy").tolist() == [3, 4]
    assert load_lengths(tmp_path / "c.jsonl", tokenizer=str.split).tolist() == [9, 3, 4]


def test_parquet_length_ids_and_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"length": [4, 8]}), tmp_path / "l.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2], [3, 4, 5]]}), tmp_path / "i.parquet")
    pq.write_table(pa.table({"text": ["x y", "x"]}), tmp_path / "t.parquet")
    assert load_lengths(tmp_path / "l.parquet").tolist() == [4, 8]
    assert load_lengths(tmp_path / "i.parquet").tolist() == [2, 3]
    assert load_lengths(tmp_path / "t.parquet", tokenizer=str.split).tolist() == [2, 1]


def test_hf_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"input_ids": [[1] * 5, [1] * 2]}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"length": [11]})}).save_to_disk(str(tmp_path / "dd"))
    assert load_lengths(tmp_path / "ds").tolist() == [5, 2]
    assert load_lengths(tmp_path / "dd").tolist() == [11]


@pytest.mark.parametrize("values,match", [
    ([], "no samples"),
    ([3, 0, 2], "sample 1 has length 0"),
    ([3, -4], "sample 1 has length -4"),
    ([1.0, float("nan")], "sample 1 has length nan"),
    ([2.5], "whole token counts"),
])
def test_bad_lengths_name_the_sample(values, match):
    with pytest.raises(SourceError, match=match):
        check_lengths(values, "src")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"length": 3}) + "\n{oops\n")
    with pytest.raises(SourceError, match=r"bad.jsonl:2: malformed JSON line"):
        load_lengths(f)


def test_missing_column_and_text_without_tokenizer(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"foo": 1}\n')
    with pytest.raises(SourceError, match="x.jsonl:1: none of the columns"):
        load_lengths(f)
    f.write_text('{"text": "hello"}\n')
    with pytest.raises(SourceError, match="pass --tokenizer"):
        load_lengths(f)


def test_text_file_with_a_word(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("4\nfour\n")
    with pytest.raises(SourceError, match="x.txt:2: 'four' is not an integer"):
        load_lengths(f)
