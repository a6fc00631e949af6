"""Two in-process engines wired as producer (prefill) and consumer (decode), and a driver that
serves prompts through them the way the router does: prefill with max_tokens 1 (its token is the
client's first), then decode with the producer's kv_transfer_params (its tokens come after)."""

from __future__ import annotations

import dataclasses

from asyncpp.engine.engine import Engine
from asyncpp.engine.outputs import Completion
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config

PREFILL = SamplingParams(max_tokens=1, temperature=0.0)


def pd_engine(model_dir, role: str, engine_id: str, pp_size: int, split=(), **sections) -> Engine:
    kv = {"connector": "pd", "kv_role": role, "engine_id": engine_id, **sections.pop("kv_transfer", {})}
    return Engine(
        tiny_config(model_dir, parallel={"pp_size": pp_size, "layer_split": tuple(split)}, kv_transfer=kv, **sections)
    )


def pd_pair(model_dir, prefill_pp: int, prefill_split, decode_pp: int, decode_split, **sections) -> tuple[Engine, Engine]:
    producer = pd_engine(model_dir, "producer", "prefill", prefill_pp, prefill_split, **sections)
    consumer = pd_engine(model_dir, "consumer", "decode", decode_pp, decode_split, **sections)
    consumer.kv_connector.add_remote_engine(producer.kv_connector.engine_handshake())
    return producer, consumer


def prefill(producer: Engine, prompts, max_steps: int = 1000, params: SamplingParams = PREFILL) -> list[Completion]:
    """Run the prompts on the producer until each has its one token (its blocks stay held)."""
    params = dataclasses.replace(params, max_tokens=1)
    ids = [producer.add_request(p, params, kv_transfer_params={"do_remote_decode": True}) for p in prompts]
    done = {rid: Completion(rid) for rid in ids}
    for _ in range(max_steps):
        if all(c.finish_reason is not None for c in done.values()):
            return [done[rid] for rid in ids]
        for out in producer.step():
            if out.request_id in done:
                done[out.request_id].add(out)
    raise AssertionError("the producer did not finish its prompts")


def drain(producer: Engine, consumer: Engine, ids: list[str], max_steps: int = 5000) -> dict[str, Completion]:
    """Step both engines until the consumer's requests finished and no transfer is pending anywhere."""
    done = {rid: Completion(rid) for rid in ids}
    for _ in range(max_steps):
        busy = False
        for engine in (consumer, producer):
            if engine.has_unfinished_requests() or engine.has_pending_transfers():
                busy = True
                for out in engine.step():
                    if out.request_id in done:
                        done[out.request_id].add(out)
        if not busy:
            return done
    raise AssertionError("the engines did not drain")


def serve_pd(producer: Engine, consumer: Engine, prompts, params: SamplingParams) -> list[Completion]:
    """What a client gets: the producer's token and text, then the consumer's."""
    prefilled = prefill(producer, prompts, params=params)
    ids = [consumer.add_request(p, params, kv_transfer_params=c.kv_transfer_params) for p, c in zip(prompts, prefilled)]
    done = drain(producer, consumer, ids)
    return [joined(first, done[rid]) for first, rid in zip(prefilled, ids)]


def joined(first: Completion, rest: Completion) -> Completion:
    return dataclasses.replace(
        rest,
        text=first.text + rest.text,
        token_ids=first.token_ids + rest.token_ids,
        logprobs=None if first.logprobs is None else first.logprobs + (rest.logprobs or []),
    )


def assert_idle(*engines: Engine) -> None:
    for engine in engines:
        scheduler = engine.scheduler
        assert scheduler.num_held_for_transfer == 0
        assert scheduler.num_waiting_for_remote_kvs == 0
        assert scheduler.num_partly_reported_transfers == 0
        assert not engine.has_pending_transfers()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
