"""Building a token store from a data source, across the host's cores, in bounded memory.

JSONL, in two passes over byte ranges of the file that end at line ends, each range one task of a pool of
``num_proc`` forked processes:

1. **check**: every line parsed and its columns checked (store/check.py), lines counted; the first bad line in
   file order is named (``FILE:LINE: ...``) before anything is tokenized, and rows that mix labels with rows
   without them are refused;
2. **encode**: every range's records tokenized (store/encode.py) and sent back as arrays, written in file order
   (store/arrays.StoreWriter); at most ``2 x num_proc + 2`` ranges are in flight, so memory is the store's
   per-row arrays plus a few ranges.

Parquet files and ``datasets`` folders are read as Arrow batches: pre-tokenized columns become arrays in one
forked reading process (store/columnar.py) that sends them here a batch at a time, so that Arrow's buffers and
its allocator's cache never stay in this process (the launcher, whose memory every rank inherits); chats and
texts go to the pool a batch at a time. Progress: rows done of the total
with the rate and the time left, from this process only (progress.py: a bar on a terminal, a line now and then
elsewhere).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

from ..progress import Meter
from ..sources import SourceError
from .arrays import StoreWriter, TokenStore
from .check import RowError, check_kinds, check_record
from .columnar import arrow_rows
from .encode import Encoder
from .read import DataSource, parse_line

__all__ = ["build", "default_procs"]

_ENCODER: Encoder | None = None  # the pool's encoder: set before the fork, inherited by every worker


def default_procs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build(src: DataSource, folder: Path | None, encoder: Encoder, num_proc: int) -> TokenStore:
    """The store of ``src``'s rows, written to ``folder`` (None: in memory)."""
    global _ENCODER
    t0 = time.perf_counter()
    writer = StoreWriter(folder)
    _ENCODER = encoder
    try:
        records = (_jsonl if src.fmt == "jsonl" else _arrow)(src, writer, encoder, max(1, num_proc))
        check_kinds(writer.kinds, src.where)
        tok = getattr(encoder.tok, "name_or_path", None)
        return writer.finish({"source": src.name, "naming": "line" if src.fmt == "jsonl" else "row",
                              "records": records, "mask_column": encoder.mask_column, "tokenizer": tok,
                              "num_proc": num_proc, "seconds": time.perf_counter() - t0,
                              "built": time.strftime("%Y-%m-%d %H:%M:%S")})
    except BaseException:
        writer.close()
        raise
    finally:
        _ENCODER = None


