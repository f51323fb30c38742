"""The columnar token store: data rows read, checked and tokenized once, across the host's cores, into flat arrays
cached beside the data and memory-mapped by every process that trains on them (arrays: the store; read: the
formats; check: what a record must hold; chat and encode: records to token rows; columnar: pre-tokenized Arrow
columns; build: the passes and the pool; cache: where stores live and when they are rebuilt)."""

from .arrays import IGNORE, TokenStore
from .build import default_procs
from .cache import open_or_build

__all__ = ["IGNORE", "TokenStore", "default_procs", "open_or_build"]
