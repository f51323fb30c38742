"""The Plan contract: which tokens run where and when. Every planner emits one; simulator and runtime read it.

Plain immutable values with a canonical JSON form: Plan (planner, world, lengths, truncated, dropped, meta, steps)
> Step (CP degree or degrees, token cap, replicas) > Replica (micro-batches in order) > MicroBatch (pieces,
checkpointing, recompute, padding) > Piece (sample, start, stop, cp_rank: None = sharded over the CP group).
:meth:`Plan.validate` checks five invariants — coverage, capacity, chunk order, shape, determinism — naming step,
replica, micro-batch and sample, in O(pieces); docs/PLAN.md states them in full.

>>> p = Plan(planner="demo", world=2, lengths={0: 5, 1: 3}, steps=(
...     Step(cp=2, token_cap=6, replicas=(Replica(micro_batches=(
...         MicroBatch(pieces=(Piece(0, 0, 5, None), Piece(1, 0, 3, 1))),)),)),))
>>> p.validate()                    # rank 0: 3 of sample 0; rank 1: 3 of sample 0 + 3 of sample 1
>>> Plan.from_json(p.to_json()) == p
True
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Piece", "make_pieces", "MicroBatch", "Replica", "Step", "Plan", "PlanError", "FORMAT", "step_dict"]

FORMAT = "longpack.plan/1"
MAX_WORLD = 1 << 17  # ranks a plan may name: far above any cluster, far below what would exhaust memory
MAX_TOKENS = 1 << 40


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"plan {what}: {value!r} is not true or false")
    return value


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    """``value`` if it is a JSON integer in [lo, hi]; a :class:`PlanError` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"plan {what}: {value!r} is not an integer")
    if not lo <= value <= hi:
        raise PlanError(f"plan {what}: {value} is outside [{lo}, {hi}]")
    return value
_Span = tuple[int, int, int, int, int, "int | None"]  # start, stop, step, replica, micro-batch, cp_rank


def _where(at: tuple[int, int, int]) -> str:
    return f"step {at[0]}, replica {at[1]}, micro-batch {at[2]}"


class PlanError(ValueError):
    """A plan that breaks an invariant; the message says where."""


class Piece(NamedTuple):
    """Tokens [start, stop) of ``sample``; ``cp_rank`` None = sharded over the CP group, else held whole there."""

    sample: int
    start: int
    stop: int
    cp_rank: int | None = None

    @property
    def tokens(self) -> int:
        return self.stop - self.start


_tuple_new = tuple.__new__


def make_pieces(samples: list[int], starts: list[int], stops: list[int], cp_rank: int | None) -> tuple[Piece, ...]:
    """Pieces built without NamedTuple's per-call Python constructor (2x faster for million-sample plans)."""
    return tuple([_tuple_new(Piece, (s, a, b, cp_rank)) for s, a, b in zip(samples, starts, stops, strict=True)])


@dataclass(frozen=True)
class MicroBatch:
    pieces: tuple[Piece, ...] = ()
    ckpt_layers: int = 0
    recompute: bool = False
    pad_to: int = 0

    @property
    def tokens(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)

    def rank_tokens(self, cp: int) -> list[int]:
        """Tokens held by each CP rank (padding included), the quantity the token cap limits."""
        out = [0] * cp
        shared = 0
        for p in self.pieces:
            n = self.pad_to if self.pad_to else p.stop - p.start
            if p.cp_rank is None:
                shared += math.ceil(n / cp)
            else:
                out[p.cp_rank] += n
        return [t + shared for t in out]


@dataclass(frozen=True)
class Replica:
    micro_batches: tuple[MicroBatch, ...] = ()


