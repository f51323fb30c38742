"""Fake CUDA on a CPU-only torch build: run the runtime's real code on 'cuda' tensors that hold no data, and check
every operator it reaches.

A CPU build of torch can make fake 'cuda' tensors (``FakeTensorMode``), but its autograd engine cannot run a
backward over them: it asks the device's guard for streams and events, and a CPU build registers no guard and no
accelerator for CUDA. :func:`activate` compiles (once, with g++ against torch's own headers; ~3 s, cached per torch
version) and loads a small library that registers a no-op CUDA device guard and CUDA hooks that report one device
— nothing computes on it, the fake tensors only carry shapes, dtypes and devices. It must be loaded before torch
is imported, so the checks run in a process of their own (tests/gpu_ready_worker.py).

:class:`DeviceCheck` is the harness: a dispatch mode above ``FakeTensorMode`` in which host work (ops whose tensors
are all real host tensors, and host factories) runs for real and everything touching the device runs fake. It
records, per operator:

* a CPU-only kernel reached with CUDA tensors (``*_for_cpu``), an explicit attention mask on CUDA;
* a host tensor handed to a collective (NCCL takes none);
* a host tensor mixed into a device operator (FakeTensorMode raises for it too, naming the operator);
* host syncs: ``_local_scalar_dense`` (``.item()``, ``.tolist()``, ``float(t)``) on a device tensor and device-to-
  host copies (``syncs``); host-to-device copies (``h2d``), and among them those that block the host
  (``h2d_blocking``: not ``non_blocking``, or from memory that is not pinned — the library also registers a pinned
  host allocator, so ``pin_memory()`` and ``is_pinned()`` work); and attention kernel calls, so a per-document loop
  shows as calls growing with documents;
* per collective op (``allreduce``, ``reduce_scatter_base``, ...): its calls and the bytes of the largest tensor
  handed to each (an all-reduce's tensor, a reduce-scatter's input), ``collective_<op>_calls`` / ``_bytes``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["activate", "DeviceCheck"]

_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
// "Pinned" host memory: ordinary aligned host memory whose blocks are remembered, so that is_pinned() tells a
// tensor staged through pin_memory() from one that was not.
namespace {
std::mutex pinned_mutex;
std::map<const char*, size_t> pinned_blocks;
void pinned_free(void* p) {
  { std::lock_guard<std::mutex> hold(pinned_mutex); pinned_blocks.erase(static_cast<const char*>(p)); }
  std::free(p);
}
bool pinned(const void* data) {
  std::lock_guard<std::mutex> hold(pinned_mutex);
  auto it = pinned_blocks.upper_bound(static_cast<const char*>(data));
  if (it == pinned_blocks.begin()) return false;
  --it;
  return static_cast<const char*>(data) < it->first + (it->second ? it->second : 1);
}
struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = std::aligned_alloc(64, ((n ? n : 1) + 63) / 64 * 64);
    { std::lock_guard<std::mutex> hold(pinned_mutex); pinned_blocks[static_cast<const char*>(p)] = n; }
    return {p, p, &pinned_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
PinnedAllocator pinned_allocator;
}
// A guard for a device that computes nothing: one device, one stream, events that are always complete.
template <c10::DeviceType D>
struct QuietGuard final : public c10::impl::NoOpDeviceGuardImpl<D> {
  c10::Stream stream() const { return c10::Stream(c10::Stream::DEFAULT, c10::Device(D, 0)); }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(D, 0); }
  c10::Device getDevice() const override { return c10::Device(D, 0); }
  c10::Stream getStream(c10::Device) const noexcept override { return stream(); }
  c10::Stream getDefaultStream(c10::Device) const override { return stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return stream(); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return stream(); }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    static int token = 0;
    *event = &token;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, QuietGuard<c10::DeviceType::CUDA>);
namespace at {
// CUDA as torch's accelerator (the autograd engine syncs streams of the accelerator's type only).
struct FakeCUDAHooks : public CUDAHooksInterface {
  FakeCUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  void init() const override {}
  bool isPinnedPtr(const void* data) const override { return pinned(data); }
  Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}
"""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _build() -> Path:
    """The library for this torch install, compiled once into the user's cache."""
    tdir = _torch_dir()
    key = hashlib.sha256((_SOURCE + str(tdir) + (tdir / "version.py").read_text()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "longpack"
    lib = cache / f"fake_cuda_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "fake_cuda.cpp", Path(tmp) / "fake_cuda.so"
        src.write_text(_SOURCE)
        cmd = ["g++", "-O1", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{tdir / 'include'}", str(src),
               f"-L{tdir / 'lib'}", f"-Wl,-rpath,{tdir / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"building the fake CUDA device failed ({' '.join(cmd[:2])} ...): "
                               f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
        os.replace(out, lib)
    return lib


def activate() -> None:
    """Register the fake CUDA device; call before anything imports torch (refused after)."""
    if "torch" in sys.modules:
        raise RuntimeError("fakegpu.activate() must run before torch is imported")
    ctypes.CDLL(str(_build()), mode=ctypes.RTLD_GLOBAL)


def _tensors(args: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]


class DeviceCheck:
    """Enter to run host work for real and device work fake; read ``violations`` and the ``counts`` (``syncs``,
    ``h2d``, ``h2d_blocking``, ``attention_calls``, ``collective_bytes_<dtype>``: see the module docstring).
    ``reset()`` zeroes the counters between measurements."""

    def __init__(self) -> None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
        from torch.utils._python_dispatch import TorchDispatchMode

        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.violations: list[str] = []
        self.counts: Counter[str] = Counter()
        check = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                kwargs = kwargs or {}
                tensors = _tensors((args, kwargs))
                on_device = [t for t in tensors if t.device.type != "cpu"]
                target = kwargs.get("device")
                if not on_device and not any(isinstance(t, FakeTensor) for t in tensors) and (
                        target is None or torch.device(target).type == "cpu"):
                    from torch.utils._python_dispatch import _disable_current_modes

                    with _disable_current_modes():  # host work: real tensors, real values
                        return func(*args, **kwargs)
                check._inspect(func, tensors, on_device, target, args, kwargs)
                if func is torch.ops.aten._local_scalar_dense.default:
                    return 0  # a fake tensor has no value; the sync is counted
                return func(*args, **kwargs)

        self._mode = _Mode()

    def _inspect(self, func: Any, tensors: list, on_device: list, target: Any, args: Any, kwargs: dict) -> None:
        import torch

        name = str(func)
        if func.namespace in ("c10d", "_c10d_functional"):
            host = [tuple(t.shape) for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            if host:
                self.violations.append(f"{name}: host tensor(s) {host} handed to a collective")
            for t in tensors:  # what each collective moves, by dtype ("collective_bytes_float32", ...)
                self.counts[f"collective_bytes_{str(t.dtype).removeprefix('torch.')}"] += t.numel() * t.element_size()
            op = name.split(".")[1].strip("_")  # allreduce, reduce_scatter_base, allgather, ...
            self.counts[f"collective_{op}_calls"] += 1
            self.counts[f"collective_{op}_bytes"] += max((t.numel() * t.element_size() for t in tensors), default=0)
            return
        if "_to_copy" in name or name.startswith("aten.copy_"):
            copy_ = name.startswith("aten.copy_")
            src = args[1] if copy_ else args[0]
            dst = args[0].device.type if copy_ else (torch.device(target).type if target is not None
                                                     else src.device.type)
            if src.device.type == "cpu" and dst != "cpu":
                self.counts["h2d"] += 1
                quiet = bool(args[2]) if copy_ and len(args) > 2 else bool(kwargs.get("non_blocking", False))
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():  # the host tensor asked itself, not through the fake mode
                    pinned = src.is_pinned()
                if not (quiet and pinned):
                    self.counts["h2d_blocking"] += 1
            elif src.device.type != "cpu" and dst == "cpu":
                self.counts["syncs"] += 1  # device to host: the host waits for the device
            return
        if on_device and "_for_cpu" in name:
            self.violations.append(f"{name}: a CPU-only kernel reached with CUDA tensors")
        if on_device and ("attention" in name or "varlen" in name):
            self.counts["attention_calls"] += 1
            if any(t.dtype == torch.bool and t.dim() >= 2 for t in on_device):
                self.violations.append(f"{name}: an explicit boolean attention mask on CUDA")
        if on_device and name == "aten._local_scalar_dense.default":
            self.counts["syncs"] += 1
        host = [tuple(t.shape) for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and host:
            self.violations.append(f"{name}: host tensor(s) {host} mixed with CUDA tensors")

    @property
    def syncs(self) -> int:
        return self.counts["syncs"]

    def reset(self) -> None:
        self.violations.clear()
        self.counts.clear()

    def __enter__(self) -> DeviceCheck:
        self.fake.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self.fake.__exit__(*exc)
