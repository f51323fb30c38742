"""Tokenized SFT rows with their targets: what ``longpack train --data`` and ``LongpackTrainer`` train on (numpy
only, no torch).

A row is ``input_ids`` plus where its loss is: ``labels`` (-100 = no target, as transformers and TRL write them), a
0/1 mask column (``--mask-column``, e.g. TRL's ``completion_mask``), or neither (every next token); or a chat
(``messages``, through the tokenizer's chat template, targets on the assistant's tokens) or a ``text``.

Rows are read once into a columnar token store (store/: flat token and target arrays, cached beside the data and
memory-mapped by every process), and :class:`TokenRows` is a view of it: sample i is a row with tokens and, unless
``keep_untargeted``, at least one target. Rows with no tokens (``empty``) and rows with no target
(``untargeted``, e.g. a chat without an assistant turn) are left out of the plan and counted, never dropped
silently. Every bad row raises :class:`~longpack.sources.SourceError` naming the file and line (or row).
``targets[i]`` is sample i's per-position next-token target (``IGNORE`` where none; the last position has none).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .sources import SourceError
from .store.arrays import IGNORE, StoreWriter, TokenStore
from .store.build import default_procs
from .store.cache import open_or_build
from .store.check import RowError, check_kinds
from .store.columnar import arrow_rows
from .store.encode import Encoder, shift_labels, shift_mask
from .store.read import data_source

__all__ = ["IGNORE", "TokenRows", "load_rows", "rows_from_records", "rows_from_dataset", "shift_labels",
           "shift_mask"]


class _Rows(Sequence):
    """A read-only list of arrays computed on access (the rows stay in the store)."""

    def __init__(self, n: int, get: Callable[[int], np.ndarray]) -> None:
        self.n, self.get = n, get

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.get(k) for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.get(i % self.n)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.get(k) for k in range(self.n))


class TokenRows:
    """The samples of a :class:`~longpack.store.arrays.TokenStore` (module docstring); ``rows[i]`` is sample i's
    record in the source, ``status`` what reading it took (from the cache or built, its folder)."""

    def __init__(self, store: TokenStore, source: str, *, keep_untargeted: bool = False,
                 status: dict[str, Any] | None = None) -> None:
        self.store, self.source, self.status = store, source, status or {}
        has = store.counts > 0
        self.sel = np.arange(has.size) if keep_untargeted else np.flatnonzero(has)
        self.rows = store.records[self.sel]
        self.empty: list[int] = store.empty.tolist()
        self.untargeted = store.records[~has]  # rows with tokens but no target
        self.keep_untargeted = keep_untargeted
        self.target_kind = "+".join(sorted(store.meta.get("kinds", {}))) or "none"
        self._lengths = store.lengths[self.sel]

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def ids(self) -> Sequence[np.ndarray]:
        return _Rows(self.sel.size, lambda i: self.store.row(int(self.sel[i])))

    @property
    def targets(self) -> Sequence[np.ndarray]:
        return _Rows(self.sel.size, lambda i: self.store.next_targets(int(self.sel[i])))

    def tokens(self, sample: int, n: int) -> np.ndarray:
        """The first ``n`` token ids of ``sample`` (n < its length when the plan truncated it)."""
        return self.store.row(int(self.sel[sample]), n)

    def next_targets(self, sample: int, n: int) -> np.ndarray:
        """Per-position targets of the first ``n`` tokens (position n - 1 predicts nothing)."""
        t = self.store.next_targets(int(self.sel[sample]), n)
        if n:
            t[n - 1] = IGNORE
        return t

    def target_count(self, sample: int, n: int) -> int:
        r = int(self.sel[sample])
        if n == int(self._lengths[sample]):
            return int(self.store.counts[r])
        return int((self.next_targets(sample, n) != IGNORE).sum())

    def digest(self) -> str:
        """SHA-256 (16 hex digits) of the samples' token ids and targets in order: what a resumed run must train on
        again (the store's digest and which of its rows are samples)."""
        h = hashlib.sha256(str(self.store.meta["digest"]).encode())
        h.update(np.ascontiguousarray(self.sel, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def where(self, record: int) -> str:
        """Record ``record`` (0-based, blank lines counted) as the file names it: ``rows.jsonl:LINE`` (1-based)
        for JSONL, ``SOURCE row N`` (0-based, as Parquet and ``datasets`` index) otherwise."""
        line = self.store.meta.get("naming") == "line"
        return f"{self.source}:{record + 1}" if line else f"{self.source} row {record}"

    def located(self, exc: ValueError) -> ValueError:
        """``exc`` naming its sample by row (``rows.jsonl:16``) where it names one by index (``sample 14``)."""
        sample = getattr(exc, "sample", None)
        if sample is None or not 0 <= sample < len(self.rows):
            return exc
        return type(exc)(str(exc).replace(f"sample {sample}", self.where(int(self.rows[sample])), 1), sample)

    def describe(self) -> dict[str, Any]:
        counts = self.store.counts
        left = 0 if self.keep_untargeted else int(self.untargeted.size)
        return {"source": self.source, "rows": int(self.store.meta.get("records", 0)), "planned": len(self.sel),
                "empty_dropped": len(self.empty), "empty_rows": self.empty[:20],
                "empty_at": [self.where(i) for i in self.empty[:5]], "tokens": int(self._lengths.sum()),
                "targets": int(counts[self.sel].sum()), "rows_without_target": int(self.untargeted.size),
                "untargeted_dropped": left, "untargeted_at": [self.where(int(i)) for i in self.untargeted[:5]],
                "targets_from": self.target_kind, "store": self.status}

    def check(self, what: str, vocab: int | None) -> TokenRows:
        """Refuse rows nothing can be trained on, and ids or labels outside ``vocab``; returns self."""
        if self.sel.size == 0:
            if self.untargeted.size:
                raise SourceError(f"{what}: no row has a target (every label from {self.target_kind} is -100 or "
                                  "masked); nothing to learn: check the labels or the mask column")
            raise SourceError(f"{what}: no non-empty rows ({len(self.empty)} empty); nothing to train")
        above = self.store.first_above(vocab) if vocab is not None else None
        if above is not None:
            row, column, value = above
            raise SourceError(f"{self.where(int(self.store.records[row]))}: {column} holds {value}, outside the "
                              f"model's vocabulary of {vocab}; tokenize with the model's own tokenizer")
        return self


Tokenizer = Any  # a transformers tokenizer (or its local folder), used for text and messages rows


def load_rows(path: str | Path, *, mask_column: str | None = None, tokenizer: str | Tokenizer | None = None,
              vocab: int | None = None, cache_dir: str | None = None, num_proc: int | None = None,
              keep_untargeted: bool = False, say: Callable[[str], None] | None = None,
              flag: str = "--data") -> TokenRows:
    """Read rows from JSONL, Parquet or a ``save_to_disk`` folder through the token store's cache (built on
    ``num_proc`` processes when missing, default every core); ``vocab``: refuse token ids and labels outside it;
    ``say``: where the line about the cache goes."""
    src = data_source(path, flag)
    store, status = open_or_build(src, tokenizer=tokenizer, mask_column=mask_column, cache_dir=cache_dir,
                                  num_proc=num_proc or default_procs(), say=say)
    return TokenRows(store, str(path), keep_untargeted=keep_untargeted, status=status).check(f"{flag} {path}",
                                                                                             vocab)


def rows_from_records(records: Iterable[tuple[str, dict | None]], source: str, *, mask_column: str | None = None,
                      tokenizer: Tokenizer | None = None, what: str | None = None, vocab: int | None = None,
                      keep_untargeted: bool = False) -> TokenRows:
    """:class:`TokenRows` of ``(where, record)`` pairs, in memory (records named ``SOURCE row N``)."""
    writer, enc = StoreWriter(None), Encoder(mask_column, tokenizer)
    batch: list[tuple[int, dict | None]] = []
    wheres: list[str] = []
    n = 0
    for where, rec in [*records, ("", "end")]:
        if rec != "end":
            batch.append((n, rec))  # type: ignore[arg-type]
            wheres.append(where)
            n += 1
        if len(batch) == 256 or (rec == "end" and batch):
            try:
                writer.add(enc.encode(batch))
            except RowError as exc:
                raise SourceError(f"{wheres[exc.record - batch[0][0]]}: {exc.message}") from None
            batch, wheres = [], []
    return _finish(writer, source, n, what, vocab, keep_untargeted)


def rows_from_dataset(dataset: Any, columns: list[str], source: str, *, mask_column: str | None = None,
                      vocab: int | None = None, keep_untargeted: bool = False) -> TokenRows:
    """:class:`TokenRows` of a ``datasets.Dataset``'s pre-tokenized ``columns``, read from its Arrow batches (no
    Python object per row), in memory."""
    writer = StoreWriter(None)
    try:
        for start in range(0, len(dataset), 4096):
            table = dataset.select_columns(columns).with_format("arrow")[start:start + 4096]
            writer.add(arrow_rows(table, start, mask_column))
    except RowError as exc:
        raise SourceError(f"{source} row {exc.record}: {exc.message}") from None
    return _finish(writer, source, len(dataset), None, vocab, keep_untargeted)


def _finish(writer: StoreWriter, source: str, records: int, what: str | None, vocab: int | None,
            keep_untargeted: bool) -> TokenRows:
    check_kinds(writer.kinds, lambda r: f"{source} row {r}")
    store = writer.finish({"source": source, "naming": "row", "records": records})
    return TokenRows(store, source, keep_untargeted=keep_untargeted).check(what or source, vocab)

