"""The columnar token store: every row of a data file as flat numpy arrays, on disk (memory-mapped) or in memory.

Arrays (``R`` rows with tokens, ``T`` tokens):

* ``ids`` int32 [T]: the rows' token ids, one after another; row r is ``ids[offsets[r]:offsets[r + 1]]``;
* ``targets``: per position, what it predicts — kind ``mask``: uint8 [T], 1 where position t predicts the next id
  of its row (``ids[t + 1]``); kind ``labels``: int32 [T], the target id or -100 (used only when some row's labels
  are not its own next ids, so most stores hold one byte per token here, not four);
* ``offsets`` int64 [R + 1], ``records`` int64 [R] (each row's record in the source: the 0-based line of a JSONL
  file, blank lines counted, or the row of a Parquet file or dataset), ``counts`` int64 [R] (targets per row);
* ``empty`` int64: records with no tokens (kept out of the store, counted).

``meta`` holds the source's name, how records are named, where targets came from, the largest id and label, and
``digest``: SHA-256 of the rows' lengths, ids and per-position targets, independent of how the rows were batched
while written. A store on disk is a folder of raw little-endian ``.bin`` files and ``.npy`` files with
``meta.json`` written last, so a folder with ``meta.json`` is complete. Opening one maps it: pages are shared by
every process that maps the same folder, and nothing is read until used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT", "IGNORE", "RowBatch", "TokenStore", "StoreWriter"]

FORMAT = 1  # bump when the files or their meaning change: older caches are then rebuilt, never misread
IGNORE = -100


@dataclass
class RowBatch:
    """Rows as a worker makes them: flat ``ids`` and per-position next-token ``targets`` (int32, -100 none; the
    last position of a row has none), ``lengths`` and source ``records`` per row, and ``empty`` records."""

    ids: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    records: np.ndarray
    empty: list[int] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)  # where targets came from -> first record of that kind

    @staticmethod
    def of(rows: list[tuple[int, np.ndarray, np.ndarray]], empty: list[int], kinds: dict[str, int]) -> RowBatch:
        """A batch of (record, ids, targets) rows with tokens."""
        if not rows:
            z = np.zeros(0, np.int32)
            return RowBatch(z, z.copy(), np.zeros(0, np.int64), np.zeros(0, np.int64), empty, kinds)
        return RowBatch(np.concatenate([r[1] for r in rows]).astype(np.int32, copy=False),
                        np.concatenate([r[2] for r in rows]).astype(np.int32, copy=False),
                        np.array([r[1].size for r in rows], np.int64), np.array([r[0] for r in rows], np.int64),
                        empty, kinds)

    def maskable(self) -> bool:
        """Whether every target is its position's next id (then one byte a token stores it)."""
        if self.ids.size == 0:
            return True
        nxt = np.empty_like(self.ids)
        nxt[:-1], nxt[-1] = self.ids[1:], -1
        has = self.targets != IGNORE
        return bool(np.array_equal(self.targets[has], nxt[has]))


@dataclass
class TokenStore:
    """The arrays of the module docstring and ``meta``; ``path`` is the folder when the store is on disk."""

    ids: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    records: np.ndarray
    counts: np.ndarray
    empty: np.ndarray
    meta: dict[str, Any]
    path: Path | None = None

    @property
    def kind(self) -> str:
        return str(self.meta["kind"])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, r: int, n: int | None = None) -> np.ndarray:
        """The first ``n`` ids of row ``r`` (all of them without ``n``), as int64."""
        a = int(self.offsets[r])
        b = int(self.offsets[r + 1]) if n is None else a + n
        return np.asarray(self.ids[a:b], dtype=np.int64)

    def next_targets(self, r: int, n: int | None = None) -> np.ndarray:
        """Per-position targets (int64, -100 none) of the first ``n`` positions of row ``r``; with ``n`` shorter
        than the row, position n - 1 keeps the target it has in the whole row (callers that cut a row clear it)."""
        a, end = int(self.offsets[r]), int(self.offsets[r + 1])
        b = end if n is None else a + n
        if self.kind == "labels":
            return np.asarray(self.targets[a:b], dtype=np.int64)
        nxt = np.asarray(self.ids[a + 1:min(b + 1, end)], dtype=np.int64)
        if nxt.size < b - a:
            nxt = np.concatenate([nxt, np.full(b - a - nxt.size, IGNORE, np.int64)])
        return np.where(self.targets[a:b].astype(bool), nxt, IGNORE)

    def first_above(self, vocab: int) -> tuple[int, str, int] | None:
        """(row, column, value) of the first id or label >= ``vocab``, or None; reads the ids only when the
        meta's maxima say one exists."""
        for column, top, arr in (("input_ids", "max_id", self.ids), ("labels", "max_label", self.targets)):
            if int(self.meta.get(top, -1)) < vocab or (column == "labels" and self.kind != "labels"):
                continue
            at = int(np.flatnonzero(np.asarray(arr) >= vocab)[0])
            return int(np.searchsorted(self.offsets, at, side="right")) - 1, column, int(arr[at])
        return None

    @classmethod
    def open(cls, folder: Path) -> TokenStore:
        """Map a complete store folder (see the module docstring)."""
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{folder}: a token store of format {meta.get('format')}, expected {FORMAT}")

        def raw(name: str, dtype: Any, n: int) -> np.ndarray:
            return np.memmap(folder / name, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)

        tokens = int(meta["tokens"])
        targets = raw("labels.bin", np.int32, tokens) if meta["kind"] == "labels" else raw("mask.bin", np.uint8,
                                                                                           tokens)
        return cls(raw("ids.bin", np.int32, tokens), targets, np.load(folder / "offsets.npy"),
                   np.load(folder / "records.npy"), np.load(folder / "counts.npy"), np.load(folder / "empty.npy"),
                   meta, folder)


