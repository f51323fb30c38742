"""Pre-tokenized rows straight from Arrow columns (Parquet record batches, a ``datasets`` table): no Python object
per row or per token. ``input_ids`` (+ ``labels`` or a 0/1 mask column) are list columns; their values and
lengths become numpy arrays, are checked vectorized (ids >= 0, labels a token id or -100, a mask of 0/1, equal
lengths) and shifted into per-position targets within each row. Cost: a few passes of numpy over the batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import IGNORE, RowBatch
from .check import RowError

__all__ = ["arrow_rows"]

_I32 = np.iinfo(np.int32).max


def arrow_rows(table: Any, base: int, mask_column: str | None) -> RowBatch:
    """Rows of an Arrow table or record batch whose record 0 is the source's record ``base``."""
    names = set(table.schema.names)
    ids, n, null = _list(table.column("input_ids"), "input_ids", base)
    if null.any():
        raise RowError(base + int(np.argmax(null)), "input_ids must be a list of integers, got None")
    rows = np.repeat(np.arange(n.size), n)  # each token's row in the batch
    _check_range(ids, rows, base, "input_ids", lo=0)
    labelled = np.zeros(n.size, bool)
    kinds: dict[str, int] = {}
    values = ids.copy()
    if "labels" in names:
        lab, ln, lnull = _list(table.column("labels"), "labels", base)
        labelled = ~lnull
        _same(ln[labelled], n[labelled], np.flatnonzero(labelled), base, "labels")
        into = np.repeat(labelled, n)
        values[into] = lab
        bad = (lab < 0) & (lab != IGNORE)
        if bad.any():
            raise RowError(base + int(rows[into][np.argmax(bad)]), f"labels holds {int(lab[bad][0])}; a label is a "
                                                                     "token id, or -100 for no target")
        _check_range(lab, rows[into], base, "labels", lo=IGNORE)
        if labelled.any():
            kinds["labels"] = base + int(np.argmax(labelled))
    rest = ~labelled & (n > 0)
    if rest.any() and mask_column is not None:
        if mask_column not in names:
            raise RowError(base + int(np.argmax(rest)), f"no {mask_column!r} column (--mask-column); name an "
                                                        "existing 0/1 column")
        mask, mn, mnull = _list(table.column(mask_column), mask_column, base)
        if (mnull & rest).any():
            raise RowError(base + int(np.argmax(mnull & rest)), f"no {mask_column!r} column (--mask-column); name "
                                                                "an existing 0/1 column")
        _same(mn[rest], n[rest], np.flatnonzero(rest), base, mask_column)
        into = np.repeat(rest, n)
        sel = np.repeat(rest[~mnull], mn[~mnull])  # the mask values of the rows that use them
        m = mask[sel]
        if ((m != 0) & (m != 1)).any():
            raise RowError(base + int(rows[into][np.argmax((m != 0) & (m != 1))]), f"{mask_column} must hold only "
                                                                                   "0 and 1")
        values[into] = np.where(m.astype(bool), ids[into], IGNORE)
        kinds[mask_column] = base + int(np.argmax(rest))
    elif rest.any():
        kinds["input_ids"] = base + int(np.argmax(rest))
    targets = _shift(values, n)
    kept = n > 0
    empty = (base + np.flatnonzero(~kept)).tolist()
    return RowBatch(ids.astype(np.int32), targets, n[kept].astype(np.int64), base + np.flatnonzero(kept), empty,
                    kinds)


def _list(col: Any, name: str, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values int64, lengths per row, null rows) of an Arrow list-of-integers column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    listy = pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)
    if not listy or not pa.types.is_integer(arr.type.value_type):
        raise RowError(base, f"{name} must be a list of integers, got the column type {arr.type}")
    null = arr.is_null().to_numpy(zero_copy_only=False)
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr)
    if flat.null_count:
        at = int(np.argmax(flat.is_null().to_numpy(zero_copy_only=False)))
        row = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        raise RowError(base + row, f"{name} holds a null; every entry must be an integer")
    return flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False), lengths, null


def _same(got: np.ndarray, want: np.ndarray, rows: np.ndarray, base: int, name: str) -> None:
    bad = got != want
    if bad.any():
        k = int(np.argmax(bad))
        raise RowError(base + int(rows[k]), f"{name} has {int(got[k])} entries but input_ids has {int(want[k])}; they "
                                            "must match")


def _check_range(values: np.ndarray, rows: np.ndarray, base: int, name: str, lo: int) -> None:
    if not values.size:
        return
    if values.min() < lo:
        k = int(np.argmax(values < lo))
        raise RowError(base + int(rows[k]), f"{name} holds {int(values[k])}; token ids must be >= 0")
    if values.max() > _I32:
        k = int(np.argmax(values > _I32))
        raise RowError(base + int(rows[k]), f"{name} holds {int(values[k])}, beyond any vocabulary")


def _shift(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-position targets: position t takes values[t + 1] within its row; a row's last position none."""
    out = np.full(values.size, IGNORE, np.int32)
    if values.size:
        out[:-1] = values[1:]
        out[np.cumsum(lengths)[lengths > 0] - 1] = IGNORE
        out[out < 0] = IGNORE
    return out
