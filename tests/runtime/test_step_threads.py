"""A stage runs each plan with its lent thread count and takes its own back, calling torch only on a change."""

from __future__ import annotations

import torch

from asyncpp.runtime.stage_process import StepThreads


def test_lent_threads_then_own_again():
    calls: list[int] = []
    threads = StepThreads(1, set_num_threads=calls.append)
    threads.apply(0)  # the stage's own count is set already
    threads.apply(2)
    threads.apply(2)
    threads.apply(0)
    threads.apply(0)
    threads.apply(2)
    assert calls == [2, 1, 2] and threads.current == 2


def test_sets_torch_threads():
    own = torch.get_num_threads()
    threads = StepThreads(own)
    try:
        threads.apply(own + 1)
        assert torch.get_num_threads() == own + 1
        threads.apply(0)
        assert torch.get_num_threads() == own
    finally:
        torch.set_num_threads(own)
