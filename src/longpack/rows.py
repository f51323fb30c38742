"""Tokenized SFT rows with their targets: what ``longpack train --data`` trains on (numpy only, no torch).

A row is ``input_ids`` plus where its loss is, one of:

* ``labels`` (same length, -100 = no target), as transformers and TRL write them: the target of position t is
  ``labels[t + 1]`` (the model shifts);
* a 0/1 mask column (``mask_column``, e.g. TRL's ``completion_mask`` or ``assistant_masks``): position t predicts
  ``input_ids[t + 1]`` where ``mask[t + 1] == 1``;
* neither: every next token is a target.

Or ``messages`` (a chat: a list of {"role", "content"}) or ``text``, tokenized with a local tokenizer: a chat
through the tokenizer's chat template with targets on the assistant turns only (each turn's span is found from
the template applied to the conversation up to it, which must be a prefix of the whole), a text on every token.

Formats: JSONL, Parquet, or a folder written by ``datasets.save_to_disk``. Every bad row raises
:class:`~longpack.sources.SourceError` naming the row, the value and the fix. Empty rows cannot be planned; they are
kept out of the plan and counted (``empty``), never dropped silently.

``targets[i]`` is row i's next-token target per position (``IGNORE`` where none; the last position has none).
Cost: one pass over the file; memory O(tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .sources import SourceError, _hf_records, _jsonl_records, load_tokenizer

__all__ = ["IGNORE", "TokenRows", "load_rows", "rows_from_records", "shift_labels", "shift_mask"]

IGNORE = -100


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


@dataclass
class TokenRows:
    """Rows ready to plan and train: sample i is ``ids[i]`` with ``targets[i]``; ``rows[i]`` its row in the file."""

    ids: list[np.ndarray]
    targets: list[np.ndarray]
    rows: list[int]
    source: str
    empty: list[int] = field(default_factory=list)
    target_kind: str = "all"

    @property
    def lengths(self) -> np.ndarray:
        return np.array([a.size for a in self.ids], dtype=np.int64)

    def tokens(self, sample: int, n: int) -> np.ndarray:
        """The first ``n`` token ids of ``sample`` (n < its length when the plan truncated it)."""
        return self.ids[sample][:n]

    def next_targets(self, sample: int, n: int) -> np.ndarray:
        """Per-position targets of the first ``n`` tokens (position n − 1 predicts nothing)."""
        t = self.targets[sample][:n].copy()
        if n:
            t[n - 1] = IGNORE
        return t

    def target_count(self, sample: int, n: int) -> int:
        return int((self.next_targets(sample, n) != IGNORE).sum())

    def digest(self) -> str:
        """SHA-256 (16 hex digits) of every sample's token ids and targets in order: what a resumed run must train
        on again. Streamed row by row (no copy of the data); ~1 s per 10^8 tokens."""
        h = hashlib.sha256()
        for ids, targets in zip(self.ids, self.targets, strict=True):
            h.update(np.int64(ids.size).tobytes())
            h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(targets, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def where(self, record: int) -> str:
        """Record ``record`` (0-based, blank lines counted) as the file names it: ``rows.jsonl:LINE`` (1-based)
        for JSONL, ``SOURCE row N`` (0-based, as Parquet and ``datasets`` index) otherwise."""
        return f"{self.source}:{record + 1}" if self.source.endswith(".jsonl") else f"{self.source} row {record}"

    def located(self, exc: ValueError) -> ValueError:
        """``exc`` naming its sample by row (``rows.jsonl:16``) where it names one by index (``sample 14``)."""
        sample = getattr(exc, "sample", None)
        if sample is None or not 0 <= sample < len(self.rows):
            return exc
        return type(exc)(str(exc).replace(f"sample {sample}", self.where(self.rows[sample]), 1), sample)

    def describe(self) -> dict[str, Any]:
        counts = [int((t != IGNORE).sum()) for t in self.targets]
        return {"source": self.source, "rows": len(self.ids) + len(self.empty), "planned": len(self.ids),
                "empty_dropped": len(self.empty), "empty_rows": self.empty[:20],
                "empty_at": [self.where(i) for i in self.empty[:5]], "tokens": int(self.lengths.sum()),
                "targets": int(sum(counts)), "rows_without_target": int(sum(1 for c in counts if c == 0)),
                "targets_from": self.target_kind}


Tokenizer = Any  # a transformers tokenizer (local folder), used for text and messages rows


def load_rows(path: str | Path, *, mask_column: str | None = None, tokenizer: str | Tokenizer | None = None,
              vocab: int | None = None) -> TokenRows:
    """Read rows from JSONL, Parquet or a ``save_to_disk`` folder (see the module docstring); ``vocab``: refuse
    token ids and labels outside it."""
    p = Path(path)
    if not p.exists():
        raise SourceError(f"--data {path}: no such file or folder")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if p.is_dir():
        records: Iterable[tuple[str, dict]] = _hf_records(p)
    elif p.suffix == ".jsonl":
        records = _jsonl_records(p, blanks=True)  # a blank line is an empty row: counted, not skipped
    elif p.suffix == ".parquet":
        records = _parquet_records(p)
    else:
        raise SourceError(f"--data {path}: expected a .jsonl or .parquet file or a save_to_disk folder")
    return rows_from_records(records, str(p), mask_column=mask_column, tokenizer=tok, what=f"--data {path}",
                             vocab=vocab)


def rows_from_records(records: Iterable[tuple[str, dict]], source: str, *, mask_column: str | None = None,
                      tokenizer: Tokenizer | None = None, what: str | None = None, vocab: int | None = None
                      ) -> TokenRows:
    """:class:`TokenRows` of ``(where, record)`` pairs (a file's rows, or a ``datasets.Dataset``'s): targets as in
    the module docstring, empty rows left out and counted; ``what`` names the data in the error when none is left;
    ``vocab``: a token id or label outside it is refused, naming the row."""
    out = TokenRows(ids=[], targets=[], rows=[], source=source)
    kinds = set()
    for i, (where, rec) in enumerate(records):
        if rec is None:
            out.empty.append(i)
            continue
        ids, targets, kind = _row(rec, where, mask_column, tokenizer)
        kinds.add(kind)
        if vocab is not None and ids.size and max(int(ids.max()), int(targets.max())) >= vocab:
            column, top = ("input_ids", int(ids.max())) if ids.max() >= vocab else (kind, int(targets.max()))
            raise SourceError(f"{where}: {column} holds {top}, outside the model's vocabulary of {vocab}; tokenize "
                              "with the model's own tokenizer")
        if ids.size == 0:
            out.empty.append(i)
            continue
        out.ids.append(ids)
        out.targets.append(targets)
        out.rows.append(i)
    if not out.ids:
        raise SourceError(f"{what or source}: no non-empty rows ({len(out.empty)} empty); nothing to train")
    out.target_kind = "+".join(sorted(kinds))
    if not any((t != IGNORE).any() for t in out.targets):
        raise SourceError(f"{what or source}: no row has a target (every label from {out.target_kind} is -100 or "
                          "masked); nothing to learn: check the labels or the mask column")
    return out


def _parquet_records(p: Path) -> Iterable[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{p}: reading Parquet needs pyarrow: pip install 'longpack[parquet]'") from None
    for i, rec in enumerate(pq.read_table(p).to_pylist()):
        yield f"{p} row {i}", rec


def _int_array(value: Any, where: str, column: str) -> np.ndarray:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise SourceError(f"{where}: {column} must be a list of integers, got {type(value).__name__}")
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise SourceError(f"{where}: {column} must be a flat list of integers (got {str(value)[:40]})")
    return arr.astype(np.int64)


def _row(rec: dict, where: str, mask_column: str | None, tok: Tokenizer | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(ids, per-position targets, where the targets came from) of one record."""
    if "input_ids" in rec:
        ids = _int_array(rec["input_ids"], where, "input_ids")
        if (ids < 0).any():
            raise SourceError(f"{where}: input_ids holds {int(ids.min())}; token ids must be >= 0")
        if rec.get("labels") is not None:
            labels = _int_array(rec["labels"], where, "labels")
            _same_length(labels, ids, where, "labels")
            if ((labels < 0) & (labels != IGNORE)).any():
                bad = int(labels[(labels < 0) & (labels != IGNORE)][0])
                raise SourceError(f"{where}: labels holds {bad}; a label is a token id, or -100 for no target")
            return ids, shift_labels(labels), "labels"
        if mask_column is not None:
            if rec.get(mask_column) is None:
                raise SourceError(f"{where}: no {mask_column!r} column (--mask-column); name an existing 0/1 column")
            mask = _int_array(rec[mask_column], where, mask_column)
            _same_length(mask, ids, where, mask_column)
            if ((mask != 0) & (mask != 1)).any():
                raise SourceError(f"{where}: {mask_column} must hold only 0 and 1")
            return ids, shift_mask(ids, mask), mask_column
        return ids, shift_labels(ids), "input_ids"
    if "messages" in rec or "text" in rec:
        if tok is None:
            col = "messages" if "messages" in rec else "text"
            raise SourceError(f"{where}: a {col!r} row needs --tokenizer DIR (a local tokenizer folder)")
        if "messages" in rec:
            ids, mask = _chat(rec["messages"], where, tok)
            return ids, shift_mask(ids, mask), "assistant turns"
        ids = np.asarray(tok(rec["text"])["input_ids"], dtype=np.int64)
        return ids, shift_labels(ids), "text"
    raise SourceError(f"{where}: no 'input_ids', 'messages' or 'text' column (has {sorted(rec)[:8]})")


def _same_length(a: np.ndarray, ids: np.ndarray, where: str, column: str) -> None:
    if a.size != ids.size:
        raise SourceError(f"{where}: {column} has {a.size} entries but input_ids has {ids.size}; they must match")


def _chat(messages: Any, where: str, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a conversation through the chat template, and a 0/1 mask of its assistant turns."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise SourceError(f"{where}: messages must be a list of {{'role', 'content'}} objects")
    if getattr(tok, "chat_template", None) is None:
        raise SourceError(f"{where}: the tokenizer has no chat template; give rows of input_ids or text instead")

    def ids_of(msgs: list[dict], prompt: bool) -> list[int]:
        out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt, return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    full = ids_of(messages, False)
    mask = np.zeros(len(full), dtype=np.int64)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, upto = len(ids_of(messages[:i], True)), ids_of(messages[: i + 1], False)
        if full[: len(upto)] != upto:
            raise SourceError(f"{where}: the chat template does not render turn {i} as a prefix of the whole "
                              "conversation; tokenize the rows yourself and give input_ids with labels")
        mask[start:len(upto)] = 1
    return np.asarray(full, dtype=np.int64), mask
