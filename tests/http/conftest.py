"""HTTP fixtures: the front door's small launched engine, shared by `test_front_door` and `test_front_door_sizes`.

A launch costs ~5-10 s on the shared 2-core machine; both modules leave the
engine as they found it (every case ends with nothing held, frozen stages
are thawed), so one engine serves the session.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def front_door_server(tmp_path_factory, tiny_hf_dir):
    """The tiny model at pp=1 behind the HTTP server, its limits small (see `test_front_door`'s docstring);
    the engine gets `base_url`."""
    from tests.http.test_front_door import MAX_FRAME_BYTES, MAX_NUM_SEQS, MAX_QUEUED, MODEL
    from tests.http.test_openai_server import free_port
    from tests.runtime.harness import launched, tiny_sections

    port = free_port()
    sections = tiny_sections(
        tiny_hf_dir, 1,
        model={"source": "hf", "path": str(tiny_hf_dir), "dtype": "float32", "max_model_len": 512},
        scheduler={"max_num_seqs": MAX_NUM_SEQS},
        server={"http_port": port, "served_model_name": MODEL, "max_queued_requests": MAX_QUEUED,
                "max_frame_bytes": MAX_FRAME_BYTES},
    )  # fmt: skip
    with launched(tmp_path_factory.mktemp("front-door"), sections) as engine:
        engine.base_url = f"http://127.0.0.1:{port}"
        yield engine
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])
