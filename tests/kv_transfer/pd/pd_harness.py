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


def finish(producer: Engine, consumer: Engine, ids: list[str], max_steps: int = 5000) -> dict[str, Completion]:
    """As `drain`, but the consumer may keep blocks quarantined (a read that cannot be stopped): step
    until its requests finished and the producer has nothing pending."""
    done = {rid: Completion(rid) for rid in ids}
    for _ in range(max_steps):
        if all(c.finish_reason is not None for c in done.values()) and not (
            producer.has_unfinished_requests() or producer.has_pending_transfers() or consumer.has_unfinished_requests()
        ):
            return done
        for engine in (consumer, producer):
            for out in engine.step():
                if out.request_id in done:
                    done[out.request_id].add(out)
    raise AssertionError("the engines did not finish")


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


def pd_pair_early(model_dir, prefill_pp: int, prefill_split, decode_pp: int, decode_split, **sections) -> tuple[Engine, Engine]:
    """As `pd_pair`, with the handshakes both ways: the producer's stages tell the consumer's."""
    producer, consumer = pd_pair(model_dir, prefill_pp, prefill_split, decode_pp, decode_split, **sections)
    producer.kv_connector.add_remote_engine(consumer.kv_connector.engine_handshake())
    return producer, consumer


def start_early(producer: Engine, consumer: Engine, prompt, params: SamplingParams, request_id: str) -> tuple[str, str]:
    """What the router does first: the producer computes the prompt, the consumer is given the request
    at once (it awaits the producer's request). Returns (producer id, consumer id)."""
    kv = {"do_remote_decode": True, "decode_engine_id": "decode"}
    pid = producer.add_request(prompt, dataclasses.replace(params, max_tokens=1), f"p-{request_id}", kv)
    awaited = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": pid}
    return pid, consumer.add_request(prompt, params, f"c-{request_id}", awaited)


def serve_pd_early(producer: Engine, consumer: Engine, prompts, params: SamplingParams, max_steps: int = 5000) -> list[Completion]:
    """Early handover, as the router drives it: both engines get each request at once; the
    producer's last delta (its token, signed params) goes to the consumer as it comes."""
    pairs = dict(start_early(producer, consumer, p, params, str(i)) for i, p in enumerate(prompts))
    firsts = {pid: Completion(pid) for pid in pairs}
    rests = {cid: Completion(cid) for cid in pairs.values()}
    for _ in range(max_steps):
        busy = False
        for engine in (producer, consumer):
            if engine.has_unfinished_requests() or engine.has_pending_transfers():
                busy = True
                for out in engine.step():
                    if out.request_id in firsts:
                        firsts[out.request_id].add(out)
                        if out.finished:
                            consumer.add_remote_prefill(pairs[out.request_id], out.kv_transfer_params)
                    elif out.request_id in rests:
                        rests[out.request_id].add(out)
        if not busy:
            return [joined(firsts[pid], rests[cid]) for pid, cid in pairs.items()]
    raise AssertionError("the engines did not drain")
