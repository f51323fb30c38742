"""The planner contract and registry: :class:`Planner` (a subclass sets ``name`` and plans one global batch into
a :class:`~longpack.plan.Step` in ``plan_batch``), :func:`register` (the class decorator every built-in planner
uses; ``longpack.planners`` imports them all), :func:`get_planner` and :func:`check_options`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..model import UnknownNameError
from ..plan import Plan, Step
from .base import Batch, PlanContext
from .stream import make_plan

__all__ = ["Planner", "PLANNERS", "register", "get_planner", "check_options"]


class Planner:
    """Base class: subclasses set ``name`` and implement :meth:`plan_batch`."""

    name: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()  # the --opt keys this planner reads

    def plan_batch(self, batch: Batch, ctx: PlanContext) -> Step:
        raise NotImplementedError

    def plan_many(self, batches: Sequence[Batch], ctx: PlanContext) -> Sequence[Step]:
        """The steps of ``batches``, equal to :meth:`plan_batch` of each; a planner that can plan many batches
        at once (in columns, :mod:`longpack.columns`) overrides this."""
        return tuple(self.plan_batch(b, ctx) for b in batches)

    whole_run: ClassVar[bool] = False  # True where plan() lays out the whole run at once (HBP): planned up front

    def plan(self, lengths: np.ndarray, batches: Sequence[np.ndarray], ctx: PlanContext, *,
             max_len: int | None = None, overlong: str = "split") -> Plan:
        return make_plan(self, lengths, batches, ctx, max_len=max_len, overlong=overlong)


PLANNERS: dict[str, Callable[[], Planner]] = {}


def register(cls: type[Planner]) -> type[Planner]:
    """Class decorator adding a planner to the registry under ``cls.name``."""
    PLANNERS[cls.name] = cls
    return cls


_FLAGS = {"pack_len": "--pack-len", "micro_batch_size": "--micro-batch-size"}  # options with a flag of their own


def check_options(planners: Sequence[str], options: Mapping[str, Any]) -> None:
    """Refuse (one line) an ``--opt`` key that none of ``planners`` reads, naming the options they do take."""
    known = {name: get_planner(name).options for name in planners}
    for key in dict(options):
        if not any(key in opts for opts in known.values()):
            takes = "; ".join(f"{name} takes {', '.join(opts) if opts else 'no options'}"
                              for name, opts in known.items())
            flag = _FLAGS.get(key, f"--opt {key}")
            raise ValueError(f"{flag}: no such option for {', '.join(planners)} ({takes})")


def get_planner(name: str) -> Planner:
    try:
        return PLANNERS[name]()
    except KeyError:
        raise UnknownNameError(f"unknown planner {name!r}; choose one of: {', '.join(sorted(PLANNERS))}") from None
