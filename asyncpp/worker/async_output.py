"""Sampled tokens that stay on the device while the next step is enqueued (async output).

On CUDA a step's sampled tokens need not reach the host before the next step
runs. The sampler leaves them in a device tensor; a non-blocking copy into
pinned memory, marked by an event, lets the host learn them later
(`AsyncSample`). Meanwhile the next step's placeholders are filled on the
device from that tensor (`DeviceTokens`), so the stage can prepare and launch
step N+1 while step N computes, and report step N once its copy is done.
The host's work for a step (the engine's scheduling, the stage's input
preparation and graph launch) then overlaps the device's work on the one
before, as vLLM's async scheduling does with its `AsyncModelRunnerOutput`.

Only a step whose sampling needs nothing more of the host runs this way
(`ModelRunner.can_defer`): no logprobs, penalties or seeds (the next draw
would read a token history the host has not updated yet), no speculative
proposer and no KV connector. Any other step is sampled as before, and its
tokens are recorded on the host at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from asyncpp.host_copy import to_device
from asyncpp.worker.outputs import ModelRunnerOutput


class DeviceSample:
    """One step's sampled tokens (one per request) on the device: what the next step's placeholders
    read. On the first of several stages they came through the token ring and never reach its host."""

    def __init__(self, step_id: int, req_ids: list[str], sampled: torch.Tensor) -> None:
        self.step_id = step_id
        self.req_ids = req_ids
        self.device_tensor = sampled  # [num_reqs] int64


class AsyncSample(DeviceSample):
    """One step's sampled tokens (one per request), on their way to the host."""

    def __init__(self, step_id: int, req_ids: list[str], sampled: torch.Tensor) -> None:
        super().__init__(step_id, req_ids, sampled)
        if sampled.device.type == "cuda":
            self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self._host.copy_(sampled, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = sampled, None

    def is_ready(self) -> bool:
        """The copy to the host is done (never blocks)."""
        return self._event is None or self._event.query()

    def host_tensor(self) -> torch.Tensor:
        """The tokens on the host, waiting for the copy if it is still running."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def token_ids(self) -> list[int]:
        return self.host_tensor().tolist()


class DeviceTokens:
    """Per request, where its latest sampled token is: in `host` (a plain int) or still only on the
    device (a row of a `DeviceSample`: an `AsyncSample` not yet resolved, or one that came through
    the token ring). Whichever was recorded last wins."""

    def __init__(self) -> None:
        self.host: dict[str, int] = {}
        self.pending: dict[str, tuple[DeviceSample, int]] = {}

    def record(self, req_ids: Iterable[str], token_ids: Iterable[int]) -> None:
        """Tokens the host knows now (a step sampled synchronously, or by another stage)."""
        for req_id, token_id in zip(req_ids, token_ids):
            self.host[req_id] = token_id
            self.pending.pop(req_id, None)

    def add_pending(self, sample: DeviceSample) -> None:
        for row, req_id in enumerate(sample.req_ids):
            self.pending[req_id] = (sample, row)

    def resolve(self, sample: AsyncSample, token_ids: list[int]) -> None:
        """`sample`'s tokens reached the host: they become the latest of the requests for which
        nothing newer was recorded since (and that still live)."""
        for req_id, token_id in zip(sample.req_ids, token_ids):
            entry = self.pending.get(req_id)
            if entry is not None and entry[0] is sample:
                del self.pending[req_id]
                self.host[req_id] = token_id

    def forget(self, req_id: str) -> None:
        self.host.pop(req_id, None)
        self.pending.pop(req_id, None)

    def get(self, req_id: str, default: int = 0) -> int:
        """A request's latest token on the host (`default` if it is only on the device)."""
        return self.host.get(req_id, default) if req_id not in self.pending else default

    def fill_on_device(self, input_ids: torch.Tensor, rows: np.ndarray, req_ids: list[str]) -> None:
        """Write, on the device, the pending tokens of `req_ids` into `input_ids[rows]` (row i gets
        request i's); rows whose request has no pending token are left as they are."""
        by_sample: dict[int, tuple[DeviceSample, list[int], list[int]]] = {}
        for row, req_id in zip(rows.tolist(), req_ids):
            entry = self.pending.get(req_id)
            if entry is None:
                continue
            sample, src = entry
            _, dst_rows, src_rows = by_sample.setdefault(id(sample), (sample, [], []))
            dst_rows.append(row)
            src_rows.append(src)
        for sample, dst_rows, src_rows in by_sample.values():
            dst = to_device(dst_rows, input_ids.device, torch.int64)
            src = to_device(src_rows, input_ids.device, torch.int64)
            input_ids.index_copy_(0, dst, sample.device_tensor.index_select(0, src))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.host or req_id in self.pending


class PendingOutput:
    """A step's `ModelRunnerOutput`: ready now (`PendingOutput.ready`), or once its `AsyncSample`
    has reached the host, when `get` builds it (`finish`, called once)."""

    def __init__(self, sample: AsyncSample | None, finish: Callable[[], ModelRunnerOutput]) -> None:
        self.sample = sample
        self._finish = finish
        self._output: ModelRunnerOutput | None = None

    @staticmethod
    def ready(output: ModelRunnerOutput) -> PendingOutput:
        return PendingOutput(None, lambda: output)

    @property
    def is_deferred(self) -> bool:
        return self.sample is not None

    def is_ready(self) -> bool:
        return self.sample is None or self.sample.is_ready()

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._finish()
        return self._output
