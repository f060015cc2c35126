"""The static inputs of a CUDA graph: named int32 fields packed in one device buffer, refilled
each step from pinned host memory with a single copy.

A captured graph reads fixed device addresses, so a step's values are written into the same
buffer every time: the host fills a pinned staging buffer (numpy view, no torch ops per field)
and one non-blocking copy moves all fields at once (an async DMA on CUDA). Fields a step does
not write keep older values; a graph reads only what its step wrote (a field's first rows, a
block table up to the context).

Two staging buffers are used in turn: with async scheduling the host stages step N+1 while
the copy of step N may not have run yet; the copy of step N-1 has (its results were read).
"""

from __future__ import annotations

import torch

from llmserve.inference.models.transfers import aligned_int32s


class StaticInputs:
    def __init__(self, field_lengths: dict[str, int], device: torch.device):
        self._offsets: dict[str, int] = {}
        total = 0
        for name, length in field_lengths.items():
            self._offsets[name] = total
            # Each field 16-byte aligned, as transfers.device_int32's views: a kernel reading it
            # is the variant an eager step's metadata launches (Triton keys pointer alignment).
            total += aligned_int32s(length)
        self._buffer = torch.zeros(total, dtype=torch.int32, device=device)
        # The device views a graph captures: fields[name] is [field_lengths[name]] int32.
        self.fields = {name: self._buffer[offset : offset + field_lengths[name]] for name, offset in self._offsets.items()}
        pin = device.type == "cuda"
        self._host = [torch.zeros(total, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._num_staged = 0

    def stage(self, values: dict[str, list[int]]) -> None:
        """Write each field's first len(values[name]) entries; queues one host-to-device copy."""
        host = self._host[self._num_staged % 2]
        self._num_staged += 1
        array = host.numpy()
        for name, field_values in values.items():
            offset = self._offsets[name]
            array[offset : offset + len(field_values)] = field_values
        self._buffer.copy_(host, non_blocking=True)
