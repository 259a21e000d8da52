"""Exclusive wall-clock timers, installed on methods for the duration of a measurement only.

A benchmark must not change what it measures, so nothing here lives in the cache code: the
methods to time are wrapped by :func:`patched` (a context manager that restores the originals on
exit, even on error), and each wrapper costs two ``time.perf_counter`` calls and a list push/pop.

Times are **exclusive**: a timed call that runs inside another timed call is charged to its own
category and subtracted from its caller's, so nested calls are never counted twice and the
categories of one step add up to at most the step's wall time.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from contextlib import contextmanager


class ExclusiveTimer:
    """Accumulate exclusive wall time per category over nested timed sections.

    ``enter(cat)`` / ``exit()`` bracket a section; ``totals[cat]`` is the time spent in sections
    of ``cat`` minus the time of the timed sections nested inside them.
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [category, start time, time of nested timed sections]

    def enter(self, category: str) -> None:
        """Open a section of ``category`` (nested inside the open one, if any)."""
        self._stack.append([category, self.clock(), 0.0])

    def exit(self) -> None:
        """Close the innermost open section and charge its exclusive time."""
        category, start, nested = self._stack.pop()
        elapsed = self.clock() - start
        self.totals[category] += elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextmanager
    def section(self, category: str):
        """``with timer.section(cat): ...`` times the block as one section of ``cat``."""
        self.enter(category)
        try:
            yield
        finally:
            self.exit()

    def take(self) -> dict[str, float]:
        """The totals so far, as a plain dict; the timer starts again from zero."""
        if self._stack:
            raise RuntimeError(f"{len(self._stack)} timed section(s) still open")
        out = dict(self.totals)
        self.totals = defaultdict(float)
        return out

    def wrap(self, fn, category: str):
        """``fn`` with every call timed as a section of ``category``."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.enter(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed


@contextmanager
def patched(timer: ExclusiveTimer, targets):
    """Time the methods ``targets`` (``(class, method name, category)``) while the block runs.

    Each method must be a plain function defined in that class's own body (an inherited method
    is timed through the class that defines it). The originals are restored on exit.
    """
    saved = []
    try:
        for owner, name, category in targets:
            original = owner.__dict__.get(name)
            if not inspect.isfunction(original):
                raise ValueError(f"{owner.__name__}.{name} is not a method defined in {owner.__name__}")
            saved.append((owner, name, original))
            setattr(owner, name, timer.wrap(original, category))
        yield timer
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _classes(base) -> list:
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


# The categories of a LeanCache step, in report order; "model" is the step minus all of them.
CATEGORIES = ("attention", "store", "policy", "alloc", "setup", "model")
POLICY_METHODS = ("begin_step", "update_scores", "after_store", "end_step", "apply_classes")


def lean_targets() -> list[tuple]:
    """What :func:`patched` wraps to break a LeanCache step down (see :data:`CATEGORIES`).

    * ``alloc``: ``LeanCache.grow_pages``, ``BidirectionalPageTable.grow``/``shrink``/``fit``/``settle``,
      ``FreePageList.allocate``/``release``;
    * ``store``: every policy's ``store`` (quantize the step's tokens into pages), less nested allocation.
      On a CPU a LeanKV prompt's layer runs its prompt-phase rule, page grant and recycle inside
      the store's one compiled call (``LeanCache.store_prompt_layer``), where no timer can split
      them: there they count as store;
    * ``policy``: every policy's ``begin_step``, ``update_scores``, ``after_store``, ``end_step``,
      ``apply_classes``, less nested store and allocation;
    * ``attention``: ``LeanCache.attend`` less everything nested in it;
    * ``setup``: ``LeanCache.begin_step``/``end_step``/``_store`` less nested policy work (masks,
      positions, step state).
    """
    from ..allocator import FreePageList
    from ..cache import LeanCache
    from ..page_table import BidirectionalPageTable
    from ..policy import _Base

    targets = [(LeanCache, "grow_pages", "alloc"), (BidirectionalPageTable, "grow", "alloc"),
               (BidirectionalPageTable, "shrink", "alloc"), (BidirectionalPageTable, "fit", "alloc"),
               (BidirectionalPageTable, "settle", "alloc"), (FreePageList, "allocate", "alloc"),
               (FreePageList, "release", "alloc"), (LeanCache, "attend", "attention"),
               (LeanCache, "begin_step", "setup"), (LeanCache, "end_step", "setup"), (LeanCache, "_store", "setup")]
    for cls in _classes(_Base):
        if "store" in cls.__dict__:
            targets.append((cls, "store", "store"))
        targets += [(cls, m, "policy") for m in POLICY_METHODS if m in cls.__dict__]
    return targets


def breakdown(totals: dict[str, float], step_time: float) -> dict[str, float]:
    """Seconds per category of :data:`CATEGORIES`; ``model`` is ``step_time`` less the timed ones."""
    out = {c: totals.get(c, 0.0) for c in CATEGORIES if c != "model"}
    out["model"] = step_time - sum(out.values())
    return out


def interleaved_best(fns: dict, rounds: int, before=None, clock=time.perf_counter) -> dict:
    """Fastest wall time (s) of each callable of ``fns`` (name -> callable) over ``rounds`` rounds.

    Each round calls every one once, in an order rotated from the round before, so a change in the
    machine's speed during the measurement hits all of them alike (timing two versions in two
    separate runs on a shared machine can differ by far more than the change). ``before``, when
    given, runs before each call, outside the timed span (e.g. to evict the caches).
    """
    names = list(fns)
    best = dict.fromkeys(names, float("inf"))
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if before is not None:
                before()
            t0 = clock()
            fns[name]()
            best[name] = min(best[name], clock() - t0)
    return best
