"""Stages as Ray actors on simulated nodes: the same greedy tokens as the in-process engine, NIXL hand-offs
over TCP, control connections without the run's token refused while the engine keeps serving."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.wire.codec import encode
from asyncpp.wire.stage_msgs import Shutdown
from tests.conftest import tiny_config, tiny_prompts
from tests.runtime.conftest import collect_all, wait_until
from tests.runtime.harness import launched, tiny_sections
from tests.runtime.ray_backend.conftest import placement_groups_alive, placed_event, ray_sections

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(320, 6)


@pytest.fixture(scope="module")
def in_process(tiny_hf_dir, prompts):
    return [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]


def _sneak_in(address: str, token: str | None) -> None:
    """Connect to a control socket as a stranger (no token, or a wrong one) and push a frame."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if token is not None:
        sock.plain_username, sock.plain_password = b"asyncpp", token.encode()
    sock.connect(address)
    sock.send(encode(Shutdown("stranger")), zmq.NOBLOCK) if sock.poll(500, zmq.POLLOUT) else None
    time.sleep(0.3)
    sock.close()


@pytest.mark.parametrize("pp_size", [2, 3])
async def test_ray_stages_equal_in_process(tmp_path, tiny_hf_dir, ray_cluster, prompts, in_process, pp_size):
    sections = tiny_sections(tiny_hf_dir, pp_size, (), **ray_sections(ray_cluster))
    with launched(tmp_path, sections) as engine:
        placed = placed_event(engine.log_file)
        assert placed["transports"] == ["nixl"] * (pp_size - 1)  # one simulated node per stage
        assert len(set(placed["node_ids"])) == pp_size
        if pp_size == 2:
            # Strangers on the engine's outputs and on stage 1's activations: refused before any frame.
            for address in (placed["outputs_addr"], placed["activation_addrs"][0]):
                _sneak_in(address, None)
                _sneak_in(address, "not-the-token")
            wait_until(lambda: engine.log_file.read_text().count("control_connection_refused") >= 4, 10, "refusals logged")
        results, stats = await collect_all(engine.address, prompts, GREEDY)
    assert engine.proc.returncode == 0, "".join(engine.output[-30:])
    assert [r[0] for r in results] == in_process
    assert all(h is not None for h in stats["handoff_us_p50"])
    if pp_size == 2:
        refusals = [json.loads(line) for line in engine.log_file.read_text().splitlines() if "control_connection_refused" in line]
        reasons = {r["reason"].split(" (")[0] for r in refusals}
        assert reasons == {"no token", "wrong token"}, refusals
    assert placement_groups_alive() == []