class StoreWriter:
    """Appends :class:`RowBatch` es in order to a store folder (``folder``) or to memory (``folder=None``); the
    targets go as a mask until a batch needs labels, when what was written is converted once. Memory: the small
    per-row arrays and one batch."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.kind = "mask"
        self.parts: dict[str, list[np.ndarray]] = {"ids": [], "targets": []}  # in memory only
        self.lengths: list[np.ndarray] = []
        self.records: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.empty: list[int] = []
        self.kinds: dict[str, int] = {}
        self.tokens, self.max_id, self.max_label = 0, -1, -1
        self.hashes = [hashlib.sha256() for _ in range(3)]  # lengths, ids, targets: batching-independent
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self.files = {"ids": open(folder / "ids.bin", "wb"), "targets": open(folder / "mask.bin", "wb")}

    def add(self, batch: RowBatch) -> None:
        if self.kind == "mask" and not batch.maskable():
            self._to_labels()
        has = batch.targets != IGNORE
        self.lengths.append(batch.lengths)
        self.records.append(batch.records)
        self.counts.append(np.add.reduceat(has.astype(np.int64), _starts(batch.lengths)) if batch.lengths.size
                           else np.zeros(0, np.int64))
        self.empty.extend(batch.empty)
        for kind, rec in batch.kinds.items():
            self.kinds[kind] = min(rec, self.kinds.get(kind, rec))
        if batch.ids.size:
            self.max_id = max(self.max_id, int(batch.ids.max()))
            self.max_label = max(self.max_label, int(batch.targets.max()))
        self.tokens += int(batch.ids.size)
        for h, a in zip(self.hashes, (batch.lengths, batch.ids, batch.targets), strict=True):
            h.update(np.ascontiguousarray(a).tobytes())
        tgt = has.astype(np.uint8) if self.kind == "mask" else batch.targets
        self._write("ids", batch.ids)
        self._write("targets", tgt)

    def _write(self, name: str, a: np.ndarray) -> None:
        if self.folder is None:
            self.parts[name].append(a)
        else:
            self.files[name].write(np.ascontiguousarray(a).tobytes())

    def _to_labels(self) -> None:
        """Rewrite the mask written so far as labels (streamed in blocks when on disk)."""
        self.kind = "labels"
        if self.folder is None:
            ids = np.concatenate(self.parts["ids"]) if self.parts["ids"] else np.zeros(0, np.int32)
            mask = np.concatenate(self.parts["targets"]) if self.parts["targets"] else np.zeros(0, np.uint8)
            self.parts["targets"] = [_labels_of(ids, mask, None)]
            return
        for f in self.files.values():
            f.flush()
        out = open(self.folder / "labels.bin", "wb")
        if self.tokens:
            done_ids = np.memmap(self.folder / "ids.bin", np.int32, "r", shape=(self.tokens,))
            done_mask = np.memmap(self.folder / "mask.bin", np.uint8, "r", shape=(self.tokens,))
            for a in range(0, self.tokens, 1 << 24):
                b = min(a + (1 << 24), self.tokens)
                after = int(done_ids[b]) if b < self.tokens else None
                out.write(_labels_of(done_ids[a:b], done_mask[a:b], after).tobytes())
        self.files["targets"].close()
        os.remove(self.folder / "mask.bin")
        self.files["targets"] = out

    def finish(self, meta: dict[str, Any]) -> TokenStore:
        """The store, with ``meta`` completed (counts, maxima, digest) and, on disk, ``meta.json`` written last."""
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        records = np.concatenate(self.records) if self.records else np.zeros(0, np.int64)
        counts = np.concatenate(self.counts) if self.counts else np.zeros(0, np.int64)
        empty = np.array(sorted(self.empty), np.int64)
        digest = hashlib.sha256(b"".join(h.digest() for h in self.hashes)).hexdigest()
        meta = {**meta, "format": FORMAT, "kind": self.kind, "rows": int(lengths.size), "tokens": self.tokens,
                "targets": int(counts.sum()), "max_id": self.max_id, "max_label": self.max_label,
                "digest": digest, "kinds": self.kinds}
        if self.folder is None:
            cat = {k: np.concatenate(v) if v else np.zeros(0, np.int32 if k == "ids" else np.uint8)
                   for k, v in self.parts.items()}
            return TokenStore(cat["ids"], cat["targets"], offsets, records, counts, empty, meta)
        for f in self.files.values():
            f.close()
        for name, a in (("offsets", offsets), ("records", records), ("counts", counts), ("empty", empty)):
            np.save(self.folder / f"{name}.npy", a)
        (self.folder / "meta.json").write_text(json.dumps(meta))
        return TokenStore.open(self.folder)

    def close(self) -> None:
        """Close the files of a write that did not finish."""
        if self.folder is not None:
            for f in self.files.values():
                f.close()


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Start offset of each row within a batch (rows have >= 1 token, so reduceat's indices increase)."""
    out = np.zeros(lengths.size, np.int64)
    np.cumsum(lengths[:-1], out=out[1:])
    return out


def _labels_of(ids: np.ndarray, mask: np.ndarray, after: int | None) -> np.ndarray:
    """Per-position targets of a mask block: the next id where set (``after``: the id after the block)."""
    nxt = np.empty(ids.size, np.int32)
    if ids.size:
        nxt[:-1], nxt[-1] = ids[1:], -1 if after is None else after
    return np.where(mask.astype(bool), nxt, np.int32(IGNORE)).astype(np.int32)
