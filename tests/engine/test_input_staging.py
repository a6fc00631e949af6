"""Input preparation staged in one copy (`asyncpp.worker.input_staging`), driven step by step on CPU
tensors: every array of every step equals the one built and copied on its own, through prefill
chunks, decodes, mixed steps and placeholders filled on the device (async output); an array that
does not fit the staging buffer is copied on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.worker.input_staging import StagedUpload
from asyncpp.worker.step_inputs import StepInputBuffers
from tests.conftest import tiny_config, tiny_prompts
from tests.engine.test_async_output import _drive


def _arrays(inputs) -> dict[str, torch.Tensor]:
    rows = inputs.attn_meta.kernel_rows
    return {
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "logits_indices": inputs.logits_indices,
        "slot_mapping": inputs.attn_meta.slot_mapping,
        "rows": rows.rows,
        "block_table": rows.block_table,
        "context_lens": rows.context_lens,
    }


@pytest.mark.parametrize("capacity_per_token", [None, 3])
def test_staged_inputs_equal_the_one_by_one_copies_step_by_step(tiny_hf_dir, capacity_per_token):
    """`capacity_per_token` 3: the buffer holds only the first arrays of a step; the rest go alone."""
    config = tiny_config(tiny_hf_dir, scheduler={"max_num_batched_tokens": 48, "max_num_seqs": 8})
    engine = Engine(config)
    runner = engine.executor.runners[0]
    host_built = runner.buffers
    assert not host_built.upload.is_staged  # CPU: nothing staged by default
    staged = StepInputBuffers(48, host_built.block_size, "cpu", torch.float32, host_built.decode_kernel, 16, staged=True)
    if capacity_per_token is not None:
        staged.upload = StagedUpload(48 * capacity_per_token, "cpu", staged=True)
    steps = {"mixed": 0, "on_device": 0, "partly_staged": 0}

    host_prepare = host_built.prepare

    def prepare(plan, *args):
        expected = host_prepare(plan, *args)
        got = staged.prepare(plan, *args)
        for name, tensor in _arrays(expected).items():
            assert torch.equal(_arrays(got)[name], tensor), (plan.step_id, name)
        assert got.sampling_req_ids == expected.sampling_req_ids
        lens = {r.num_tokens for r in plan.scheduled}
        steps["mixed"] += len(lens) > 1
        steps["on_device"] += bool(plan.after_step_id is not None and args[0] is not None and args[0].pending)
        buffer = staged.upload.device_buffer.untyped_storage().data_ptr()
        steps["partly_staged"] += any(t.untyped_storage().data_ptr() != buffer for t in _arrays(got).values())
        return expected

    runner.buffers.prepare = prepare
    prompts = tiny_prompts(320, 6, seed=3)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    expected = [r.token_ids for r in Engine(config).generate(prompts, params)]
    tokens, _ = _drive(engine, prompts, params)
    assert list(tokens.values()) == expected
    assert steps["mixed"] > 2 and steps["on_device"] > 5
    assert (steps["partly_staged"] > 0) == (capacity_per_token is not None)


def test_a_host_buffer_is_reused_in_turn_and_a_flush_copies_only_what_is_new():
    upload = StagedUpload(16, "cpu", staged=True, num_buffers=2)
    seen = []
    for step in range(3):
        upload.begin_step()
        a = upload.stage(np.arange(4) + 10 * step)
        upload.flush()
        upload.flush()  # nothing new: nothing copied
        b = upload.stage(np.full((2, 3), step))
        assert b.shape == (2, 3) and torch.equal(b, torch.full((2, 3), max(step - 1, 0)))  # not yet flushed
        upload.flush()
        assert a.tolist() == [10 * step + i for i in range(4)] and torch.equal(b, torch.full((2, 3), step))
        seen.append(upload.current)
    assert seen == [1, 0, 1]
    upload.begin_step()
    exact = upload.stage(np.arange(16))  # fills the buffer exactly: still staged
    assert exact.untyped_storage().data_ptr() == upload.device_buffer.untyped_storage().data_ptr()
    too_big = upload.stage(np.arange(20))
    assert too_big.tolist() == list(range(20)) and too_big.untyped_storage().data_ptr() != upload.device_buffer.untyped_storage().data_ptr()