def _jsonl(src: DataSource, writer: StoreWriter, encoder: Encoder, num_proc: int) -> int:
    size = src.path.stat().st_size
    chunks = src.chunks(int(min(4 << 20, max(1 << 20, size // (num_proc * 8)))))
    bases: list[int] = []
    kinds: dict[str, int] = {}
    total = 0
    meter = Meter(f"reading {src.path.name}", max(1, size >> 20), ("MB",), "MB")
    tasks = [(src, a, b, encoder.mask_column, encoder.tok is not None) for a, b in chunks]
    with closing(_parallel(_check_range, tasks, num_proc)) as results:
        for (a, b), (lines, bad, found) in zip(chunks, results, strict=True):
            if bad is not None:
                meter.close()
                raise SourceError(f"{src.where(total + bad.record)}: {bad.message}")
            for kind, rel in found.items():
                kinds.setdefault(kind, total + rel)
            bases.append(total)
            total += lines
            meter.tick((b >> 20) - (a >> 20))
    meter.close()
    check_kinds(kinds, src.where)
    meter = Meter(f"tokenizing {src.path.name}", total, ("rows",), "rows")
    tasks2 = [(src, a, b, base) for (a, b), base in zip(chunks, bases, strict=True)]
    _consume(_encode_range, tasks2, num_proc, writer, meter, [b2 - b1 for b1, b2 in zip(bases, bases[1:] + [total],
                                                                                       strict=True)], src)
    return total


def _arrow(src: DataSource, writer: StoreWriter, encoder: Encoder, num_proc: int) -> int:
    names = src.columns()
    total = src.rows()
    meter = Meter(f"reading {src.path.name}", total, ("rows",), "rows")
    if "input_ids" in names:
        cols = [c for c in ("input_ids", "labels", encoder.mask_column) if c and c in names]
        try:
            for n, rows in _from_child(lambda: ((b.num_rows, arrow_rows(b, base, encoder.mask_column))
                                                for base, b in src.batches(cols)), src):
                writer.add(rows)
                meter.tick(n)
        except RowError as exc:
            raise SourceError(f"{src.where(exc.record)}: {exc.message}") from None
        finally:
            meter.close()
        return total
    column = next((c for c in ("messages", "text") if c in names), None)
    if column is None:
        raise SourceError(f"{src.name}: no 'input_ids', 'messages' or 'text' column (has {names[:8]})")
    tasks = ([(base + i, r) for i, r in enumerate(batch.to_pylist())] for base, batch in src.batches([column], 256))
    _consume(_encode_records, tasks, num_proc, writer, meter, None, src)
    return total


def _consume(fn: Callable, tasks: Iterable, num_proc: int, writer: StoreWriter, meter: Meter,
             counts: list[int] | None, src: DataSource) -> None:
    """Run ``fn`` over ``tasks`` in the pool, writing each result in order and counting rows."""
    t0 = time.perf_counter()
    done = 0
    try:
        with closing(_parallel(fn, tasks, num_proc)) as results:
            for k, batch in enumerate(results):
                writer.add(batch)
                n = counts[k] if counts is not None else batch.lengths.size + len(batch.empty)
                done += n
                meter.hint = f"{done / max(1e-9, time.perf_counter() - t0):,.0f} rows/s"
                meter.tick(n)
    except RowError as exc:
        raise SourceError(f"{src.where(exc.record)}: {exc.message}") from None
    finally:
        meter.close()


def _check_range(task: tuple) -> tuple[int, RowError | None, dict[str, int]]:
    """Pass 1 over one byte range: (lines, the first bad line's error with its line in the range, kinds)."""
    src, a, b, mask_column, tokenizer = task
    lines = src.lines(a, b)
    kinds: dict[str, int] = {}
    for i, line in enumerate(lines):
        try:
            rec = parse_line(line)
            if rec is not None:
                kinds.setdefault(check_record(rec, mask_column, tokenizer), i)
        except RowError as exc:
            return len(lines), RowError(i, exc.message), kinds
    return len(lines), None, kinds


def _encode_range(task: tuple) -> Any:
    src, a, b, base = task
    assert _ENCODER is not None
    return _ENCODER.encode([(base + i, parse_line(line)) for i, line in enumerate(src.lines(a, b))])


def _encode_records(recs: list[tuple[int, dict | None]]) -> Any:
    assert _ENCODER is not None
    return _ENCODER.encode(recs)


def _quiet_worker() -> None:
    """A pool worker: Ctrl-C is the parent's to handle; the tokenizer runs on this process's one core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _can_fork() -> bool:
    """Whether this process may fork children: fork is available and it is not a daemonic worker of another
    pool."""
    return "fork" in multiprocessing.get_all_start_methods() and not multiprocessing.current_process().daemon


def _from_child(make: Callable[[], Iterable], src: DataSource) -> Generator:
    """The items of ``make()``, made in one forked process and sent here one at a time through a pipe (its
    buffer is the only backlog: the child waits while this process writes); a RowError in the child is raised
    here with its record, any other error as one SourceError line naming the source. Inline where fork is not
    available or in a daemonic process."""
    if not _can_fork():
        yield from make()
        return
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_produce, args=(make, send), daemon=True)
    proc.start()
    send.close()
    try:
        while True:
            try:
                kind, item = recv.recv()
            except EOFError:
                proc.join(10)  # its exit code, once the OS has it
                raise SourceError(f"{src.name}: the reading process ended at exit code {proc.exitcode} without "
                                  "a word (killed? out of memory?)") from None
            if kind == "end":
                return
            if kind == "row":
                raise RowError(*item)
            if kind == "error":
                raise SourceError(f"{src.name}: reading failed: {item}")
            yield item
    finally:
        recv.close()
        if proc.is_alive():
            proc.kill()
        proc.join()


def _produce(make: Callable[[], Iterable], send: Any) -> None:
    """The reading process of :func:`_from_child`: every item, then "end"; or the error that stopped it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for item in make():
            send.send(("item", item))
        send.send(("end", None))
    except RowError as exc:
        send.send(("row", (exc.record, exc.message)))
    except BaseException as exc:  # noqa: BLE001  (pyarrow's own errors too: the parent says it in one line)
        send.send(("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"))
    finally:
        send.close()


def _parallel(fn: Callable, tasks: Iterable, num_proc: int) -> Generator:
    """``fn`` over ``tasks``, results in order, on ``num_proc`` forked processes with at most ``2 num_proc + 2``
    tasks in flight (here, in order, with one process, where fork is not available, or in a daemonic process)."""
    one = isinstance(tasks, list) and len(tasks) <= 1  # a small file: no pool to start
    if num_proc <= 1 or one or not _can_fork():
        for t in tasks:
            yield fn(t)
        return
    end = object()
    with multiprocessing.get_context("fork").Pool(num_proc, initializer=_quiet_worker) as pool:
        it = iter(tasks)
        pending: deque = deque()

        def submit() -> None:
            t = next(it, end)
            if t is not end:
                pending.append(pool.apply_async(fn, (t,)))

        for _ in range(2 * num_proc + 2):
            submit()
        while pending:
            result = pending.popleft().get()
            submit()
            yield result
