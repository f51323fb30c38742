"""Hardware: peak speed, memory, kernel efficiency and collective latency of one accelerator class.

A :class:`HardwareSpec` carries everything the cost model needs to turn FLOPs, bytes and tokens into seconds:

* ``peak_flops`` (dense bf16) and the achievable fractions ``mfu_gemm`` / ``mfu_attn``;
* small-work efficiency loss: a GEMM over n tokens runs at ``n / (n + gemm_half_tokens)`` of its best speed and an
  attention block with q queries at ``q / (q + attn_half_len)`` (Skrull Fig. 1b: short sequences sharded over a
  large CP group run far below peak);
* ``layer_overhead_s``: fixed launch cost per layer per micro-batch (forward + backward); ``doc_overhead_s``: per
  document (or zigzag block) per layer — zero for varlen kernels on GPU, which take a whole packed stream in one
  call; the CPU path calls attention once per distinct document length, and ``longpack calibrate`` measures it;
* memory: capacity, a reserve for the runtime and allocator, a fragmentation factor on activations;
* collectives: measured latency (µs) by message size (MB), interpolated piecewise-linearly with the smallest
  entry as the latency floor (Skrull App. C.3 Table 5 is the default, measured on H100 NVLink/IB).

Presets: ``h100``, ``h200``, ``a100`` and ``cpu`` (2-core gloo host; replace with ``longpack calibrate``).
Specs round-trip through JSON so that ``--hardware my.json`` accepts a calibrated file.

>>> hw = get_hardware("h100")
>>> round(hw.collective_s("all_gather", 32 * 2**20) * 1e6, 1)      # exactly a Table 5 entry
286.2
>>> round(hw.collective_s("all_gather", 1024) * 1e6, 2)            # below 2 MB: the latency floor
53.29
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import overload

import numpy as np

from .model import UnknownNameError

__all__ = ["HardwareSpec", "HARDWARE_PRESETS", "get_hardware", "load_hardware", "SKRULL_H100_TABLE"]

MB = 2**20

# Skrull App. C.3 Table 5 : µs by message size in MB, measured on H100.
_SIZES_MB = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SKRULL_H100_TABLE: dict[str, tuple[tuple[float, float], ...]] = {
    name: tuple(zip(_SIZES_MB, us, strict=True))
    for name, us in {
        "all_gather": (53.29, 72.52, 97.86, 199.3, 286.2, 488.6, 910.6, 1758.4, 3416.4, 6467.9),
        "all_to_all": (80.62, 78.63, 110.9, 163.2, 277.5, 502.4, 939.2, 1803.9, 3411.2, 6629.6),
        "reduce_scatter": (59.48, 79.26, 104.7, 177.4, 269.5, 458.8, 864.3, 1663.9, 3239.5, 6294.3),
        "all_reduce": (84.65, 113.3, 168.4, 312.2, 479.2, 859.7, 1642.9, 3197.9, 6181.2, 12126.0),
    }.items()
}


def _scaled_table(table: dict, bandwidth_scale: float) -> dict[str, tuple[tuple[float, float], ...]]:
    """Same latency floor, bandwidth part stretched by ``bandwidth_scale`` (> 1 means slower links)."""
    out = {}
    for name, rows in table.items():
        floor = rows[0][1]
        out[name] = tuple((mb, floor + (us - floor) * bandwidth_scale) for mb, us in rows)
    return out


RUNTIME_RESERVE = 0.1  # share of a device's memory a real run's plan leaves free (HardwareSpec.for_runtime)


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator class; see the module docstring for each term."""

    name: str
    peak_flops: float
    memory_gib: float
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    table_bus_gbps: float = 160.0
    mfu_gemm: float = 0.65
    mfu_attn: float = 0.5
    gemm_half_tokens: float = 128.0
    attn_half_len: float = 512.0
    layer_overhead_s: float = 250e-6
    doc_overhead_s: float = 0.0
    reserve_gib: float = 3.0
    fragmentation: float = 1.1
    collectives: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=lambda: dict(SKRULL_H100_TABLE))

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_gib", "intra_node_gbps", "inter_node_gbps", "table_bus_gbps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"hardware {self.name!r}: {name}={value!r} must be > 0")
        for name in ("mfu_gemm", "mfu_attn"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"hardware {self.name!r}: {name}={value!r} must be in (0, 1]")
        if self.fragmentation < 1:
            raise ValueError(f"hardware {self.name!r}: fragmentation={self.fragmentation} must be >= 1")
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
            rows = self.collectives.get(kind)
            if not rows or any(b[0] <= a[0] for a, b in zip(rows, rows[1:], strict=False)):
                raise ValueError(f"hardware {self.name!r}: collective table {kind!r} missing or sizes not increasing")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def for_runtime(self) -> HardwareSpec:
        """The spec a real run plans with: at least a tenth of the memory reserved (``RUNTIME_RESERVE``). A preset's
        memory is the nominal capacity; the device shows a little less, and the CUDA context, NCCL's and cuBLAS's
        workspaces and the caching allocator's slack live outside the allocated peak the cost model prices, so a
        plan that fills all but a fixed 3 GiB of an 80 GiB GPU (allocated peaks at 90%) leaves them almost
        nothing. Simulations of the papers' setups keep the preset's own reserve."""
        return replace(self, reserve_gib=max(self.reserve_gib, RUNTIME_RESERVE * self.memory_gib))

    @overload
    def collective_s(self, kind: str, nbytes: float, *, group: int = 8) -> float: ...

    @overload
    def collective_s(self, kind: str, nbytes: np.ndarray, *, group: int = 8) -> np.ndarray: ...

    def collective_s(self, kind: str, nbytes: float | np.ndarray, *, group: int = 8) -> float | np.ndarray:
        """Seconds for one collective moving ``nbytes`` (nccl-tests size convention) over ``group`` ranks.

        Piecewise-linear in size between measured points, flat at the smallest point (latency floor), linear
        beyond the largest with the last segment's slope. A group spanning several nodes pays the bandwidth part
        at ``table_bus_gbps / inter_node_gbps`` times the cost. A group of one costs nothing. ``nbytes`` may be
        an array (then an array of seconds comes back).
        """
        if isinstance(nbytes, np.ndarray) and nbytes.ndim:
            return self._collective_array(kind, nbytes.astype(np.float64), group)
        size = float(nbytes)
        if group <= 1 or size <= 0:
            return 0.0
        rows = self.collectives[kind]
        mb = size / MB
        floor = rows[0][1]
        if mb <= rows[0][0]:
            us = floor
        else:
            us = _interp(rows, mb)
        if group > self.gpus_per_node:
            us = floor + (us - floor) * max(1.0, self.table_bus_gbps / self.inter_node_gbps)
        return us * 1e-6

    def _collective_array(self, kind: str, nbytes: np.ndarray, group: int) -> np.ndarray:
        """:meth:`collective_s` over an array of sizes (the same piecewise-linear table, vectorised)."""
        if group <= 1:
            return np.zeros_like(nbytes)
        rows = self.collectives[kind]
        xs, ys = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
        mb = nbytes / MB
        us = np.interp(mb, xs, ys)  # flat at the floor below the first point
        if len(rows) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            us = np.where(mb > xs[-1], ys[-1] + slope * (mb - xs[-1]), us)
        if group > self.gpus_per_node:
            us = ys[0] + (us - ys[0]) * max(1.0, self.table_bus_gbps / self.inter_node_gbps)
        return np.where(nbytes > 0, us * 1e-6, 0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> HardwareSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"hardware file: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        data = dict(data)
        if "collectives" in data:
            data["collectives"] = {k: tuple(tuple(map(float, r)) for r in v) for k, v in data["collectives"].items()}
        return cls(**data)


def _interp(rows: tuple[tuple[float, float], ...], x: float) -> float:
    for (x0, y0), (x1, y1) in zip(rows, rows[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = rows[-2], rows[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def _h100() -> HardwareSpec:
    return HardwareSpec(name="h100", peak_flops=989e12, memory_gib=80.0)


def _a100() -> HardwareSpec:
    # NVLink 3 (600 GB/s) vs NVLink 4 (900 GB/s): the bandwidth part of Skrull's table 1.5x slower.
    return HardwareSpec(name="a100", peak_flops=312e12, memory_gib=80.0, intra_node_gbps=300.0,
                        inter_node_gbps=25.0, table_bus_gbps=107.0,
                        collectives=_scaled_table(SKRULL_H100_TABLE, 1.5))


def _cpu() -> HardwareSpec:
    # A 2-core host running gloo over loopback. Rough until `longpack calibrate` measures it.
    rows = ((0.0625, 60.0), (1.0, 600.0), (16.0, 9000.0), (256.0, 144000.0))
    gloo: dict[str, tuple[tuple[float, float], ...]] = {k: rows for k in ("all_gather", "reduce_scatter", "all_to_all")}
    gloo["all_reduce"] = ((0.0625, 90.0), (1.0, 1200.0), (16.0, 18000.0), (256.0, 288000.0))
    return HardwareSpec(name="cpu", peak_flops=1.5e11, memory_gib=24.0, gpus_per_node=64, intra_node_gbps=2.0,
                        inter_node_gbps=2.0, table_bus_gbps=2.0, mfu_gemm=0.5, mfu_attn=0.25, gemm_half_tokens=16.0,
                        attn_half_len=32.0, layer_overhead_s=400e-6, reserve_gib=2.0, fragmentation=1.0,
                        collectives=gloo)


HARDWARE_PRESETS: dict[str, Callable[[], HardwareSpec]] = {
    "h100": _h100,
    # Same compute and NVLink as H100; 141 GB of HBM3e.
    "h200": lambda: replace(_h100(), name="h200", memory_gib=141.0),
    "a100": _a100,
    "cpu": _cpu,
}


def get_hardware(name: str) -> HardwareSpec:
    """The preset called ``name``; an unknown name raises with the list of known ones."""
    try:
        return HARDWARE_PRESETS[name]()
    except KeyError:
        known = ", ".join(sorted(HARDWARE_PRESETS))
        raise UnknownNameError(f"unknown hardware {name!r}; choose one of: {known} or a .json file") from None


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A preset name, or a JSON file written by ``HardwareSpec.to_json`` / ``longpack calibrate``."""
    if name_or_path.endswith(".json"):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"hardware file {name_or_path!r} does not exist")
        try:
            return HardwareSpec.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"hardware file {name_or_path!r} is not a valid HardwareSpec JSON: {exc}") from None
    return get_hardware(name_or_path)
