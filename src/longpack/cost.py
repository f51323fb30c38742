"""Cost model: seconds and bytes of a packed micro-batch on one rank, shared by planners, simulator and bounds.

Compute: linear work per token (projections, MLP, head) and attention work per (query, key) pair — Σ s_i² of a
packed micro-batch's documents, never (Σ s_i)² — forward and backward, with checkpointing's extra forwards, each
at an efficiency that falls for small work (Skrull Fig. 1b). Memory: static state (weights, gradients, AdamW,
ZeRO-sharded) + activations per token (α(k) with k checkpointed layers) + a reserve, whose inverse is the token
cap (Skrull's BucketSize); ``TrainConfig.runtime`` prices longpack's own runtime as `longpack train --dry-run`
counts it. Communication: the CP K/V exchange and the DP gradient all-reduce, piecewise with a latency floor.
The formulas and their derivations: docs/COST_MODEL.md. O(1) per (micro-batch, rank), vectorised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import overload

import numpy as np

from .hardware import HardwareSpec
from .model import ModelSpec

__all__ = ["TrainConfig", "CostModel", "attention_pairs"]

COMM_MEMO = 1 << 16  # most scalar K/V exchange times a cost model keeps (cleared when full)
RUNTIME_HEAD_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk of the runtime's head loss (runtime/kernel/head_loss.py)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Parallel layout and numerics of a run. A model replica spans tp·pp·cp GPUs; world = dp·tp·pp·cp."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 2
    ckpt_layers: int = 0
    act_bytes: int = 2
    logits_bytes: int = 4
    causal_factor: float = 0.5
    attn_bwd_factor: float = 2.5
    token_cap: int | None = None
    runtime: bool = False  # price longpack's own runtime (see CostModel.static_bytes / act_bytes_per_token)

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} {value!r}: must be a positive integer")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage}: must be 0, 1, 2 or 3")
        if self.ckpt_layers < 0:
            raise ValueError(f"ckpt_layers={self.ckpt_layers}: must be >= 0")
        if not 0 < self.causal_factor <= 1:
            raise ValueError(f"causal_factor={self.causal_factor}: must be in (0, 1]")
        if self.token_cap is not None and self.token_cap < 1:
            raise ValueError(f"token_cap={self.token_cap}: must be >= 1")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def attention_pairs(start: np.ndarray | float, stop: np.ndarray | float, causal: float = 0.5) -> np.ndarray | float:
    """(query, key) pairs of a piece [start, stop) of a causal document: ``causal · (stop² − start²)``.

    >>> attention_pairs(0, 4, 1.0) + attention_pairs(0, 4, 1.0)      # two documents of 4: 2 · 4², not 8²
    32.0
    """
    start = np.asarray(start, dtype=np.float64)
    stop = np.asarray(stop, dtype=np.float64)
    out = causal * (stop * stop - start * start)
    return float(out) if out.ndim == 0 else out


class CostModel:
    """Time and memory of micro-batches for one (model, hardware, config); see the module docstring."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, config: TrainConfig) -> None:
        if model.layers % config.pp:
            raise ValueError(f"--pp {config.pp}: must divide the model's {model.layers} layers")
        self.model, self.hw, self.cfg = model, hardware, config
        self.layers = model.layers // config.pp  # layers per pipeline stage
        tp = config.tp
        self._lin_per_token = (self.layers * model.linear_flops_per_token + model.head_flops_per_token) / tp
        self._gemm_rate = hardware.peak_flops * hardware.mfu_gemm
        self._attn_per_pair = self.layers * model.attn_flops_per_pair / tp
        self._attn_rate = hardware.peak_flops * hardware.mfu_attn
        self._kv_bytes_per_token = model.kv_width * config.act_bytes / tp
        self._comm: dict[tuple[float, int | None, bool], float] = {}  # scalar cp_comm_s, bounded by COMM_MEMO

    # --- compute --------------------------------------------------------------------------------------------
    def linear_s(self, tokens: float | np.ndarray, ckpt_layers: int | None = None, *,
                 ideal: bool = False) -> float | np.ndarray:
        """Projections, MLP and LM head for ``tokens`` on one rank, forward + backward (+ recompute).
        ``ideal`` drops the small-work efficiency loss (used by lower bounds)."""
        k = self._k(ckpt_layers)
        n = np.asarray(tokens, dtype=np.float64)
        passes = 3.0 + k / self.layers
        half = 0.0 if ideal else self.hw.gemm_half_tokens
        # n/(n+half) efficiency: time = flops·(n + half)/n/rate, so a rank pays for `half` extra tokens.
        out = np.where(n > 0, (n + half) * self._lin_per_token * passes / self._gemm_rate, 0.0)
        return float(out) if out.ndim == 0 else out

    def attn_s(self, pairs: float | np.ndarray, q_len: float | np.ndarray,
               ckpt_layers: int | None = None) -> float | np.ndarray:
        """Attention of blocks with ``pairs`` (query, key) pairs and ``q_len`` queries each (elementwise)."""
        k = self._k(ckpt_layers)
        p = np.asarray(pairs, dtype=np.float64)
        q = np.maximum(np.asarray(q_len, dtype=np.float64), 1e-9)
        passes = 1.0 + self.cfg.attn_bwd_factor + k / self.layers
        out = p * self._attn_per_pair * passes * (q + self.hw.attn_half_len) / q / self._attn_rate
        return float(out) if out.ndim == 0 else out

    def docs_s(self, documents: float | np.ndarray) -> float | np.ndarray:
        """Per-document attention call cost of ``documents`` documents (or zigzag blocks) on one rank."""
        return self.layers * self.hw.doc_overhead_s * np.asarray(documents, dtype=np.float64)

    @property
    def fixed_s(self) -> float:
        """Kernel-launch cost of one micro-batch on one rank (forward + backward)."""
        return self.layers * self.hw.layer_overhead_s

    def sequence_s(self, length: float, *, sharded: bool = False) -> float:
        """Compute seconds of one whole sequence alone in a micro-batch: local on one rank, or one rank's share
        when zigzag-sharded over the CP group (communication not included)."""
        cp = self.cfg.cp if sharded else 1
        pairs = attention_pairs(0, length, self.cfg.causal_factor) / cp
        q = length / (2 * cp) if sharded else length
        return float(self.linear_s(length / cp)) + float(self.attn_s(pairs, q)) + self.fixed_s

    def sharded_pack_s(self, lengths: np.ndarray, ckpt_layers: int | None = None) -> float:
        """One rank's time for a packed micro-batch whose documents are all sharded over the CP group (whole on the
        one rank when cp = 1): exposed K/V exchange + compute + launch cost (the simulator's Eq. 2 with nothing
        local to overlap)."""
        cp = self.cfg.cp
        s = np.asarray(lengths, dtype=np.float64)
        pairs = self.cfg.causal_factor * s * s / cp
        q = s / (2 * cp) if cp > 1 else s
        tokens = float(np.ceil(s / cp).sum())
        attn = float(np.sum(self.attn_s(pairs, q, ckpt_layers)))
        comm = self.cp_comm_s(float(s.sum()), ckpt_layers)
        return float(self.linear_s(tokens, ckpt_layers)) + attn + comm + self.fixed_s

    # --- communication --------------------------------------------------------------------------------------
    @overload
    def cp_comm_s(self, sharded_tokens: float, ckpt_layers: int | None = None, recompute: bool = False) -> float: ...

    @overload
    def cp_comm_s(self, sharded_tokens: np.ndarray, ckpt_layers: int | None = None,
                  recompute: bool = False) -> np.ndarray: ...

    def cp_comm_s(self, sharded_tokens: float | np.ndarray, ckpt_layers: int | None = None,
                  recompute: bool = False) -> float | np.ndarray:
        """K/V exchange for ``sharded_tokens`` tokens sharded over the CP group in one micro-batch: per layer an
        all-gather forward, an all-gather and a reduce-scatter backward, one more all-gather per recomputed layer;
        ``recompute`` (a micro-batch whose activations are dropped after its forward, ChunkFlow) runs its whole
        forward again, one more all-gather per layer. ``sharded_tokens`` may be an array."""
        cp = self.cfg.cp
        if isinstance(sharded_tokens, np.ndarray) and sharded_tokens.ndim:
            return np.zeros(sharded_tokens.shape) if cp <= 1 else self._comm_s(sharded_tokens, ckpt_layers, recompute)
        if cp <= 1 or float(sharded_tokens) <= 0:
            return 0.0
        key = (float(sharded_tokens), ckpt_layers, recompute)  # planners ask for the same few totals many times
        hit = self._comm.get(key)
        if hit is None:
            if len(self._comm) >= COMM_MEMO:
                self._comm.clear()
            hit = self._comm[key] = float(self._comm_s(key[0], ckpt_layers, recompute))
        return hit

    def _comm_s(self, sharded_tokens: float | np.ndarray, ckpt_layers: int | None, recompute: bool
                ) -> float | np.ndarray:
        """:meth:`cp_comm_s` at cp > 1, unmemoised."""
        k = self._k(ckpt_layers)
        nbytes = sharded_tokens * self._kv_bytes_per_token
        group = self.cfg.cp * self.cfg.tp
        ag = self.hw.collective_s("all_gather", nbytes, group=group)
        rs = self.hw.collective_s("reduce_scatter", nbytes, group=group)
        return self.layers * (2 * ag + rs) + (k + (self.layers if recompute else 0)) * ag

    def grad_allreduce_s(self) -> float:
        """Gradient all-reduce over the dp·cp ranks holding the same parameter shard (once per step)."""
        group = self.cfg.dp * self.cfg.cp
        nbytes = self.stage_params * 2  # bf16 gradients
        span = group * self.cfg.tp * self.cfg.pp
        return self.hw.collective_s("all_reduce", nbytes, group=span if group > 1 else 1)

    # --- memory ---------------------------------------------------------------------------------------------
    @property
    def stage_params(self) -> float:
        """Parameters held by one GPU before ZeRO sharding (its tp slice of its pp stage)."""
        m = self.model
        return (self.layers * m.layer_params() + m.embedding_params) / self.cfg.tp

    @property
    def static_bytes(self) -> float:
        """Weights (2 B), gradients (2 B) and fp32 master + Adam moments (12 B) per parameter, ZeRO-sharded.

        With ``runtime`` at ZeRO-3 (longpack's FSDP2 runtime, runtime/kernel/parallelize.py), plus what is gathered
        while a step runs: the root (embeddings, head) in bf16 from a forward to its backward, the next decoder layer
        prefetched, and the larger of the head's temporaries (its fp32 weight gradient, that gradient in bf16, a chunk
        of fp32 logits and its bf16 copy: runtime/kernel/head_loss.py) and a layer's backward (the layer gathered in
        bf16, its gradient's fp32 reduce-scatter buffer). With ``runtime`` at ZeRO-1 without pipeline stages (gathered
        once per step: runtime/kernel/parallelize.StepSync), the whole gradients accumulate in fp32 and the head's
        temporaries (its weight gradient in bf16, a chunk of fp32 logits and its bf16 copy) or a layer's come on
        top."""
        p, n, z = self.stage_params, self.cfg.dp * self.cfg.cp, self.cfg.zero_stage
        weights, grads, optim = 2 * p, 2 * p, 12 * p
        if z >= 1:
            optim /= n
        if z >= 2:
            grads /= n
        if z >= 3:
            weights /= n
        if self.cfg.runtime and (z >= 3 or (z == 1 and self.cfg.pp == 1)):
            m, layer = self.model, self.model.layer_params() / self.cfg.tp
            chunk = RUNTIME_HEAD_CHUNK_BYTES
            if self.cfg.token_cap is not None:  # a chunk holds at most a micro-batch's tokens
                chunk = min(chunk, 4 * m.vocab * self.cfg.token_cap)
            if z >= 3:
                head = 6.0 * m.vocab * m.hidden + 1.5 * chunk
                weights += 2 * m.embedding_params / self.cfg.tp + 2 * layer + max(head, 6 * layer)
            else:
                grads *= 2
                weights += max(2.0 * m.vocab * m.hidden + 1.5 * chunk, 2 * layer)
        return weights + grads + optim

    def act_bytes_per_token(self, ckpt_layers: int | None = None) -> float:
        """Activation bytes per token held for backward, with ``k`` of the stage's layers checkpointed.

        A full layer keeps (bf16): its two norm inputs and outputs feeding GEMMs (~3h), Q and the attention output
        (2·q_width), K and V, the MLP's gate/up outputs and their product (3·ffn, 2·ffn ungated), plus fp32
        softmax statistics per head; a checkpointed layer keeps only its input (h). Checkpointing takes a stage's
        *first* k layers, so during backward a checkpointed layer is re-expanded only after every later layer's
        activations are freed: the re-expansion raises the peak only when all of the stage's layers are
        checkpointed, by one layer less its kept input (so k = L costs what k = L − 1 does). The LM head keeps
        fp32 logits for the loss. Under 1F1B the first stage holds pp micro-batches of L/pp layers, i.e. L
        layers' worth, hence ``model.layers`` below.
        """
        m, k, b = self.model, self._k(ckpt_layers), self.cfg.act_bytes
        if self.cfg.runtime:
            return self._runtime_act_bytes_per_token(k)
        mlp_width = (m.top_k + m.shared_experts) * m.moe_ffn if m.experts else m.ffn
        kv = m.kv_width
        full = b * (3 * m.hidden + 2 * m.q_width + kv + (3 if m.gated_mlp else 2) * mlp_width) + 4 * m.heads
        frac = k / self.layers
        layers = m.layers
        kept = b * m.hidden
        per_token = layers * ((1 - frac) * full + frac * kept) + (full - kept if k == self.layers else 0.0)
        logits = m.vocab * self.cfg.logits_bytes
        return (per_token + logits) / self.cfg.tp

    def shard_act_bytes_per_token(self, ckpt_layers: int | None = None) -> float:
        """Bytes a token of a piece sharded over the CP group holds beyond :meth:`act_bytes_per_token`, per rank
        token (``runtime`` at cp > 1; else 0): per kept layer, the gathered K/V of the whole piece that attention
        keeps for backward (cp times the rank's own K/V; the rank's own rows stay beside it for the gradients of
        later chunks of a chain, runtime/kernel/sharded_chain.py), its query rows and its attention output copied out of
        and back into the micro-batch's row order (runtime/kernel/context_parallel.CPAttention) — 2·q_width +
        (cp − 1)·kv_width numbers, counted from a fake-tensor run as the rest."""
        if not self.cfg.runtime or self.cfg.cp <= 1:
            return 0.0
        m = self.model
        extra = self.cfg.act_bytes * (2 * m.q_width + (self.cfg.cp - 1) * m.kv_width)
        return self._runtime_act_bytes_per_token(self._k(ckpt_layers), extra) - self.act_bytes_per_token(ckpt_layers)

    def _runtime_act_bytes_per_token(self, k: int, extra: float = 0.0) -> float:
        """Bytes per token the runtime holds (``runtime``): transformers' eager decoder layer keeps
        (8·hidden + 2·q_width + kv_width + 4·ffn) numbers per token plus fp32 softmax statistics per head (its
        RMSNorms keep fp32 copies, its MLP gate, activation, up and product), a checkpointed layer its input, and
        the model outside the layers 4·hidden + 2·head_dim (embeddings, final norm, the head's input, RoPE) —
        counted from the saved tensors of a fake-tensor run (runtime/run/dry_run.py). The chunked head keeps no
        logits. The peak is the larger of the backward's start (every kept activation alive) and a checkpointed
        layer's backward (its recomputed activations and their gradients, ~2·hidden more, beside the kept
        inputs)."""
        m, b = self.model, self.cfg.act_bytes
        full = b * (8 * m.hidden + 2 * m.q_width + m.kv_width + 4 * m.ffn) + 4 * m.heads + extra
        kept, rest = b * m.hidden, b * (4 * m.hidden + 2 * m.head_dim)
        start = (self.layers - k) * full + k * kept
        inner = k * kept + full + 2 * b * m.hidden if k else 0.0
        return (max(start, inner) + rest) / self.cfg.tp

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V one token adds per layer on one rank (what the CP exchange moves)."""
        return self._kv_bytes_per_token

    def kv_store_bytes(self, prefix_tokens: float | np.ndarray) -> float | np.ndarray:
        """K/V kept for ``prefix_tokens`` earlier tokens of a chunk chain (ChunkFlow's state store), for the
        layers of this pipeline stage: 2·layers·S·h_kv·bytes (ChunkFlow's K/V state), divided by tp; with
        ``runtime``, plus the fp32 accumulators of the gradients later chunks send to it (runtime/kernel/chunked.py)."""
        per_token = self._kv_bytes_per_token
        if self.cfg.runtime:
            per_token *= (self.cfg.act_bytes + 4) / self.cfg.act_bytes
        return prefix_tokens * per_token * self.layers

    def memory_bytes(self, tokens: float | np.ndarray, ckpt_layers: int | None = None,
                     prefix_tokens: float | np.ndarray = 0.0) -> float | np.ndarray:
        """Peak bytes of one rank holding ``tokens`` tokens of activations (elementwise over arrays)."""
        act = self.hw.fragmentation * self.act_bytes_per_token(ckpt_layers) * tokens
        return self.static_bytes + act + self.kv_store_bytes(prefix_tokens) + self.hw.reserve_gib * 2**30

    def token_cap(self, ckpt_layers: int | None = None) -> int:
        """The token cap (Skrull's BucketSize C): most tokens one rank may hold in one micro-batch (a configured cap
        overrides the model).

        ``floor(memory_tokens(k))``; 0 when even static state does not fit.
        """
        if self.cfg.token_cap is not None:
            return self.cfg.token_cap
        return max(0, int(math.floor(self.memory_tokens(ckpt_layers))))

    def memory_tokens(self, ckpt_layers: int | None = None) -> float:
        """Most tokens one rank's activations can take within memory (real-valued, whatever cap is configured):
        ``(memory − reserve − static) / (fragmentation · (α(k) + σ(k)))``, at least 0, where σ is
        :meth:`shard_act_bytes_per_token` (0 but for the runtime at cp > 1): a micro-batch of sharded pieces fits."""
        free = self.hw.memory_bytes - self.hw.reserve_gib * 2**30 - self.static_bytes
        per_token = self.act_bytes_per_token(ckpt_layers) + self.shard_act_bytes_per_token(ckpt_layers)
        return max(0.0, free / (self.hw.fragmentation * per_token))

    @cached_property
    def token_caps(self) -> np.ndarray:
        """``token_cap(k)`` for k = 0 .. layers of this stage (computed once; bounds and planners read it often)."""
        caps = np.array([self.token_cap(k) for k in range(self.layers + 1)], dtype=np.float64)
        caps.flags.writeable = False
        return caps

    def min_ckpt_for(self, tokens: float) -> int | None:
        """Fewest checkpointed layers with ``token_cap >= tokens``; None when even full checkpointing fails."""
        for k in range(self.layers + 1):
            if self.token_cap(k) >= tokens:
                return k
        return None

    def at_cp(self, cp: int) -> CostModel:
        """This model for CP groups of ``cp`` ranks on the same world (dp · cp kept); itself at its own degree."""
        if cp == self.cfg.cp:
            return self
        return CostModel(self.model, self.hw, replace(self.cfg, cp=cp, dp=self.cfg.dp * self.cfg.cp // cp))

    # --- helpers --------------------------------------------------------------------------------------------
    def _k(self, ckpt_layers: int | None) -> int:
        k = self.cfg.ckpt_layers if ckpt_layers is None else ckpt_layers
        return min(k, self.layers)  # per pipeline stage
