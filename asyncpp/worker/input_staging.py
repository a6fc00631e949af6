"""A step's index arrays to the device in one copy, through persistent pinned buffers.

Input preparation makes a handful of small int64 arrays per step (token ids,
positions, slot mapping, per-row block table and context lengths, rows,
logits rows). Copied one by one (`asyncpp.host_copy.to_device`) each costs a
pinned allocation, a host copy and a launch: about 1.2-1.6 ms of a stage's
host time a step at 64-256 rows on an H200's host, more than the forward's
launch. `StagedUpload` writes them instead into one persistent pinned buffer
and returns each one's device view at once (a slice of one persistent device
buffer); `flush` then copies everything staged since the last flush in one
non-blocking copy, before any kernel that reads the views is enqueued.

Reuse: the device buffer is rewritten by the next step's copy, which the
stream runs after this step's kernels (every reader is on that stream). A host
buffer is rewritten only after the copy from it has run (`num_buffers` of
them in turn, each with an event; the host is at most a step or two ahead).

Off the GPU nothing is staged: `stage` returns the array itself as a tensor
(`staged=True` forces the staging path on CPU tensors, which is how CI checks
it gives the same inputs). An array that does not fit what is left of the
buffer goes the one-by-one way.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncpp.host_copy import to_device


class StagedUpload:
    def __init__(self, capacity: int, device: torch.device | str, staged: bool | None = None, num_buffers: int = 3) -> None:
        self.device = torch.device(device)
        self.is_staged = self.device.type == "cuda" if staged is None else staged
        self.capacity = capacity if self.is_staged else 0
        pin = self.device.type == "cuda"
        self.hosts = [torch.zeros(self.capacity, dtype=torch.int64, pin_memory=pin) for _ in range(num_buffers if self.is_staged else 0)]
        self.host_arrays = [h.numpy() for h in self.hosts]
        self.events: list[torch.cuda.Event | None] = [None] * len(self.hosts)
        self.device_buffer = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.current = 0  # the host buffer of this step
        self.used = self.flushed = 0  # elements staged this step, and copied

    def begin_step(self) -> None:
        """A new step: the next host buffer, once the copy that last read it has run."""
        if not self.is_staged:
            return
        self.current = (self.current + 1) % len(self.hosts)
        event = self.events[self.current]
        if event is not None:
            event.synchronize()
        self.used = self.flushed = 0

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """`array` (int64 values) on the device: a view whose contents arrive with the next `flush`."""
        n = array.size
        if not self.is_staged or self.used + n > self.capacity:
            return to_device(np.asarray(array, dtype=np.int64), self.device)
        start, self.used = self.used, self.used + n
        self.host_arrays[self.current][start : self.used] = array.reshape(-1)
        return self.device_buffer[start : self.used].view(array.shape)

    def flush(self) -> None:
        """Copy what was staged since the last flush, in one non-blocking copy."""
        if self.used == self.flushed:
            return
        src = self.hosts[self.current][self.flushed : self.used]
        self.device_buffer[self.flushed : self.used].copy_(src, non_blocking=True)
        self.flushed = self.used
        if self.device.type == "cuda":
            event = self.events[self.current] or torch.cuda.Event()
            event.record()
            self.events[self.current] = event
