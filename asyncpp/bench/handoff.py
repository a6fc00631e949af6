"""`python -m asyncpp.bench.handoff`: the activation hand-off against a plain copy of the same bytes.

A receiver process creates the stage ring (`cuda_ipc` on CUDA, `shm` on
CPU) exactly as a stage does; this process attaches as the sender and, for
each step size, times `Sender.write` (copy into the ring slot, and on CUDA
the slot's wait and `written` event) against `dst.copy_(src)` of the same
bytes on the same device. Each figure is the median of `--iters` timed
steps after a warm-up; on CUDA a step is timed to the end of its device
work (synchronised), so the ratio compares like with like.

    python -m asyncpp.bench.handoff --device cuda --tokens 1,16,64,256,512
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from asyncpp.device import indexed_device, is_cuda
from asyncpp.dtypes import torch_dtype
from asyncpp.model.intermediate import INTERMEDIATE_KEYS, IntermediateTensors
from asyncpp.transport import RingSpec, get_transport, transport_for


def _receiver_main(spec: RingSpec, specs_out, stop) -> None:
    if is_cuda(spec.device):
        torch.cuda.set_device(indexed_device(spec.device))
    receiver = get_transport(spec.transport).create_receiver(spec)
    specs_out.put(receiver.spec)
    stop.get()
    receiver.close()


def _median_us(fn, device: torch.device, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: str, tokens: list[int], hidden_size: int, dtype: str, iters: int) -> list[dict]:
    dev = torch.device(device)
    spec = RingSpec(
        transport_for(device), f"asyncpp-handoff-{time.time_ns()}", list(INTERMEDIATE_KEYS), 2, max(tokens),
        hidden_size, dtype, device, device,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    specs, stop = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(spec, specs, stop), daemon=True)
    proc.start()
    try:
        sender = get_transport(spec.transport).attach_sender(specs.get(timeout=120))
        rows = []
        for n in tokens:
            src = IntermediateTensors({k: torch.randn(n, hidden_size, device=dev).to(torch_dtype(dtype)) for k in spec.keys})
            dst = IntermediateTensors.empty_like(src)
            step = iter(range(10**9))
            handoff_us = _median_us(lambda: sender.write(next(step), src), dev, iters)

            def copy() -> None:
                for k in spec.keys:
                    dst[k].copy_(src[k], non_blocking=True)

            copy_us = _median_us(copy, dev, iters)
            nbytes = sum(t.numel() * t.element_size() for t in src.tensors.values())
            rows.append({"num_tokens": n, "bytes": nbytes, "handoff_us": handoff_us, "copy_us": copy_us})
        sender.close()
        return rows
    finally:
        stop.put(None)
        proc.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp.bench.handoff", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="1,16,64,256,512", help="step sizes (rows of each key)")
    ap.add_argument("--hidden-size", type=int, default=576, help="SmolLM2-135M: 576")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--result-json")
    ns = ap.parse_args(argv)
    rows = measure(ns.device, [int(t) for t in ns.tokens.split(",")], ns.hidden_size, ns.dtype, ns.iters)
    print(f"{'tokens':>7} {'bytes':>9} {'hand-off us':>12} {'copy us':>9} {'ratio':>6}  target: <= 2 x copy + 20 us")
    for r in rows:
        ok = r["handoff_us"] <= 2 * r["copy_us"] + 20
        ratio = r["handoff_us"] / r["copy_us"]
        print(f"{r['num_tokens']:>7} {r['bytes']:>9} {r['handoff_us']:>12.1f} {r['copy_us']:>9.1f} {ratio:>6.2f}  {'ok' if ok else 'MISSED'}")
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump({"device": ns.device, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
