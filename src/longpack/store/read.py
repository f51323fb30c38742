"""Where rows come from: a JSONL file (read in byte ranges that end at line ends, so processes can share it), a
Parquet file or a ``datasets.save_to_disk`` folder (read as Arrow record batches, never whole).

Records are numbered from 0 in file order: a JSONL record is a line (blank lines counted, named ``FILE:LINE``,
1-based), a Parquet or dataset record a row (named ``SOURCE row N``, 0-based, as both index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sources import SourceError, saved_dataset
from .check import RowError

__all__ = ["DataSource", "data_source", "parse_line", "ARROW_BATCH"]

ARROW_BATCH = 2048  # rows per Arrow batch: memory stays a few MB whatever the table holds


@dataclass(frozen=True)
class DataSource:
    """A data file or folder, its format (``jsonl``, ``parquet`` or ``dataset``) and how its records are named."""

    path: Path
    fmt: str

    @property
    def name(self) -> str:
        return str(self.path)

    def where(self, record: int) -> str:
        return f"{self.path}:{record + 1}" if self.fmt == "jsonl" else f"{self.path} row {record}"

    def files(self) -> list[Path]:
        """The files whose bytes are the data (a dataset folder's, sorted)."""
        if self.fmt != "dataset":
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file() and not p.name.startswith("."))

    # --- JSONL -------------------------------------------------------------------------------------------------
    def chunks(self, target: int) -> list[tuple[int, int]]:
        """Byte ranges of about ``target`` bytes, each ending just after a newline (or at the end)."""
        size = self.path.stat().st_size
        cuts = [0]
        with open(self.path, "rb") as f:
            while cuts[-1] + target < size:
                f.seek(cuts[-1] + target)
                f.readline()
                if f.tell() >= size:
                    break
                cuts.append(f.tell())
        return list(zip(cuts, cuts[1:] + [size], strict=True)) if size else []

    def lines(self, start: int, stop: int) -> list[bytes]:
        """The lines of one byte range (their newlines removed)."""
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
        out = data.split(b"\n")
        return out[:-1] if data.endswith(b"\n") or not data else out

    # --- Arrow -------------------------------------------------------------------------------------------------
    def columns(self) -> list[str]:
        if self.fmt == "parquet":
            return list(_parquet(self.path).schema_arrow.names)
        return list(saved_dataset(self.path).column_names)

    def rows(self) -> int:
        if self.fmt == "parquet":
            return int(_parquet(self.path).metadata.num_rows)
        return len(saved_dataset(self.path))

    def batches(self, columns: list[str], size: int = ARROW_BATCH) -> Iterator[tuple[int, Any]]:
        """(first record, Arrow batch) of ``columns``, in order, ``size`` rows at a time."""
        base = 0
        if self.fmt == "parquet":
            it: Any = _parquet(self.path).iter_batches(batch_size=size, columns=columns, use_threads=False)
        else:
            files = _arrow_files(self.path)
            it = (_stream(files, columns, size) if files is not None else
                  saved_dataset(self.path).select_columns(columns).with_format("arrow").iter(batch_size=size))
        for batch in it:
            yield base, batch
            base += batch.num_rows


def data_source(path: str | Path, flag: str = "--data") -> DataSource:
    """The source at ``path``, or one line naming the flag, the path and what is accepted."""
    p = Path(path)
    if not p.exists():
        raise SourceError(f"{flag} {path}: no such file or folder")
    if p.is_dir():
        saved_dataset(p)  # a folder that is not a saved dataset is refused now, by name
        return DataSource(p, "dataset")
    if p.suffix == ".jsonl":
        return DataSource(p, "jsonl")
    if p.suffix == ".parquet":
        _parquet(p)
        return DataSource(p, "parquet")
    raise SourceError(f"{flag} {path}: expected a .jsonl or .parquet file or a save_to_disk folder")


def parse_line(line: bytes) -> dict | None:
    """A JSONL line's object (None for a blank line); RowError (record -1: the caller places it) otherwise."""
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except UnicodeDecodeError as exc:
        raise RowError(-1, f"not UTF-8 text (byte {exc.start} of the line); fix or remove that line") from None
    except json.JSONDecodeError as exc:
        raise RowError(-1, f"malformed JSON line ({exc.msg} column {exc.colno}); fix or remove that line") from None
    if not isinstance(rec, dict):
        raise RowError(-1, f"expected a JSON object per line, got {type(rec).__name__}")
    return rec


def _arrow_files(p: Path) -> list[Path] | None:
    """The Arrow stream files of a saved dataset's rows in order (a DatasetDict's train split, else its first),
    when they hold the rows as they are (no indices mapping); None otherwise."""
    try:
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
            p = p / ("train" if "train" in splits else splits[0])
        state = json.loads((p / "state.json").read_text())
        if state.get("_indices_data_files"):
            return None
        return [p / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _stream(files: list[Path], columns: list[str], size: int) -> Iterator[Any]:
    """Record batches of ``columns`` read from the files (not memory-mapped: only the batch in hand is resident),
    at most ``size`` rows each."""
    import pyarrow as pa

    for f in files:
        with pa.OSFile(str(f)) as src:
            for batch in pa.ipc.open_stream(src):
                batch = batch.select(columns)
                for a in range(0, batch.num_rows, size):
                    yield batch.slice(a, size)


def _parquet(p: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{p}: reading Parquet needs pyarrow: pip install 'longpack[parquet]'") from None
    try:
        # read, not mapped (the file's pages stay out of the RSS), and a column chunk streamed page by page rather
        # than read whole: 200,000 pre-tokenized rows peaked 403 MB over the interpreter whole, 150 MB streamed
        return pq.ParquetFile(p, memory_map=False, buffer_size=1 << 20, pre_buffer=False)
    except Exception as exc:  # noqa: BLE001  (pyarrow's own error types: a damaged or foreign file)
        raise SourceError(f"{p}: not a readable Parquet file ({str(exc).splitlines()[0][:120]})") from None
