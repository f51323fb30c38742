"""Faults no input check can catch, injected into a `longpack` subprocess (test-only).

:func:`faulty_env` returns an environment whose PYTHONPATH loads a ``sitecustomize`` at interpreter start. On rank
``rank``, kind "raise" makes the step runner's ``run_micro_batches`` raise IndexError; kind "kill" SIGKILLs the
process as it enters ``checkpoint.save`` for the ``at``-th time (1: the first checkpoint).
"""

import os

FAULT = '''
import importlib.util, os, signal, sys

TARGET = {"raise": ("longpack.runtime.kernel.step_fn", "run_micro_batches"),
          "kill": ("longpack.runtime.run.checkpoint", "save")}
CALLS = [0]

class _Hook:
    def find_spec(self, name, path, target=None):
        module_name, attr = TARGET[os.environ["FAULT_KIND"]]
        if name != module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
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
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("FAULT_RANK"):
    sys.meta_path.insert(0, _Hook())
'''


def faulty_env(tmp_path, kind: str, rank: int = 1, at: int = 1) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
            "FAULT_RANK": str(rank), "FAULT_KIND": kind, "FAULT_AT": str(at)}
