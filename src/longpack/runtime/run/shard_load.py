"""Start-up without a whole copy of the model per rank: built on ``meta``, sharded, then each rank reads only its
shard of every weight from the checkpoint's safetensors.

:func:`meta_model` builds the transformers model from its config on the ``meta`` device (no storage). After
FSDP2 has sharded it (runtime/kernel/parallelize.py) and ``to_empty`` has given every rank its shards' storage,
:func:`load_shards` walks the checkpoint's safetensors files (``model.safetensors`` or the shards its index names)
and copies into each parameter the rows this rank holds — FSDP2 shards dim 0 in ``ceil(n / world)``-row pieces,
one contiguous byte range of the file each — read by position (not mapped: a mapped page a rank touches stays in
its resident set), cast to the parameter's dtype. Unsharded parameters are read whole. The RoPE
buffers, which a checkpoint does not hold, are computed again (:func:`restore_buffers`).

Host memory: one fp32 shard per rank plus one weight's slice in flight, instead of every rank loading the whole
checkpoint in fp32 before sharding. Exact: the same numbers as ``from_pretrained`` (tests/test_shard_load.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["meta_model", "load_shards", "restore_buffers", "weight_files"]


def meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The model of a transformers ``config`` (runtime/run/hf_model.config_of), on ``meta``, running the longpack
    attention."""
    from transformers import AutoModelForCausalLM

    from ..kernel.engine import ATTN, register

    register()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN, dtype=dtype)


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, or the single ``model.safetensors``."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [p / n for n in names]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    raise ValueError(f"--model-path {path}: no model.safetensors (or index) there; sharded start-up reads "
                     "safetensors only — save the checkpoint with save_pretrained(safe_serialization=True)")


def _rows(param: Any) -> tuple[torch.Tensor, slice | None]:
    """(the local tensor to fill, the rows of the full weight it holds; None: all of it)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.data, None
    (placement,) = param.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise ValueError(f"a parameter sharded as {placement}; sharded start-up reads dim-0 shards only")
    local = param.to_local()
    n, ranks = param.shape[0], param.device_mesh.size()
    start = min(n, param.device_mesh.get_local_rank() * -(-n // ranks))
    return local, slice(start, start + local.shape[0])


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _Weights:
    """One safetensors file read by byte ranges: its JSON header (the format's 8-byte length, then the names'
    dtype, shape and data offsets), then per weight only the rows asked for, with one positioned read into a
    fresh buffer. safetensors' own ``safe_open`` maps the file, and every page a rank touches then stays in its
    resident set until the file is closed; here only the rows read are held, and only until they are copied."""

    def __init__(self, file: Path) -> None:
        self.file = file
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        self.base = 8 + n

    def read(self, name: str, rows: slice | None) -> torch.Tensor:
        meta = self.header[name]
        dtype, shape, (start, stop) = _DTYPES[meta["dtype"]], list(meta["shape"]), meta["data_offsets"]
        if rows is not None and shape:
            row = (stop - start) // max(shape[0], 1)
            start, stop = start + rows.start * row, start + rows.stop * row
            shape[0] = rows.stop - rows.start
        buf = bytearray(stop - start)
        with open(self.file, "rb") as f:
            f.seek(self.base + start)
            f.readinto(buf)
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


@torch.no_grad()
def load_shards(model: torch.nn.Module, path: str | Path) -> None:
    """Fill every parameter of ``model`` (sharded or not, storage allocated) from the checkpoint at ``path``;
    a weight the model has and the checkpoint lacks, or the other way round, is refused in one line."""
    params = dict(model.named_parameters())
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - set(params)
    done: set[str] = set()
    for file in weight_files(path):
        weights = _Weights(file)
        for name, meta in weights.header.items():
            if name not in params:
                if name in tied:
                    continue
                raise ValueError(f"--model-path {path}: weight {name} in {file.name} is not a parameter of the "
                                 "model its config builds")
            local, rows = _rows(params[name])
            want = list(params[name].shape)
            if list(meta["shape"]) != want:
                raise ValueError(f"--model-path {path}: weight {name} has shape {meta['shape']} for {want} of the "
                                 "model's; the config does not match the weights")
            local.copy_(weights.read(name, rows))
            done.add(name)
    missing = sorted(set(params) - done)
    if missing:
        raise ValueError(f"--model-path {path}: {len(missing)} weights missing from the checkpoint (first: "
                         f"{missing[0]}); give a complete save_pretrained folder")


@torch.no_grad()
def restore_buffers(model: torch.nn.Module) -> None:
    """Compute again the buffers a checkpoint does not hold (RoPE's inverse frequencies), which ``to_empty`` left
    without values: each rotary embedding module rebuilt from its config on the host, its buffers copied in."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)
