"""CPU time of the processes in a benchmark, per process and per thread, from /proc (Linux).

A process's CPU time is utime + stime of /proc/<pid>/stat; a thread's, the same fields of
/proc/<pid>/task/<tid>/stat. CPU% over a window = CPU seconds in it / its wall seconds x 100,
so 100% is one core busy the whole window and a process can exceed 100%.

Two ways to bracket a window:
  - `snapshot()` at its start and end, from the thread that drives the load (in-process paths);
  - a `CpuSampler`, which snapshots every `interval_s` on its own thread, for loads run by other
    processes (loadgen's spawned workers), whose start and end are known only afterwards: the
    window's CPU is the difference of the last sample at or before its start and the first at
    or after its end (the services are idle outside the window, so the extra fraction of an
    interval costs them nothing; it is divided by the window's own length). A process or thread
    that exited in between (a worker done with its share) counts with its last sampled time.
Threads are named by their kernel name (comm) - Python threads all share the interpreter's -
and `main` marks the process's first thread (the asyncio loop of a gRPC service); threads of a
role's second and later processes (loadgen's workers) are prefixed with their pid.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
TOP_THREADS = 6  # threads listed per process, busiest first
MIN_THREAD_CPU_PCT = 1.0  # quieter threads are left out of the list
SAMPLE_INTERVAL_S = 0.1  # CpuSampler's; a window's CPU is bracketed to within one interval

# role ("inference", "bench client", ...) → the pids that play it, asked at every snapshot
# (a load generator's workers come and go).
RolePids = Callable[[], dict[str, list[int]]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    time_s: float  # time.monotonic()
    process_ticks: dict[int, tuple[str, int]]  # pid → (role, CPU ticks)
    thread_ticks: dict[tuple[int, int], tuple[str, str, int]]  # (pid, tid) → (role, name, ticks)

    def updated_by(self, later: "Snapshot") -> "Snapshot":
        """`later`, keeping the last times of what exited since this one."""
        return Snapshot(later.time_s, {**self.process_ticks, **later.process_ticks},
                        {**self.thread_ticks, **later.thread_ticks})


def _read_stat(path: str) -> tuple[str, int] | None:
    """(comm, utime + stime in ticks) of a /proc stat file; None if the task is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    close = text.rindex(")")  # comm may hold spaces and parentheses: it ends at the last ")"
    fields = text[close + 2:].split()  # fields[0] is field 3 (state): utime is 14, stime 15
    return text[text.index("(") + 1:close], int(fields[11]) + int(fields[12])


def thread_ids(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from each of its threads' /proc children list)."""
    children = []
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(child) for child in f.read().split()]
        except FileNotFoundError:
            pass
    return children


def command_line(pid: int) -> str:
    """`pid`'s command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def snapshot(role_pids: dict[str, list[int]], *, names: dict[int, str] | None = None) -> Snapshot:
    """CPU ticks of every role's processes and threads now; `names` overrides thread names by
    tid (the Python thread names of this process)."""
    process_ticks: dict[int, tuple[str, int]] = {}
    thread_ticks: dict[tuple[int, int], tuple[str, str, int]] = {}
    for role, pids in role_pids.items():
        for pid in pids:
            stat = _read_stat(f"/proc/{pid}/stat")
            if stat is None:
                continue
            process_ticks[pid] = (role, stat[1])
            for tid in thread_ids(pid):
                thread = _read_stat(f"/proc/{pid}/task/{tid}/stat")
                if thread is not None:
                    name = (names or {}).get(tid) or ("main" if tid == pid else thread[0])
                    if pid != pids[0]:  # a role's other processes (loadgen workers): named by pid
                        name = f"{pid}/{name}"
                    thread_ticks[(pid, tid)] = (role, name, thread[1])
    return Snapshot(time.monotonic(), process_ticks, thread_ticks)


def cpu_usage(before: Snapshot, after: Snapshot, window_s: float) -> dict[str, dict]:
    """Per role: CPU% of its processes over `window_s` (all, and each), and its busiest threads."""
    scale = 100.0 / CLOCK_TICKS_PER_S / max(window_s, 1e-9)
    usage: dict[str, dict] = {}
    for pid, (role, ticks) in after.process_ticks.items():
        previous = before.process_ticks.get(pid)
        role_usage = usage.setdefault(role, {"cpu_pct": 0.0, "threads": [], "processes": []})
        pct = (ticks - (previous[1] if previous else 0)) * scale
        role_usage["cpu_pct"] += pct
        role_usage["processes"].append({"pid": pid, "cpu_pct": pct})  # in the role's order: its first process first
    for key, (role, name, ticks) in after.thread_ticks.items():
        previous = before.thread_ticks.get(key)
        pct = (ticks - (previous[2] if previous else 0)) * scale
        if pct >= MIN_THREAD_CPU_PCT:
            usage[role]["threads"].append({"tid": key[1], "name": name, "cpu_pct": pct})
    for role in usage.values():
        role["threads"] = sorted(role["threads"], key=lambda t: -t["cpu_pct"])[:TOP_THREADS]
    return usage


class CpuSampler:
    """Snapshots `role_pids()` every `interval_s` on a daemon thread while in a `with` block."""

    def __init__(self, role_pids: RolePids, interval_s: float = SAMPLE_INTERVAL_S):
        self._role_pids = role_pids
        self._interval_s = interval_s
        self._samples: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._samples.append(snapshot(self._role_pids()))
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._samples.append(snapshot(self._role_pids()))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._samples.append(snapshot(self._role_pids()))

    def usage(self, start_s: float, end_s: float) -> dict[str, dict]:
        """cpu_usage over [start_s, end_s] (monotonic seconds), bracketed by the samples."""
        samples = list(self._samples)
        times = [sample.time_s for sample in samples]
        first = max(0, bisect_right(times, start_s) - 1)
        last = min(len(samples) - 1, bisect_left(times, end_s))
        after = functools.reduce(Snapshot.updated_by, samples[first + 1:last + 1], samples[first])
        return cpu_usage(samples[first], after, end_s - start_s)
