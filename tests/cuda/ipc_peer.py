"""The sending side of the CUDA IPC ring test, run in a spawned process (an IPC handle cannot be
opened by the process that created it). Messages are plain values through multiprocessing queues."""

from __future__ import annotations

import torch

from asyncpp.model.intermediate import IntermediateTensors
from asyncpp.transport import get_transport
from asyncpp.transport.base import ActivationError


def sender_main(spec, commands, replies) -> None:
    sender = get_transport("cuda_ipc").attach_sender(spec)
    try:
        while (cmd := commands.get()) is not None:
            step_id, num_tokens, seed, keys = cmd
            g = torch.Generator(device="cuda").manual_seed(seed)
            tensors = IntermediateTensors(
                {k: torch.randn(num_tokens, spec.hidden_size, generator=g, device="cuda").to(sender.ring.dtype) for k in keys}
            )
            try:
                notice = sender.write(step_id, tensors)
            except ActivationError as e:
                replies.put(("refused", str(e)))
                continue
            replies.put(("notice", notice))
    finally:
        sender.close()
