"""Training steps, counted once for every tool: ``optimizer.step()`` calls finished.

One process-wide counter, fed by torch.optim's global step hooks (``register_optimizer_step_pre_hook`` /
``_post_hook``), installed while at least one tool is started (``acquire``/``release``, counted) and never reset.
Each tool keeps the count at its own start (``acquire`` returns it) and numbers steps from there: a call's step is
``STEPS.count - base``, the optimizer steps finished since that tool started. Tools started together therefore agree,
and a recording started later still begins at step 0 (``compare_runs`` aligns two recordings by step).

Per handled call this is one integer read; the hooks run once per optimizer step.

>>> base = STEPS.acquire()
>>> STEPS.count - base    # 0 until an optimizer's step() finished
0
>>> STEPS.release()
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch


class StepCounter:
    """``count``: optimizer steps finished while hooked (an int, read without a lock); ``in_optimizer``: whether an
    optimizer's ``step()`` is running now (calls made there are the optimizer's)."""

    def __init__(self) -> None:
        self.count = 0
        self.in_optimizer = False
        # run as an optimizer's step() begins, on the program's thread, backward's work done: the started tools'
        # checks of collectives followed through their futures (collective_waits.py)
        self.before_step: list[Callable[[], None]] = []
        # run as an optimizer's step() returns, the count moved on: a run recording's step to disk (OpCapture)
        self.after_step: list[Callable[[], None]] = []
        self._users = 0
        self._hooks: tuple = ()
        self._lock = threading.Lock()

    def acquire(self) -> int:
        """Count steps from now on (hooks installed by the first user); return the count now, the caller's base."""
        with self._lock:
            self._users += 1
            if not self._hooks:
                from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

                # outside dynamo (partials: torch._disable_dynamo keeps its disabled form on the function it
                # wraps): a torch.compile'd optimizer step would trace them, and the lock breaks its graph
                outside = torch._disable_dynamo
                self._hooks = (register_optimizer_step_pre_hook(outside(functools.partial(self._stepping))),
                               register_optimizer_step_post_hook(outside(functools.partial(self._stepped))))
            return self.count

    def release(self) -> None:
        """One user less; the last one removes the hooks (the count is kept: bases stay valid)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if not self._users:
                for hook in self._hooks:
                    hook.remove()
                self._hooks = ()
                self.in_optimizer = False

    def _stepping(self, *_) -> None:
        for listener in list(self.before_step):
            listener()
        self.in_optimizer = True

    def _stepped(self, *_) -> None:
        with self._lock:
            self.in_optimizer = False
            self.count += 1
        for listener in list(self.after_step):
            listener()


STEPS = StepCounter()
