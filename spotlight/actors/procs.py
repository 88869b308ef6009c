"""Process helpers for the actors' shells and their supervisors (Linux: /proc, prctl; no psutil).

Child side: ``die_with_parent`` (never outlive the parent), ``announce_ready`` (the one line a
parent waits for, then every later stdout write goes to stderr, i.e. the log).
Parent side: ``spawn`` starts a child with its output in a log file and returns a ``Child``
whose ``ready`` future resolves at the readiness line and whose ``exited`` future resolves when
it exits — a watcher thread blocks in ``wait`` (no polling) and calls ``on_exit`` — so a
supervisor learns of a death at once; ``stop`` stops children with a grace period;
``descendants`` and ``alive`` find what is left.

This module knows processes, pipes and signals; nothing of the actors' protocols.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

DIE_WITH_PARENT_ENV = "SPOTLIGHT_DIE_WITH_PARENT"
"""Set (by ``spawn``) in a child's environment: the child calls ``die_with_parent`` itself."""
PARENT_PID_ENV = "SPOTLIGHT_PARENT_PID"
"""Set by a spawner to its own pid: ``die_with_parent`` then also catches a parent already gone."""


# --- child side -----------------------------------------------------------------------------------
def die_with_parent(only_if_asked: bool = False) -> None:
    """Linux: SIGKILL this process when its parent dies, so a killed agent leaves no worker.
    ``only_if_asked``: only when the parent set ``DIE_WITH_PARENT_ENV`` (a supervised child).
    A parent that died before this call (a node SIGKILLed while its workers still import) is
    caught too: when ``PARENT_PID_ENV`` names a pid that is no longer this process's parent, this
    process SIGKILLs itself here instead of living on as an orphan."""
    if only_if_asked and not os.environ.get(DIE_WITH_PARENT_ENV):
        return
    parent = os.environ.get(PARENT_PID_ENV, "")
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # after the prctl: a parent dying from here on fires it; one already gone left us reparented
    if parent.isdigit() and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGKILL)


def announce_ready(line: str) -> None:
    """Print the readiness line a parent waits for; from then on stdout is stderr (the child's
    log), so a parent that stops reading the pipe can never block a chatty child."""
    sys.stdout.write(line + "\n")  # one write: no other thread's output lands inside the line
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


# --- parent side ----------------------------------------------------------------------------------
def exit_text(status: int) -> str:
    """``status`` as Popen gives it, with the signal's name when a signal ended the process."""
    if status < 0:
        try:
            return f"status {status} ({signal.Signals(-status).name})"
        except ValueError:
            pass
    return f"status {status}"


class Child:
    """A process started by ``spawn``; see the module docstring."""

    def __init__(self, name: str, proc: subprocess.Popen, log_path: Path, ready_prefix: str,
                 on_exit: Callable[[Child], None] | None) -> None:
        self.name, self.proc, self.log_path, self._prefix = name, proc, log_path, ready_prefix
        self.ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        """The readiness line; raises ``ChildExited`` if the child's stdout closed before it."""
        self.exited: concurrent.futures.Future[int] = concurrent.futures.Future()
        """The exit status (Popen's: -N for signal N), once the child has exited and been reaped."""
        self._on_exit = on_exit
        self._drainer = threading.Thread(target=self._drain, name=f"{name}-stdout", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
        self._drainer.start()
        self._watcher.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        """Copy stdout to the log until EOF, resolving ``ready`` at the readiness line."""
        assert self.proc.stdout is not None
        with self.proc.stdout as out, open(self.log_path, "ab", buffering=0) as log:
            for raw in out:
                log.write(raw)
                if not self.ready.done() and raw.startswith(self._prefix.encode()):
                    self.ready.set_result(raw.decode(errors="replace").strip())
        if not self.ready.done():  # stdout closed before the line: it exited (or is exiting)
            status = self.proc.wait()
            self.ready.set_exception(ChildExited(f"{self.name} exited with {exit_text(status)} before it was "
                                                 f"ready; last log lines: {self.tail()}"))

    def _watch(self) -> None:
        self.exited.set_result(self.proc.wait())
        if self._on_exit is not None:
            self._on_exit(self)

    def tail(self, lines: int = 5, chars: int = 600) -> str:
        """The log's last non-empty lines, on one line (' | ' between them)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        last = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
        return (" | ".join(last) or "(empty log)")[-chars:]

    def death(self) -> str:
        """One line for a child that exited: its name, pid, exit status and last log lines."""
        return (f"{self.name} (pid {self.pid}) exited with {exit_text(self.proc.returncode)}; "
                f"last log lines ({self.log_path}): {self.tail()}")

    def wait_ready(self, timeout: float, abort: concurrent.futures.Future | None = None) -> str:
        """The readiness line; raises ``ChildExited`` if the child exited first, ``TimeoutError``
        after ``timeout``, and ``abort``'s exception if that future fails first (another child
        died meanwhile)."""
        waits = [self.ready] + ([abort] if abort is not None else [])
        done, _ = concurrent.futures.wait(waits, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        if abort is not None and abort in done:
            abort.result()
        if self.ready in done:
            return self.ready.result()
        raise TimeoutError(f"{self.name} not ready within {timeout}s (log: {self.log_path})")


class ChildExited(Exception):
    """A child exited before its readiness line (the message names it, its status, its log)."""


def spawn(name: str, cmd: list[str], *, log_path: Path, ready_prefix: str,
          on_exit: Callable[[Child], None] | None = None, env: dict[str, str] | None = None) -> Child:
    """Start ``cmd`` with stderr appended to ``log_path`` and stdout drained into it; the child
    dies with this process (``DIE_WITH_PARENT_ENV``) and has its own session, so a terminal's
    Ctrl-C reaches only the parent, which stops its children in order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), DIE_WITH_PARENT_ENV: "1",
           PARENT_PID_ENV: str(os.getpid())}
    with open(log_path, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True)
    return Child(name, proc, log_path, ready_prefix, on_exit)


def stop(children: list[Child], grace_s: float) -> list[Child]:
    """SIGTERM every live child, SIGKILL those still running after ``grace_s`` (0: at once);
    returns the ones that had to be killed. Every child is reaped on return."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    killed = []
    for c in children:
        try:
            c.exited.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            killed.append(c)
            c.proc.kill()
            c.exited.result()  # SIGKILL cannot be ignored: the watcher reaps it
    return killed


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (reads /proc; no psutil)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z":  # a zombie is already dead, only not yet reaped
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
