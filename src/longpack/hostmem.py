"""How much memory this process may still take on this host: the smallest of what the kernel reports available
(``MemAvailable``) and what the process's own limits leave (``ulimit -v``: RLIMIT_AS less the address space in
use; RLIMIT_DATA). None where none of them can be read (not Linux)."""

from __future__ import annotations

import resource

__all__ = ["available_bytes"]


def _meminfo(key: str, path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes() -> int | None:
    out = []
    host = _meminfo("MemAvailable")
    if host is not None:
        out.append(host)
    used = _meminfo("VmSize", "/proc/self/status")
    for limit, in_use in ((resource.RLIMIT_AS, used), (resource.RLIMIT_DATA, None)):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY:
            out.append(max(0, soft - (in_use or 0)))
    return min(out) if out else None