@dataclass(frozen=True)
class Step:
    cp: int
    token_cap: int
    replicas: tuple[Replica, ...]
    group: str = ""
    degrees: tuple[int, ...] = ()  # one CP degree per replica; () = every replica at cp

    def replica_cp(self, replica: int) -> int:
        """CP degree of ``replica``'s group."""
        return self.degrees[replica] if self.degrees else self.cp

    @property
    def mixed(self) -> bool:
        """True when the step's replicas are CP groups of different sizes."""
        return len(set(self.degrees)) > 1

    def spans(self) -> list[tuple[int, int]]:
        """(first rank, degree) of each replica's CP group: the groups one after another in replica order."""
        out, first = [], 0
        for r in range(len(self.replicas)):
            out.append((first, self.replica_cp(r)))
            first += self.replica_cp(r)
        return out

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, CP rank) of global ``rank`` in this step."""
        if not self.degrees:
            return rank // self.cp, rank % self.cp
        for r, (first, d) in enumerate(self.spans()):
            if first <= rank < first + d:
                return r, rank - first
        raise ValueError(f"rank {rank} outside this step's {sum(self.degrees)} ranks")


@dataclass(frozen=True)
class Plan:
    planner: str
    world: int
    lengths: Mapping[int, int]
    steps: Sequence[Step]  # a tuple; a list that grows while a run is planned ahead (planners/stream.py)
    truncated: Mapping[int, int] = field(default_factory=dict)
    dropped: Mapping[int, str] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    # --- queries ----------------------------------------------------------------------------------------------
    def effective_length(self, sample: int) -> int:
        """Tokens of ``sample`` the plan must cover: 0 if dropped, the kept length if truncated."""
        if sample in self.dropped:
            return 0
        return self.truncated.get(sample, self.lengths[sample])

    def is_chunk(self, piece: Piece) -> bool:
        """True when ``piece`` is part of a split sample (a link of a chunk chain), not the whole sample."""
        return piece.start > 0 or piece.stop < self.effective_length(piece.sample)

    def iter_pieces(self) -> Iterator[tuple[int, int, int, Piece]]:
        """(step, replica, micro-batch, piece) for every piece, in execution order."""
        for s, step in enumerate(self.steps):
            for r, rep in enumerate(step.replicas):
                for m, mb in enumerate(rep.micro_batches):
                    for piece in mb.pieces:
                        yield s, r, m, piece

    @property
    def total_tokens(self) -> int:
        return sum(p.stop - p.start for *_, p in self.iter_pieces())

    # --- invariants -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`PlanError` naming the first broken invariant and where; return None when all hold."""
        self._check_header()
        self.validate_steps(range(len(self.steps)), self.lengths)

    def validate_steps(self, indices: Iterable[int], samples: Iterable[int]) -> None:
        """Invariants 1-4 for the steps ``indices`` alone, ``samples`` being every sample they must cover (a step
        checked as it is planned: planners/stream.py). Cost O(their pieces)."""
        covered: dict[int, list[_Span]] = {}
        for s in indices:
            step = self.steps[s]
            self._check_step_shape(s, step)
            for r, rep in enumerate(step.replicas):
                cp = step.replica_cp(r)
                for m, mb in enumerate(rep.micro_batches):
                    self._check_micro_batch((s, r, m), step, cp, mb)
                    for sample, start, stop, rank in mb.pieces:
                        spans = covered.get(sample)
                        if spans is None:
                            covered[sample] = [(start, stop, s, r, m, rank)]
                        else:
                            spans.append((start, stop, s, r, m, rank))
        self._check_coverage_and_order(covered, samples)

    def _check_header(self) -> None:
        if self.world < 1:
            raise PlanError(f"plan world={self.world}: must be >= 1")
        for sample, kept in self.truncated.items():
            if sample not in self.lengths or not 0 < kept < self.lengths[sample]:
                raise PlanError(f"sample {sample}: truncated to {kept} tokens, which is not in (0, its length)")
        for sample, reason in self.dropped.items():
            if sample not in self.lengths or not reason:
                raise PlanError(f"sample {sample}: dropped without a known length and a reason")

    def _check_step_shape(self, s: int, step: Step) -> None:
        if step.degrees:
            self._check_degrees(s, step)
        elif step.cp < 1 or self.world % step.cp:
            raise PlanError(f"step {s}: cp={step.cp} does not divide world={self.world}")
        elif len(step.replicas) != self.world // step.cp:
            raise PlanError(f"step {s}: {len(step.replicas)} replicas, expected world // cp = {self.world // step.cp}")
        counts = {len(rep.micro_batches) for rep in step.replicas}
        if len(counts) > 1:
            raise PlanError(f"step {s}: replicas have different micro-batch counts {sorted(counts)}; "
                            "pad with empty micro-batches so collectives cannot deadlock")

    def _check_degrees(self, s: int, step: Step) -> None:
        if len(step.degrees) != len(step.replicas):
            raise PlanError(f"step {s}: {len(step.degrees)} degrees for {len(step.replicas)} replicas; give one CP "
                            "degree per replica")
        odd = [d for d in step.degrees if d < 1 or self.world % d]
        if odd:
            raise PlanError(f"step {s}: degree {odd[0]} does not divide world={self.world}; give each group a "
                            "degree that divides the world")
        if sum(step.degrees) != self.world:
            raise PlanError(f"step {s}: degrees {list(step.degrees)} sum to {sum(step.degrees)}, not world="
                            f"{self.world}; the groups must hold every rank once")
        if step.cp != max(step.degrees):
            raise PlanError(f"step {s}: cp={step.cp} but the largest of degrees {list(step.degrees)} is "
                            f"{max(step.degrees)}; a step's cp is its widest group")

    def _check_micro_batch(self, at: tuple[int, int, int], step: Step, cp: int, mb: MicroBatch) -> None:
        """Each piece in range and once, then each CP rank's tokens within the cap; ``at``: (step, replica,
        micro-batch), named in an error only."""
        lengths, dropped, pad = self.lengths, self.dropped, mb.pad_to
        seen: set[int] = set()
        for sample, start, stop, rank in mb.pieces:
            if sample not in lengths:
                raise PlanError(f"{_where(at)}: sample {sample} is not in the plan's lengths")
            if sample in seen:
                raise PlanError(f"{_where(at)}: sample {sample} has two pieces in one micro-batch")
            seen.add(sample)
            if sample in dropped:
                raise PlanError(f"{_where(at)}: sample {sample}: dropped ({dropped[sample]}) but scheduled")
            need = self.effective_length(sample)
            if not 0 <= start < stop <= need:
                raise PlanError(f"{_where(at)}: sample {sample} piece [{start}, {stop}) outside [0, {need})")
            if rank is not None and not 0 <= rank < cp:
                raise PlanError(f"{_where(at)}: sample {sample} cp_rank={rank} not in [0, {cp})")
            if pad and stop - start > pad:
                raise PlanError(f"{_where(at)}: sample {sample} has {stop - start} tokens > pad_to={pad}")
        for rank, tokens in enumerate(mb.rank_tokens(cp)):
            if tokens > step.token_cap:
                raise PlanError(f"{_where(at)}: CP rank {rank} holds {tokens} tokens > token cap {step.token_cap}")

    def _check_coverage_and_order(self, covered: dict[int, list[_Span]], samples: Iterable[int]) -> None:
        for sample in samples:
            need = self.effective_length(sample)
            spans = covered.get(sample, [])
            if need == 0:
                if spans:
                    raise PlanError(f"sample {sample}: dropped ({self.dropped[sample]}) but scheduled")
                continue
            if not spans:
                raise PlanError(f"sample {sample}: {need} tokens never scheduled and not in dropped")
            if len(spans) == 1 and spans[0][0] == 0 and spans[0][1] == need:
                continue  # the common case, a whole sample in one piece: nothing to order or tile
            first = spans[0]
            for *_, s, r, _m, rank in spans:
                if (s, r) != (first[2], first[3]):
                    raise PlanError(f"sample {sample}: pieces in step {first[2]} replica {first[3]} and step {s} "
                                    f"replica {r}; a sample's pieces must share one replica of one step")
                if rank != first[5]:
                    raise PlanError(f"sample {sample}: pieces with cp_rank {first[5]} and {rank}; a chain's K/V "
                                    "state stays where it was made: all pieces sharded (None) or all on one CP rank")
            order = sorted(spans, key=lambda t: t[4])
            if [t[0] for t in order] != sorted(t[0] for t in order):
                raise PlanError(f"sample {sample}: pieces not in increasing start order across micro-batches "
                                f"of step {first[2]} replica {first[3]}")
            pos = 0
            for start, stop, *_ in sorted(spans):
                if start != pos:
                    kind = "overlap" if start < pos else "gap"
                    raise PlanError(f"sample {sample}: token {kind} at {min(start, pos)} "
                                    f"(pieces must tile [0, {need}))")
                pos = stop
            if pos != need:
                raise PlanError(f"sample {sample}: covered {pos} of {need} tokens")

    # --- JSON ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        steps = [step_dict(step) for step in self.steps]
        return {"format": FORMAT, "planner": self.planner, "world": self.world, "meta": dict(self.meta),
                "lengths": sorted([k, v] for k, v in self.lengths.items()),
                "truncated": sorted([k, v] for k, v in self.truncated.items()),
                "dropped": sorted([k, v] for k, v in self.dropped.items()), "steps": steps}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """A plan from its JSON form, every field's type and range checked before anything is built from it."""
        if d.get("format") != FORMAT:
            raise PlanError(f"plan format {d.get('format')!r}: expected {FORMAT!r}")
        world = _int(d["world"], "world", 1, MAX_WORLD)
        meta = dict(d.get("meta", {}))
        for key in ("dp", "cp", "tp", "pp"):
            if key in meta:
                _int(meta[key], f"meta.{key}", 1, world if key in ("dp", "cp") else MAX_WORLD)
        for key in ("ckpt_layers", "token_cap"):
            if meta.get(key) is not None:
                _int(meta[key], f"meta.{key}", 0, MAX_TOKENS)

        def piece(p: Any, where: str) -> Piece:
            if not isinstance(p, list) or len(p) not in (3, 4):
                raise PlanError(f"{where}: a piece is [sample, start, stop(, cp_rank)], got {str(p)[:40]}")
            rank = None if len(p) == 3 or p[3] is None else _int(p[3], f"{where} cp_rank", 0, world - 1)
            return Piece(_int(p[0], f"{where} sample", 0, MAX_TOKENS), _int(p[1], f"{where} start", 0, MAX_TOKENS),
                         _int(p[2], f"{where} stop", 0, MAX_TOKENS), rank)

        steps = tuple(
            Step(cp=_int(st["cp"], f"step {s} cp", 1, world), token_cap=_int(st["token_cap"], f"step {s} token_cap",
                                                                              1, MAX_TOKENS),
                 group=str(st.get("group", "")),
                 degrees=tuple(_int(x, f"step {s} degrees", 1, world) for x in st.get("degrees", ())),
                 replicas=tuple(
                Replica(micro_batches=tuple(
                    MicroBatch(pieces=tuple(piece(p, f"step {s}") for p in mb["pieces"]),
                               ckpt_layers=_int(mb["ckpt"], f"step {s} ckpt", 0, MAX_TOKENS),
                               recompute=_bool(mb["recompute"], f"step {s} recompute"),
                               pad_to=_int(mb["pad_to"], f"step {s} pad_to", 0, MAX_TOKENS)) for mb in rep))
                for rep in st["replicas"]))
            for s, st in enumerate(d["steps"]))
        pairs = {name: [(_int(k, f"{name} sample", 0, MAX_TOKENS), v) for k, v in d.get(name, [])]
                 for name in ("lengths", "truncated", "dropped")}
        return cls(planner=str(d["planner"]), world=world, meta=meta, steps=steps,
                   lengths={k: _int(v, f"lengths of sample {k}", 1, MAX_TOKENS) for k, v in pairs["lengths"]},
                   truncated={k: _int(v, f"truncated sample {k}", 0, MAX_TOKENS) for k, v in pairs["truncated"]},
                   dropped={k: str(v) for k, v in pairs["dropped"]})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            return cls.from_dict(data)
        except RecursionError:
            raise PlanError("not a longpack plan: its JSON is nested too deeply") from None
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"not a longpack plan: {exc}") from None


def step_dict(step: Step) -> dict[str, Any]:
    """One step as the JSON format writes it."""
    reps = [[{"ckpt": mb.ckpt_layers, "recompute": mb.recompute, "pad_to": mb.pad_to,
              "pieces": [list(p) for p in mb.pieces]} for mb in rep.micro_batches] for rep in step.replicas]
    entry: dict[str, Any] = {"cp": step.cp, "token_cap": step.token_cap, "group": step.group, "replicas": reps}
    if step.degrees:
        entry["degrees"] = list(step.degrees)
    return entry

