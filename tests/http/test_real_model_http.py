"""The real SmolLM2-135M-Instruct through the HTTP server: greedy chat equals the native client's."""

from __future__ import annotations

import asyncio

import pytest

from asyncpp.client import AsyncClient
from tests.runtime.conftest import collect
from tests.runtime.test_real_model_pp import CHATS, GREEDY

openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
]


async def test_real_model_chat_over_http_equals_native(real_pp2_engine):
    engine, base_url = real_pp2_engine
    client = AsyncClient(engine.address)
    try:
        native = await asyncio.wait_for(asyncio.gather(*(collect(client, c, GREEDY) for c in CHATS)), 180)
    finally:
        client.close()
    oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = (await oai.models.list()).data[0].id
    assert model == "SmolLM2-135M-Instruct"
    answers = await asyncio.gather(
        *(oai.chat.completions.create(model=model, messages=c, max_tokens=GREEDY.max_tokens, temperature=0) for c in CHATS)
    )
    for chat, (tokens, text, reason), answer in zip(CHATS, native, answers):
        assert answer.choices[0].message.content == text, chat
        assert answer.choices[0].finish_reason == reason
        assert answer.usage.completion_tokens == len(tokens)
