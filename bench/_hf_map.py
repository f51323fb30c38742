"""One arm of bench/data_scale.py: Hugging Face's own way to tokenize chat rows for SFT, timed.

    python bench/_hf_map.py CHATS.jsonl TOKENIZER_DIR NUM_PROC CACHE_DIR

``datasets.load_dataset("json", cache_dir=CACHE_DIR)`` then ``.map(apply_chat_template(messages, tokenize=True,
return_dict=True, return_assistant_tokens_mask=True), num_proc=NUM_PROC)`` (input_ids and assistant_masks, what
TRL's ``assistant_only_loss`` trains on); prints one JSON line of seconds: load, map, total (from before the
imports), and the rows.
"""

import json
import sys
import time

t0 = time.perf_counter()
import datasets  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

path, tok_dir, num_proc, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = AutoTokenizer.from_pretrained(tok_dir)
datasets.disable_progress_bars()
ds = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache)
t1 = time.perf_counter()


def row(example: dict) -> dict:
    return tok.apply_chat_template(example["messages"], tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)


out = ds.map(row, num_proc=num_proc if num_proc > 1 else None, remove_columns=["messages"])
t2 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "map": t2 - t1, "total": t2 - t0, "rows": len(out)}))
