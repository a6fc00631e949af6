"""HTTP fixtures: launched engines with the HTTP server, each shared by the modules that leave it as they found it.

A launch costs ~5-10 s on the shared 2-core machine. The front door's small
engine serves `test_front_door` and `test_front_door_sizes` (every case ends
with nothing held, frozen stages are thawed); the OpenAI server's serves
`test_openai_server` and the bench's `--base-url` run.
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


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory, tiny_hf_dir):
    """The tiny model at pp=2 (2 + 2 layers) behind the HTTP server, served as `test_openai_server.MODEL`;
    the engine gets `base_url` and `model_dir`."""
    from tests.http.test_openai_server import MODEL, free_port
    from tests.runtime.harness import launched, tiny_sections

    port = free_port()
    sections = tiny_sections(tiny_hf_dir, 2, (2, 2), server={"http_port": port, "served_model_name": MODEL})
    with launched(tmp_path_factory.mktemp("http"), sections) as engine:
        engine.base_url = f"http://127.0.0.1:{port}"
        engine.model_dir = tiny_hf_dir
        yield engine
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])
