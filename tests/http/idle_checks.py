"""After a case: the HTTP server at `base_url` answers a normal request, then holds nothing."""

from __future__ import annotations

import httpx

from tests.http.test_openai_server import metric_values
from tests.runtime.conftest import poll_until

PROMPT = "The quick brown fox jumps over the lazy dog. "


async def served_and_nothing_held(
    base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 30.0
) -> None:
    """A 3-token completion is answered, then /metrics shows no request and no KV block held."""
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=headers) as http:
        r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text

        async def scrape() -> dict[str, float]:
            return metric_values((await http.get("/metrics")).text)

        def idle(m: dict[str, float]) -> bool:
            return (
                m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0
            )

        await poll_until(scrape, idle, timeout_s)
