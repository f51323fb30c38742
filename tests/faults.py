"""Faults no input check can catch, injected into a `longpack` subprocess (test-only).

:func:`faulty_env` returns an environment whose PYTHONPATH loads a ``sitecustomize`` at interpreter start (or, in a
command forked by tests/forked.py, before the command runs). On rank ``rank``, kind "raise" makes the step runner's
``run_micro_batches`` raise IndexError; kind "kill" SIGKILLs the process as it enters ``checkpoint.save`` for the
``at``-th time (1: the first checkpoint). The function is replaced as its module is imported, or at once where it
is imported already.
"""

import os

FAULT = '''
import importlib.util, os, signal, sys

TARGET = {"raise": ("longpack.runtime.kernel.step_fn", "run_micro_batches"),
          "kill": ("longpack.runtime.run.checkpoint", "save")}
CALLS = [0]

def _patch(module):
    attr = TARGET[os.environ["FAULT_KIND"]][1]
    real = getattr(module, attr)

    def faulty(*a, **k):
        if os.environ.get("RANK", "0") == os.environ["FAULT_RANK"]:
            CALLS[0] += 1
            if os.environ["FAULT_KIND"] == "kill" and CALLS[0] == int(os.environ["FAULT_AT"]):
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ["FAULT_KIND"] == "raise":
                raise IndexError("index 999 is out of bounds for dimension 0 with size 256")
        return real(*a, **k)
    setattr(module, attr, faulty)

class _Hook:
    def find_spec(self, name, path, target=None):
        if name != TARGET[os.environ["FAULT_KIND"]][0]:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("FAULT_RANK"):
    imported = sys.modules.get(TARGET[os.environ["FAULT_KIND"]][0])
    if imported is not None:  # imported already: a process forked by tests/forked.py
        _patch(imported)
    else:
        sys.meta_path.insert(0, _Hook())
'''


def faulty_env(tmp_path, kind: str, rank: int = 1, at: int = 1) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
            "FAULT_RANK": str(rank), "FAULT_KIND": kind, "FAULT_AT": str(at)}
