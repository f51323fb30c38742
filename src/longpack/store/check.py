"""What a record must hold, checked without tokenizing: the first pass over a file, and the guard of every encoder.

A record is a JSON object (or an Arrow row) with one of: ``input_ids`` (a list; with ``labels``, a list of the same
length, or the ``--mask-column``), ``messages`` (a list of objects with a string ``role``), or ``text`` (a string).
:func:`check_record` returns the record's target kind (where its loss comes from) or raises :class:`RowError` with
a message that completes ``FILE:LINE: ...``. Element types (integers, 0/1) are checked while encoding, vectorized.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RowError", "check_record", "check_messages", "check_kinds", "kind_of", "CHAT", "TEXT"]

CHAT, TEXT = "assistant turns", "text"


class RowError(ValueError):
    """A record that cannot become a row: ``record`` (its 0-based index in the source) and the reason."""

    def __init__(self, record: int, message: str) -> None:
        super().__init__(message)
        self.record, self.message = record, message

    def __reduce__(self) -> tuple:  # pickled back from a worker process with both fields
        return (RowError, (self.record, self.message))


def check_messages(messages: Any) -> str | None:
    """Why ``messages`` is not a conversation (None when it is one)."""
    if not isinstance(messages, list):
        return f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role' (got {str(m)[:60]})"
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}"
    return None


def kind_of(rec: dict, mask_column: str | None) -> str:
    """Where a (checked) record's targets come from: labels, the mask column, every next token, chat or text."""
    if "input_ids" in rec:
        if rec.get("labels") is not None:
            return "labels"
        return mask_column if mask_column is not None else "input_ids"
    return CHAT if "messages" in rec else TEXT


def check_record(rec: Any, mask_column: str | None, tokenizer: bool) -> str:
    """The record's target kind (:func:`kind_of`); :class:`RowError` (record -1: the caller places it) if bad."""
    if not isinstance(rec, dict):
        raise RowError(-1, f"expected a JSON object per line, got {type(rec).__name__}")
    if "input_ids" in rec:
        for column in ("input_ids", "labels", mask_column):
            value = rec.get(column) if column else None
            if column == "input_ids" or value is not None:
                if isinstance(value, (str, bytes)) or not isinstance(value, list):
                    raise RowError(-1, f"{column} must be a list of integers, got {type(value).__name__}")
        if mask_column is not None and rec.get("labels") is None and rec.get(mask_column) is None:
            raise RowError(-1, f"no {mask_column!r} column (--mask-column); name an existing 0/1 column")
        return kind_of(rec, mask_column)
    if "messages" in rec or "text" in rec:
        col = "messages" if "messages" in rec else "text"
        if not tokenizer:
            raise RowError(-1, f"a {col!r} row needs --tokenizer DIR (a local tokenizer folder)")
        why = check_messages(rec["messages"]) if col == "messages" else (
            None if isinstance(rec["text"], str) else f"text must be a string, got {type(rec['text']).__name__}")
        if why:
            raise RowError(-1, why)
        return kind_of(rec, mask_column)
    raise RowError(-1, f"no 'input_ids', 'messages' or 'text' column (has {sorted(rec)[:8]})")


def check_kinds(kinds: dict[str, int], where: Any) -> None:
    """Refuse a file whose rows mix labels with rows that have none (those would train every next token):
    ``kinds`` maps each target kind to its first record, ``where`` names a record."""
    if "labels" in kinds and "input_ids" in kinds:
        from ..sources import SourceError

        raise SourceError(f"{where(kinds['input_ids'])}: no labels, while other rows have them (the first: "
                          f"{where(kinds['labels'])}); give every row labels (-100 where it has no target), or none")
