"""Process helpers for the actors' shells: die with the parent, find descendants, tell a live
process from a zombie. Linux (/proc, prctl); no psutil."""

from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so a killed agent leaves no worker."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass




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


