"""Conversations through a tokenizer's chat template: token ids and a 0/1 mask of the assistant's tokens, for a
batch at a time.

* A template with ``{% generation %}`` marks (as TRL's ``assistant_only_loss`` needs): each conversation rendered
  once by transformers' own renderer, which returns the character spans inside the marks; the mask is
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``'s — every token overlapping a span.
* A template without them (the prefix method): assistant turn i spans from the end of the conversation up to it
  with the generation prompt to the end of the conversation through it, which must be a prefix of the whole.
  Those prefixes are rendered as strings; only the whole conversation is tokenized.

Every batch is tokenized in one call of the fast tokenizer (``add_special_tokens=False``: the template writes
them), and a span's tokens are found from the tokenizer's character offsets at its two ends. Cost: one
tokenization per conversation; 1 + 2 x (assistant turns) template renders without generation marks, 1 with.
A template error (``raise_exception``, a non-string content) raises :class:`RowError` naming the conversation.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .check import RowError

__all__ = ["ChatTemplate", "CHATML"]

TOKENIZE_CHARS = 1 << 22  # characters tokenized in one call: ~1.2M tokens of text, ~120 MB of the tokenizer's objects
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")

# ChatML (system, user and assistant turns between <|im_start|> and <|im_end|>) with each assistant turn's content
# and end marker inside {% generation %}: for a ChatML model whose tokenizer's own template has no marks,
# ``tokenizer.chat_template = CHATML`` trains on exactly what TRL's assistant_only_loss would.
CHATML = ("{% for message in messages %}"
          "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
          "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class ChatTemplate:
    """``encode(conversations)`` -> [(ids int32, assistant mask uint8)] with ``tok``'s chat template."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        template = getattr(tok, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one, as apply_chat_template
            template = template.get("default")
        self.template = template
        self.generation = bool(template and _GENERATION.search(template))
        try:
            from transformers.utils.chat_template_utils import render_jinja_template

            self._render_fn: Any = render_jinja_template
        except ImportError:  # another transformers: its public apply_chat_template renders, one by one
            self._render_fn = None

    def encode(self, convs: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rows of ``convs``: rendered together, tokenized in groups of about ``TOKENIZE_CHARS`` characters (the
        tokenizer's per-token objects are large: ~100 bytes a token while a group is in hand)."""
        if self.template is None:
            raise RowError(0, "the tokenizer has no chat template; give rows of input_ids or text instead")
        convs = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in convs]  # as transformers
        if self.generation and self._render_fn is None:
            return self._hf_masks(convs)
        if self.generation:
            texts, spans = self._render(convs, prompt=False, marks=True)
        else:
            texts, spans = self._prefix_spans(convs)
        rows = []
        for a, b in _groups([len(t) for t in texts], TOKENIZE_CHARS):
            out = self.tok(texts[a:b], add_special_tokens=False, return_attention_mask=False)
            for i, ids in enumerate(out["input_ids"]):
                ids_a = np.asarray(ids, dtype=np.int32)
                rows.append((ids_a, _token_mask(out.encodings[i], ids_a.size, spans[a + i])))
        return rows

    def _hf_masks(self, convs: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """transformers' own assistant masks (a transformers without the renderer this module calls)."""
        rows = []
        for i, c in enumerate(convs):
            try:
                out = self.tok.apply_chat_template(c, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
            except Exception as exc:  # noqa: BLE001  (the user's template on the user's row)
                raise RowError(i, f"the chat template refused the row: {_first_line(exc)}") from None
            rows.append((np.asarray(out["input_ids"], np.int32), np.asarray(out["assistant_masks"], np.uint8)))
        return rows

    def _render(self, convs: list[list[dict]], prompt: bool, marks: bool = False
                ) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """Rendered strings (and, with ``marks``, the generation spans) of ``convs``; a conversation the
        template refuses raises RowError with its index."""
        try:
            return self._render_all(convs, prompt, marks)
        except Exception:  # noqa: BLE001  (one conversation failed: find which, and say its error)
            for i, c in enumerate(convs):
                try:
                    self._render_all([c], prompt, marks)
                except Exception as exc:  # noqa: BLE001  (the user's template on the user's row)
                    raise RowError(i, f"the chat template refused the row: {_first_line(exc)}") from None
            raise

    def _render_all(self, convs: list[list[dict]], prompt: bool, marks: bool
                    ) -> tuple[list[str], list[list[tuple[int, int]]]]:
        if self._render_fn is not None:
            texts, spans = self._render_fn(conversations=convs, chat_template=self.template,
                                           return_assistant_tokens_mask=marks, add_generation_prompt=prompt,
                                           **self.tok.special_tokens_map)
            return list(texts), [list(map(tuple, s)) for s in spans] if marks else [[] for _ in convs]
        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=prompt) for c in convs]
        return texts, [[] for _ in convs]

    def _prefix_spans(self, convs: list[list[dict]]) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """Whole conversations and their assistant turns' character spans by the prefix method."""
        full, _ = self._render(convs, prompt=False)
        turns = [(c, t) for c, conv in enumerate(convs) for t, m in enumerate(conv) if m["role"] == "assistant"]
        index = [c for c, _ in turns]
        try:
            starts, _ = self._render([convs[c][:t] for c, t in turns], prompt=True)
            ends, _ = self._render([convs[c][:t + 1] for c, t in turns], prompt=False)
        except RowError as exc:
            raise RowError(index[exc.record], exc.message) from None
        spans: list[list[tuple[int, int]]] = [[] for _ in convs]
        for (c, t), start, end in zip(turns, starts, ends, strict=True):
            if not full[c].startswith(end):
                raise RowError(c, f"the chat template does not render turn {t} as a prefix of the whole "
                                  "conversation; tokenize the rows yourself and give input_ids with labels")
            spans[c].append((len(start), len(end)))
        return full, spans


def _groups(sizes: list[int], most: int) -> list[tuple[int, int]]:
    """Consecutive [a, b) ranges of ``sizes`` each summing to at most ``most`` (a larger item alone)."""
    out, a, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > a and total + n > most:
            out.append((a, i))
            a, total = i, 0
        total += n
    return out + ([(a, len(sizes))] if a < len(sizes) else [])


def _token_mask(enc: Any, n: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on every token overlapping a span (transformers' rule), from the offsets at each span's ends."""
    mask = np.zeros(n, np.uint8)
    for s, e in spans:
        a = enc.char_to_token(s) if e > s else None
        b = enc.char_to_token(e - 1) if e > s else None
        if a is None or b is None:  # an empty span, or an end no token covers: the exact rule, token by token
            return _overlap_mask(enc.offsets, n, spans)
        while a > 0 and (c := enc.token_to_chars(a - 1)) is not None and c[1] > s:
            a -= 1  # a character split over several tokens (bytes of one character): all of them overlap
        while b + 1 < n and (c := enc.token_to_chars(b + 1)) is not None and c[0] < e:
            b += 1
        mask[a:b + 1] = 1
    return mask


def _overlap_mask(offsets: list[tuple[int, int]], n: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """transformers' assistant mask: token j is 1 when it overlaps the first span not yet passed."""
    mask = np.zeros(n, np.uint8)
    k = 0
    for j, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[j] = 1
    return mask


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
