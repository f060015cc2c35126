"""The shm reaper: a small process that unlinks a producer's shared-memory segments when the
producer dies without doing it itself (SIGKILL, a crash, an exit that skipped its cleanup).

    producer ──"+name\\n" / "-name\\n"──▶ reaper's stdin        (before creating / after unlinking)
    producer exits or dies → its end of the pipe closes → the reaper reads EOF, waits
                             until the producer process is gone, unlinks every name
                             still registered, and exits

Why wait past EOF: at a normal exit Python closes the pipe while finalizing, before the C++
static destructors run, and torch's CUDA IPC reference-counter file (/dev/shm/torch_<pid>_<n>)
is unlinked by one of those destructors; a reaper that unlinked it first made that unlink fail
and torch call terminate() (the producer aborted at exit, seen on the H200). The producer is gone
when the kernel hands the reaper to another parent, which it does after every destructor.

Why not multiprocessing's resource_tracker: a process started with the spawn context shares its
parent's tracker, so a producer killed while its parent lives is not noticed until the parent
exits; and before Python 3.13 (no `track=False`, CPython gh-82300) every SharedMemory that
*attaches* registers too, so a consumer's tracker unlinks segments it did not create when the
consumer exits. Here only the producer registers, and each producer process has its own reaper.

The reaper is this file run as a script by path, with `-I -S`: standard library only, no
package import (no torch), started in ~20 ms. It ignores SIGINT and SIGTERM and has a session of
its own, so a signal to the producer's process group does not end it before the producer: it
ends only at EOF. The write end of the pipe is not inherited (O_CLOEXEC): only processes forked
without exec (which we never use) would keep the reaper waiting until they exit too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

SHM_DIR = "/dev/shm"


class ShmReaper:
    """The producer side: registers names to unlink should this process die."""

    def __init__(self) -> None:
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(self._owner_pid)],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def owner_pid(self) -> int:
        return self._owner_pid

    def register(self, name: str) -> None:
        """Call before creating `name`: a death between the two must not leak it."""
        self._send(b"+", name)

    def unregister(self, name: str) -> None:
        """Call after unlinking `name` yourself."""
        self._send(b"-", name)

    def _send(self, op: bytes, name: str) -> None:
        _check_name(name)
        with self._lock:
            self._process.stdin.write(op + name.encode() + b"\n")
            self._process.stdin.flush()


_process_reaper: ShmReaper | None = None
_process_reaper_lock = threading.Lock()


def process_reaper() -> ShmReaper:
    """This process's reaper, started on first use and alive until the process exits (its EOF
    is the process's death, however it dies)."""
    global _process_reaper
    with _process_reaper_lock:
        if _process_reaper is None or _process_reaper.owner_pid != os.getpid():
            _process_reaper = ShmReaper()
        return _process_reaper


def _check_name(name: str) -> None:
    if not name or "/" in name or "\n" in name or name in (".", ".."):
        raise ValueError(f"not a shared-memory segment name: {name!r}")


# --- the reaper process ---------------------------------------------------------------------


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:  # unlinked by its owner already, whose "-" we had not read yet
        pass


def _wait_for_exit(owner_pid: int) -> None:
    """Until the producer has exited: our parent is then another process (init or a subreaper).
    Polled: a pidfd would need Linux 5.3 and is no simpler."""
    while os.getppid() == owner_pid:
        time.sleep(0.005)


def main() -> None:
    owner_pid = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    names: set[str] = set()
    for line in sys.stdin.buffer:  # ends at EOF: the producer process is gone
        op, name = line[:1], line[1:].rstrip(b"\n").decode()
        try:
            _check_name(name)
        except ValueError:
            continue
        if op == b"+":
            names.add(name)
        elif op == b"-":
            names.discard(name)
    if names:
        _wait_for_exit(owner_pid)
    for name in names:
        _unlink(name)


if __name__ == "__main__":
    main()
