"""How many cores this process may use (sizes thread pools and the pieces a text is tokenized in)."""

from __future__ import annotations

import os
from pathlib import Path


def available_cores() -> int:
    """The cores this process may use: the cgroup's CPU quota (a pod's limit) where one is set,
    else the CPUs it may be scheduled on."""
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return num_cpus
    if quota == "max":
        return num_cpus
    return max(1, min(num_cpus, int(quota) // int(period)))
