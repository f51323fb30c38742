"""Chat SFT data at a user's scale, generated offline: conversations as JSONL ``messages`` and a byte-level BPE
tokenizer with a ChatML template whose assistant turns are marked with ``{% generation %}``.

    python bench/chat_data.py --rows 200000 --out /tmp/chats      # chats.jsonl (~430 MB), tok/

Each conversation has 1-4 user/assistant exchanges (a system prompt in a quarter of them); 1% of them carry one
long user message (a pasted document) that makes the row 8K-32K tokens. Words come from a lexicon of syllable
words drawn with Zipf-like frequencies, so the tokenizer's merges and the tokens per byte resemble prose
(about 3.6 bytes per token). Deterministic in ``--seed``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from longpack.store.chat import CHATML

TOKENS_PER_WORD = 1.45  # measured on the trained tokenizer: to size the long rows in tokens


def lexicon(rng: np.random.Generator, n: int = 30_000) -> tuple[list[str], np.ndarray]:
    """``n`` distinct words of 1-4 syllables and their Zipf-like probabilities."""
    onset = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
    vowel = ["a", "e", "i", "o", "u", "ea", "ou", "ai"]
    coda = ["", "", "n", "r", "s", "t", "l", "nd", "ng"]
    words: set[str] = set()
    while len(words) < n:
        k = int(rng.integers(1, 5))
        words.add("".join(onset[rng.integers(len(onset))] + vowel[rng.integers(len(vowel))]
                          + coda[rng.integers(len(coda))] for _ in range(k)))
    ranked = sorted(words, key=lambda w: (len(w), w))
    p = 1.0 / np.arange(1, n + 1) ** 1.05
    return ranked, p / p.sum()


class Prose:
    """Sentences of lexicon words, drawn from one long pre-sampled stream (fast: no per-word random calls)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.words, p = lexicon(rng)
        self.stream = rng.choice(len(self.words), size=4_000_000, p=p).tolist()
        self.rng, self.pos = rng, 0

    def text(self, n_words: int) -> str:
        if self.pos + n_words > len(self.stream):
            self.pos = int(self.rng.integers(0, len(self.stream) // 2))
        idx = self.stream[self.pos:self.pos + n_words]
        self.pos += n_words
        out, w = [], self.words
        for i in range(0, len(idx), 12):  # sentences of 12 words
            sent = " ".join(w[j] for j in idx[i:i + 12])
            out.append(sent[:1].upper() + sent[1:] + ".")
        return " ".join(out)


def conversation(rng: np.random.Generator, prose: Prose, long: bool) -> dict:
    turns = int(rng.integers(1, 5))
    msgs = [{"role": "system", "content": prose.text(int(rng.integers(8, 30)))}] if rng.random() < 0.25 else []
    for t in range(turns):
        n_user = int(rng.lognormal(3.3, 0.8)) + 3
        if long and t == 0:
            n_user = int(rng.integers(8_000, 32_000) / TOKENS_PER_WORD)
        msgs.append({"role": "user", "content": prose.text(n_user)})
        msgs.append({"role": "assistant", "content": prose.text(int(rng.lognormal(4.1, 0.7)) + 3)})
    return {"messages": msgs}


def tokenizer(out: Path, prose: Prose, vocab: int = 8192) -> Path:
    """A byte-level BPE trained on the lexicon's prose, saved with its ChatML template (``tok/``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((prose.text(200) for _ in range(5_000)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out / "tok")
    return out / "tok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--long-share", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/chats"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    prose = Prose(rng)
    if not (args.out / "tok" / "tokenizer.json").is_file():
        tokenizer(args.out, prose)
    long = rng.random(args.rows) < args.long_share
    with open(args.out / "chats.jsonl", "w") as f:
        for i in range(args.rows):
            f.write(json.dumps(conversation(rng, prose, bool(long[i]))) + "\n")
    print(f"wrote {args.out / 'chats.jsonl'} ({(args.out / 'chats.jsonl').stat().st_size / 1e6:.0f} MB, "
          f"{args.rows:,} rows, {int(long.sum()):,} long) and {args.out / 'tok'}")


if __name__ == "__main__":
    main()
