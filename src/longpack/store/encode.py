"""Records to rows of token ids and per-position targets (:class:`Encoder`), a batch at a time.

Targets, per record (store/check.py names the kinds): ``labels`` (-100 = none; position t predicts
``labels[t + 1]``, the model shifts), a 0/1 mask column (position t predicts ``input_ids[t + 1]`` where
``mask[t + 1]``), neither (every next token), a chat (the assistant's tokens, store/chat.py) or a text (every next
token, tokenized with the tokenizer's special tokens). A batch's chats are rendered and tokenized together, its
texts too. A record that cannot become a row raises :class:`RowError` with its index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import IGNORE, RowBatch
from .chat import ChatTemplate
from .check import CHAT, TEXT, RowError, check_record

__all__ = ["Encoder", "shift_labels", "shift_mask"]


def shift_labels(labels: np.ndarray) -> np.ndarray:
    """Per-position targets from HF-style labels: position t predicts labels[t + 1].

    >>> shift_labels(np.array([-100, -100, 7, 8])).tolist()
    [-100, 7, 8, -100]
    """
    out = np.full(labels.shape, IGNORE, dtype=np.int64)
    out[:-1] = labels[1:]
    out[out < 0] = IGNORE
    return out


def shift_mask(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per-position targets from a 0/1 mask over ``ids``: position t predicts ids[t + 1] where mask[t + 1].

    >>> shift_mask(np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1])).tolist()
    [-100, 7, 8, -100]
    """
    return shift_labels(np.where(mask.astype(bool), ids, IGNORE))


class Encoder:
    """Rows of a batch of ``(record, object)`` pairs (None: a blank line); ``tokenizer``: a transformers tokenizer
    for chats and texts, or None."""

    def __init__(self, mask_column: str | None = None, tokenizer: Any = None) -> None:
        self.mask_column, self.tok = mask_column, tokenizer
        self._chat: ChatTemplate | None = None

    def encode(self, recs: list[tuple[int, dict | None]]) -> RowBatch:
        rows: list[tuple[int, np.ndarray, np.ndarray] | None] = []
        empty: list[int] = []
        kinds: dict[str, int] = {}
        chats: list[tuple[int, int, list]] = []  # (slot in rows, record, messages)
        texts: list[tuple[int, int, str]] = []
        for record, rec in recs:
            if rec is None:
                empty.append(record)
                continue
            try:
                kind = check_record(rec, self.mask_column, self.tok is not None)
            except RowError as exc:
                raise RowError(record, exc.message) from None
            kinds.setdefault(kind, record)
            if kind == CHAT:
                chats.append((len(rows), record, rec["messages"]))
            elif kind == TEXT:
                texts.append((len(rows), record, rec["text"]))
            else:
                ids, targets = self._ids_row(rec, record)
                rows.append((record, ids, targets))
                continue
            rows.append(None)  # filled below, in the batch's order
        self._fill(rows, chats, self._chats)
        self._fill(rows, texts, self._texts)
        kept = []
        for r in rows:
            assert r is not None
            if r[1].size:
                kept.append(r)
            else:
                empty.append(r[0])
        return RowBatch.of(kept, sorted(empty), kinds)

    @staticmethod
    def _fill(rows: list, items: list[tuple[int, int, Any]], fn: Any) -> None:
        if not items:
            return
        try:
            made = fn([x for _, _, x in items])
        except RowError as exc:
            raise RowError(items[exc.record][1], exc.message) from None
        for (slot, record, _), (ids, targets) in zip(items, made, strict=True):
            rows[slot] = (record, ids, targets)

    def _chats(self, convs: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Chats as rows; an empty conversation is an empty row (the template never sees it)."""
        if self._chat is None:
            self._chat = ChatTemplate(self.tok)
        nonempty = [i for i, c in enumerate(convs) if c]
        try:
            made = self._chat.encode([convs[i] for i in nonempty]) if nonempty else []
        except RowError as exc:
            raise RowError(nonempty[exc.record], exc.message) from None
        none = (np.zeros(0, np.int32), np.zeros(0, np.int32))
        out = [none] * len(convs)
        for i, (ids, mask) in zip(nonempty, made, strict=True):
            out[i] = (ids, shift_mask(ids, mask).astype(np.int32))
        return out

    def _texts(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for k in range(0, len(texts), 64):
            for ids in self.tok(texts[k:k + 64], return_attention_mask=False)["input_ids"]:
                a = np.asarray(ids, dtype=np.int32)
                out.append((a, shift_labels(a).astype(np.int32)))
        return out

    def _ids_row(self, rec: dict, record: int) -> tuple[np.ndarray, np.ndarray]:
        ids = _ints(rec["input_ids"], record, "input_ids")
        if ids.size and ids.min() < 0:
            raise RowError(record, f"input_ids holds {int(ids.min())}; token ids must be >= 0")
        if rec.get("labels") is not None:
            labels = _ints(rec["labels"], record, "labels", ids.size)
            bad = (labels < 0) & (labels != IGNORE)
            if bad.any():
                raise RowError(record, f"labels holds {int(labels[bad][0])}; a label is a token id, or -100 for no "
                                       "target")
            return ids, shift_labels(labels).astype(np.int32)
        if self.mask_column is not None:
            mask = _ints(rec[self.mask_column], record, self.mask_column, ids.size)
            if ((mask != 0) & (mask != 1)).any():
                raise RowError(record, f"{self.mask_column} must hold only 0 and 1")
            return ids, shift_mask(ids, mask).astype(np.int32)
        return ids, shift_labels(ids).astype(np.int32)


def _ints(value: list, record: int, column: str, size: int | None = None) -> np.ndarray:
    """``value`` as a flat int32 array of ``size`` entries, or RowError naming the column."""
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged nesting
        arr = np.asarray([None])
    if arr.size == 0:
        arr = np.zeros(0, np.int64)
    elif arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise RowError(record, f"{column} must be a flat list of integers (got {str(value)[:40]})")
    if size is not None and arr.size != size:
        raise RowError(record, f"{column} has {arr.size} entries but input_ids has {size}; they must match")
    if arr.size and (arr.max() > np.iinfo(np.int32).max or arr.min() < np.iinfo(np.int32).min):
        raise RowError(record, f"{column} holds {int(arr.max())}, beyond any vocabulary")
    return arr.astype(np.int32)
