"""Processors the simulated work runs on: a device of its own, or CPU cores shared by everything
computing on them at once.

A ``Task`` is a number of ``units`` of work (denoising steps; one update; a process start), each
taking ``unit_s`` seconds on a processor of its own plus ``delay_s`` seconds that take no processor
(``runtime.step_delay_s``: a modelled slower device sleeps). A ``Cores`` pool runs its tasks
together: with ``n`` tasks on it, each unit takes ``unit_s x slowdown(n) + delay_s``, where
``slowdown`` is what was measured with ``n`` processes computing at once on the pool's cores
(``spotlight.sim.timing.Contention``); ``Cores(clock)`` without one is a device per task (slowdown
1 at any ``n``: a GPU per worker). Whenever a task joins, leaves or changes its end, every task's
progress so far is booked at its old rate and its end rescheduled at the new one, so a task's
progress is exact between those moments (processor sharing).

Knows the clock and the work in units; nothing of nodes, queues or what the work is.
"""

from __future__ import annotations

from collections.abc import Callable

from spotlight.sim.clock import Timer, VirtualClock


class Task:
    """Work on a ``Cores`` pool (module docstring). ``end``: the units at which ``on_done`` runs."""

    __slots__ = ("unit_s", "delay_s", "end", "on_done", "done", "t", "rate", "timer")

    def __init__(self, units: float, unit_s: float, delay_s: float, on_done: Callable[[], None],
                 now: float) -> None:
        self.unit_s, self.delay_s, self.end, self.on_done = unit_s, delay_s, units, on_done
        self.done, self.t = 0.0, now  # units booked up to time t
        self.rate = 0.0  # units per second since then
        self.timer: Timer | None = None


class Cores:
    """A pool of processors shared by its tasks (module docstring)."""

    def __init__(self, clock: VirtualClock, slowdown: Callable[[int], float] | None = None) -> None:
        self.clock, self.slowdown = clock, slowdown
        self.tasks: dict[Task, None] = {}  # in joining order

    def start(self, units: float, unit_s: float, on_done: Callable[[], None], delay_s: float = 0.0) -> Task:
        """A task of ``units`` joins now; ``on_done`` runs when it has done them."""
        task = Task(units, unit_s, delay_s, on_done, self.clock())
        self._changed(task, join=True)
        return task

    def stop(self, task: Task) -> None:
        """``task`` leaves now (done, dropped or cut short); its progress stays readable."""
        if task in self.tasks:
            self._changed(task, leave=True)

    def end_at(self, task: Task, units: float, on_done: Callable[[], None]) -> None:
        """``task`` ends after ``units`` (not below its progress) and then runs ``on_done`` instead."""
        self._book(task)
        task.end, task.on_done = max(units, task.done), on_done
        if task in self.tasks:
            self._plan(task)

    def progress(self, task: Task) -> float:
        """Units ``task`` has done by now."""
        if task not in self.tasks:
            return task.done
        return min(task.end, task.done + task.rate * (self.clock() - task.t))

    def unit_time(self, task: Task) -> float:
        """Seconds one unit of ``task`` takes at the pool's present load."""
        n = len(self.tasks) if task in self.tasks else len(self.tasks) + 1
        return task.unit_s * (1.0 if self.slowdown is None else self.slowdown(n)) + task.delay_s

    def _changed(self, task: Task, join: bool = False, leave: bool = False) -> None:
        """``task`` joins or leaves: on shared cores every task's rate changes; on devices only its."""
        shared = self.slowdown is not None
        for t in (self.tasks if shared else (task,)):
            self._book(t)
        if join:
            self.tasks[task] = None
        if leave:
            del self.tasks[task]
            if task.timer is not None:
                task.timer.cancel()
        for t in (self.tasks if shared else ((task,) if join else ())):
            self._plan(t)

    def _book(self, task: Task) -> None:
        now = self.clock()
        if task in self.tasks:
            task.done = min(task.end, task.done + task.rate * (now - task.t))
        task.t = now

    def _plan(self, task: Task) -> None:
        task.rate = 1.0 / max(self.unit_time(task), 1e-12)
        if task.timer is not None:
            task.timer.cancel()
        left = max(task.end - task.done, 0.0)
        task.timer = self.clock.call_at(task.t + left / task.rate, lambda: self._finish(task))

    def _finish(self, task: Task) -> None:
        self.stop(task)
        task.done = task.end
        task.on_done()
