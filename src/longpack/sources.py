"""Sequence lengths from real data: text, .npy, JSONL, Parquet and Hugging Face ``save_to_disk`` folders.

Each record gives its length one of three ways, tried in this order: a length column (default ``length``), a
column of token ids (default ``input_ids``, its length is the count), or a text column (default ``text``) run
through a tokenizer (any callable str -> list of ids, or an HF tokenizer path via :func:`hf_tokenizer`).

Bad input never passes silently: an empty source, a missing column, a malformed JSONL line, a zero, negative,
NaN or non-integer length each raise :class:`SourceError` naming the file, the record and the value. Long scans
show their progress (rows or MB of the total, the time left). Cost: one pass over the file; memory O(records)
for the lengths.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SourceError", "load_lengths", "check_lengths", "hf_tokenizer", "load_tokenizer"]

Tokenizer = Callable[[str], Sequence[int]]


class SourceError(ValueError):
    """Input that cannot become a list of positive integer lengths; the message names the record and the fix."""


def check_lengths(values: Any, source: str) -> np.ndarray:
    """Return ``values`` as int64 after checking they are a non-empty 1-D list of positive integers."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise SourceError(f"{source}: lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise SourceError(f"{source}: no samples (empty workload); give a file with at least one length")
    if arr.dtype.kind not in "iuf":
        raise SourceError(f"{source}: lengths must be numbers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise SourceError(f"{source}: sample {i} has length {arr[i].item()!r}; lengths must be whole token counts")
    bad = arr <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise SourceError(f"{source}: sample {i} has length {arr[i].item()!r}; every length must be >= 1 token "
                          "(remove empty samples first)")
    return arr.astype(np.int64)


def load_lengths(path: str | Path, *, column: str = "length", ids_column: str = "input_ids",
                 text_column: str = "text", tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Lengths from ``path``: .txt (one integer per line), .npy, .jsonl, .parquet, or a ``save_to_disk`` folder."""
    p = Path(path)
    if not p.exists():
        raise SourceError(f"{path}: no such file or folder")
    cols = (column, ids_column, text_column)
    if p.is_dir():
        values = _from_records(_hf_records(p), str(p), cols, tokenizer)
    elif p.suffix == ".npy":
        values = np.load(p, allow_pickle=False)
    elif p.suffix == ".jsonl":
        values = _from_records(((w, r) for w, r in _jsonl_records(p) if r is not None), str(p), cols, tokenizer)
    elif p.suffix == ".parquet":
        values = _parquet(p, cols, tokenizer)
    else:
        values = _text_lines(p)
    return check_lengths(values, str(p))


def _text_lines(p: Path) -> list[int]:
    out = []
    with p.open() as f:
        for i, line in enumerate(_progress(f, p, "lines"), start=1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(int(line))
            except ValueError:
                raise SourceError(f"{p}:{i}: {line[:40]!r} is not an integer length (one length per line)") from None
    return out


def _jsonl_records(p: Path, blanks: bool = False) -> Iterable[tuple[str, dict | None]]:
    """(``file:LINE``, object) per line; a blank line is skipped, or yields None with ``blanks``."""
    with p.open() as f:
        for i, line in enumerate(_progress(f, p, "lines"), start=1):
            if not line.strip():
                if blanks:
                    yield f"{p}:{i}", None
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"{p}:{i}: malformed JSON line ({exc.msg} column {exc.colno}); fix or remove that "
                                  "line") from None
            if not isinstance(rec, dict):
                raise SourceError(f"{p}:{i}: expected a JSON object per line, got {type(rec).__name__}")
            yield f"{p}:{i}", rec


def _from_records(records: Iterable[tuple[str, dict]], source: str, cols: tuple[str, str, str],
                  tokenizer: Tokenizer | None) -> list[Any]:
    out = []
    for where, rec in records:
        out.append(_record_length(rec, where, cols, tokenizer))
    if not out:
        raise SourceError(f"{source}: no samples (empty workload)")
    return out


def _record_length(rec: dict, where: str, cols: tuple[str, str, str], tokenizer: Tokenizer | None) -> Any:
    column, ids_column, text_column = cols
    if column in rec:
        value = rec[column]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SourceError(f"{where}: {column}={value!r} is not a number")
        return value
    if ids_column in rec:
        return len(rec[ids_column])
    if text_column in rec:
        if tokenizer is None:
            raise SourceError(f"{where}: only a {text_column!r} column; pass --tokenizer to count its tokens")
        return len(tokenizer(rec[text_column]))
    raise SourceError(f"{where}: none of the columns {column!r}, {ids_column!r}, {text_column!r}; "
                      "choose one with --column")


def _parquet(p: Path, cols: tuple[str, str, str], tokenizer: Tokenizer | None) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{p}: reading Parquet needs pyarrow: pip install 'longpack[parquet]'") from None
    names = pq.read_schema(p).names
    column, ids_column, text_column = cols
    if column in names:
        return pq.read_table(p, columns=[column]).column(column).to_numpy(zero_copy_only=False)
    if ids_column in names:
        import pyarrow.compute as pc

        return pc.list_value_length(pq.read_table(p, columns=[ids_column]).column(ids_column)).to_numpy()
    if text_column in names:
        texts = pq.read_table(p, columns=[text_column]).column(text_column).to_pylist()
        return _from_records(((f"{p} row {i}", {text_column: t}) for i, t in enumerate(texts)), str(p), cols,
                             tokenizer)
    raise SourceError(f"{p}: none of the columns {column!r}, {ids_column!r}, {text_column!r} (has {names})")


def saved_dataset(p: Path) -> Any:
    """The dataset a ``save_to_disk`` folder holds (memory-mapped Arrow files; a DatasetDict's train split, else its
    first), or one line naming the folder."""
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{p}: reading a save_to_disk folder needs datasets: pip install 'longpack[hf]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError as exc:
        raise SourceError(f"{p}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train" if "train" in ds else next(iter(ds))]
    return ds


def _hf_records(p: Path) -> Iterable[tuple[str, dict]]:
    ds = saved_dataset(p)
    for i, rec in enumerate(_progress(ds, p, "rows", total=len(ds))):
        yield f"{p} row {i}", rec


def _progress(it: Iterable, p: Path, unit: str, total: int | None = None) -> Iterable:
    """``it`` counted on a meter (progress.py: rows of the total, or MB of the file, with the time left; a bar on
    a terminal, a line now and then elsewhere; nothing for a scan that ends within seconds)."""
    from .progress import Meter

    if total is not None:
        meter = Meter(f"reading {p.name}", total, (unit,), unit)
        for x in it:
            yield x
            meter.tick()
        meter.close()
        return
    meter = Meter(f"reading {p.name}", max(1, p.stat().st_size >> 20), ("MB",), "MB")
    done = 0
    for x in it:
        yield x
        done += len(x)
        if done >= 1 << 20:
            meter.tick(done >> 20)
            done &= (1 << 20) - 1
    meter.close()


def load_tokenizer(name_or_path: str) -> Any:
    """A transformers tokenizer from a local folder (no downloads), or one line naming the folder and why."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SourceError("--tokenizer needs transformers: pip install 'longpack[hf]'") from None
    if not Path(name_or_path).is_dir():
        raise SourceError(f"--tokenizer {name_or_path!r}: no such folder; give a local folder with the tokenizer "
                          "files (tokenizer.json or tokenizer_config.json), e.g. the model's checkpoint folder")
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SourceError(f"--tokenizer {name_or_path!r}: cannot load it offline ({str(exc).splitlines()[0]})"
                          ) from None


def hf_tokenizer(name_or_path: str) -> Tokenizer:
    """An HF tokenizer from a local folder (no downloads) as a callable str -> ids."""
    tok = load_tokenizer(name_or_path)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]
