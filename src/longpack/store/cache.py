"""The token store's cache: built once per (data, tokenizer, options), then mapped by every process that reads it.

Where: ``--cache-dir``, else ``$LONGPACK_CACHE_DIR``, else a folder ``.longpack-cache`` beside the data, else (that
folder not writable) ``~/.cache/longpack``. Each store is a folder ``NAME-KEY`` in it; KEY is a SHA-256 of

* the data's bytes (a dataset folder's files in order; the digest is remembered with the file's size, mtime and
  inode, so an unchanged file is not read again),
* the tokenizer's files (tokenizer*, vocab*, merges*, special/added tokens, chat template) and the transformers
  and tokenizers versions, when a tokenizer is given,
* the options that change tokens or targets (``--mask-column``) and the store's format.

A changed file, tokenizer or option makes a new folder; old ones stay until removed (``rm -r`` the cache folder
clears it). Processes that need the same store take a lock (``fcntl.flock`` on ``NAME-KEY.lock``): the first one
builds (into ``NAME-KEY.tmp-PID``, renamed when complete), the others wait, then map the finished folder. On one
machine that is one build for all its processes; on a shared filesystem with working locks, one for the job.
``$LONGPACK_DATA_TRACE``, when set, names a file that gets one JSON line per store built or mapped (process id,
event, folder): how tests count the reads.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..sources import SourceError, load_tokenizer
from .arrays import FORMAT, TokenStore
from .build import build
from .encode import Encoder
from .read import DataSource

__all__ = ["cache_root", "open_or_build", "store_key"]

_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template", "spiece")


def cache_root(src: DataSource, cache_dir: str | None, say: Callable[[str], None] | None) -> Path:
    """The folder stores of ``src`` go in (module docstring), made and checked writable."""
    chosen = cache_dir or os.environ.get("LONGPACK_CACHE_DIR")
    if chosen:
        root = Path(chosen)
        if not _writable(root):
            raise SourceError(f"--cache-dir {chosen}: cannot write there; give a writable folder")
        return root
    beside = src.path.parent / ".longpack-cache"
    if _writable(beside):
        return beside
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longpack"
    if not _writable(home):
        raise SourceError(f"{src.name}: no writable folder for its token store (tried {beside} and {home}); give "
                          "--cache-dir DIR")
    if say is not None:
        say(f"{beside} is not writable: the token store goes to {home}")
    return home


def store_key(src: DataSource, root: Path, tokenizer: Any, mask_column: str | None) -> str:
    """SHA-256 (hex) of what the store's contents depend on (module docstring)."""
    parts: dict[str, Any] = {"format": FORMAT, "data": _content_digest(src, root), "mask_column": mask_column}
    if tokenizer is not None:
        parts["tokenizer"] = _tokenizer_digest(tokenizer)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def open_or_build(src: DataSource, *, tokenizer: Any, mask_column: str | None, cache_dir: str | None,
                  num_proc: int, say: Callable[[str], None] | None) -> tuple[TokenStore, dict[str, Any]]:
    """The store of ``src`` from the cache, built first if missing; and what happened (``from_cache``, path,
    seconds), said in one line through ``say``."""
    t0 = time.perf_counter()
    if isinstance(tokenizer, (str, Path)) and not Path(tokenizer).is_dir():
        load_tokenizer(str(tokenizer))  # its one line: no such folder
    root = cache_root(src, cache_dir, say)
    key = store_key(src, root, tokenizer, mask_column)
    folder = root / f"{src.path.name}-{key[:16]}"
    store = _open(folder)
    built = False
    if store is None:
        with _locked(root / f"{folder.name}.lock", folder, say):
            store = _open(folder)  # another process may have built it while this one waited
            if store is None:
                store, built = _build(src, folder, tokenizer, mask_column, num_proc), True
    _trace("build" if built else "map", folder)
    status = {"path": str(folder), "from_cache": not built, "seconds": round(time.perf_counter() - t0, 3),
              "rows": int(store.meta["rows"]), "tokens": int(store.meta["tokens"])}
    if say is not None:
        if built:
            say(f"tokenized {store.meta['records']:,} rows of {src.path.name} ({store.meta['tokens']:,} tokens) in "
                f"{store.meta['seconds']:.1f} s on {num_proc} processes; cached in {folder}")
        else:
            say(f"tokenized rows from cache {folder} ({store.meta['records']:,} rows, {store.meta['tokens']:,} "
                f"tokens, built {store.meta['built']}) in {status['seconds']:.2f} s")
    return store, status


def _build(src: DataSource, folder: Path, tokenizer: Any, mask_column: str | None, num_proc: int) -> TokenStore:
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(str(tokenizer))
    try:
        build(src, tmp, Encoder(mask_column, tokenizer), num_proc)
        os.rename(tmp, folder)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise SourceError(f"{folder.parent}: cannot write the token store ({exc.strerror}); free some space "
                              "there or give --cache-dir DIR on another disk") from None
        raise SourceError(f"{exc.filename or src.name}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    store = _open(folder)
    assert store is not None
    return store


def _open(folder: Path) -> TokenStore | None:
    if not (folder / "meta.json").is_file():
        return None
    try:
        return TokenStore.open(folder)
    except (ValueError, OSError, KeyError):  # an older format or a damaged folder: built again beside it
        shutil.rmtree(folder, ignore_errors=True)
        return None


class _locked:
    """An exclusive flock on ``path`` for the block; waiting for it is said once."""

    def __init__(self, path: Path, folder: Path, say: Callable[[str], None] | None) -> None:
        self.path, self.folder, self.say = path, folder, say

    def __enter__(self) -> None:
        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.say is not None:
                self.say(f"waiting for another process to build the token store {self.folder}")
            fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _content_digest(src: DataSource, root: Path) -> str:
    """SHA-256 of the data's bytes, remembered beside the stores with the files' size, mtime and inode."""
    files = src.files()
    stamp = [[str(p.relative_to(src.path)) if p != src.path else p.name, *_stat(p)] for p in files]
    memo = root / f".{src.path.name}-{hashlib.sha256(str(src.path.resolve()).encode()).hexdigest()[:16]}.stat"
    try:
        seen = json.loads(memo.read_text())
        if seen["stamp"] == stamp:
            return str(seen["digest"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for entry, p in zip(stamp, files, strict=True):
        h.update(str(entry[0]).encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    digest = h.hexdigest()
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"stamp": stamp, "digest": digest}))
    os.replace(tmp, memo)
    return digest


def _stat(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _tokenizer_digest(tok: Any) -> str:
    """The tokenizer's files (never a checkpoint's weights beside them) and the libraries that apply them;
    ``tok``: its folder, or a tokenizer object."""
    from importlib.metadata import version  # not the packages themselves: importing transformers takes seconds

    h = hashlib.sha256(f"{version('transformers')} {version('tokenizers')}".encode())
    folder = Path(tok if isinstance(tok, (str, Path)) else str(getattr(tok, "name_or_path", "") or ""))
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(_TOKENIZER_FILES)
                   ) if folder.is_dir() else []
    if not files:  # a tokenizer object with no folder behind it: what it holds
        h.update(json.dumps({"template": getattr(tok, "chat_template", None), "vocab": sorted(tok.get_vocab().items())},
                            sort_keys=True, default=str).encode())
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return True
    except OSError:
        return False


def _trace(event: str, folder: Path) -> None:
    path = os.environ.get("LONGPACK_DATA_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "folder": str(folder)}) + "\n")
