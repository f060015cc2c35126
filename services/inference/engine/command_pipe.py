"""CommandPipe: engine commands written into the engine-core process's pipe from the event loop,
never blocking it.

Why not a sender thread: a command handed to a thread waits for that thread to wake and take
the GIL (a few hundred µs measured on a loaded host, on the path of every request's first
token), and the thread only ever mattered when the pipe was full. Here a command is pickled
and written at once when the pipe has room (the usual case: the core drains it every step);
what the pipe does not take waits in a buffer that `loop.add_writer` flushes as room appears,
in order.

The frames are multiprocessing.Connection's (a 4-byte big-endian length, then the pickle), so
the engine-core process reads them with Connection.recv as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

# Connection's framing for payloads under 2 GiB (a command is a request: its prompt and options).
_HEADER = struct.Struct("!i")
_MAX_PAYLOAD_BYTES = 0x7FFFFFFF


class CommandPipe:
    """The write end of the command pipe, used from one event loop."""

    def __init__(self, connection: Connection, loop: asyncio.AbstractEventLoop):
        self._connection = connection  # kept: it owns the file descriptor
        self._fd = connection.fileno()
        os.set_blocking(self._fd, False)
        self._loop = loop
        self._unwritten = bytearray()  # frames the pipe has not taken yet, in order
        self._is_broken = False

    def send(self, command: object) -> None:
        """Write `command` now, or queue it behind what the pipe has not taken yet."""
        if self._is_broken:
            return
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > _MAX_PAYLOAD_BYTES:
            raise ValueError(f"engine command of {len(payload)} bytes exceeds the pipe's frame limit")
        frame = _HEADER.pack(len(payload)) + payload
        if self._unwritten:
            self._unwritten += frame
            return
        written = self._write(frame)
        if written < len(frame) and not self._is_broken:
            self._unwritten += frame[written:]
            self._loop.add_writer(self._fd, self._flush)

    @property
    def num_unwritten_bytes(self) -> int:
        return len(self._unwritten)

    def _flush(self) -> None:
        written = self._write(self._unwritten)
        del self._unwritten[:written]
        if not self._unwritten or self._is_broken:
            self._loop.remove_writer(self._fd)

    def _write(self, data: bytes | bytearray) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError as error:  # the engine-core process is gone: its reader reports that
            log.warning("engine-core process is gone; dropping commands (%s)", error)
            self._is_broken = True
            self._unwritten.clear()
            return 0
