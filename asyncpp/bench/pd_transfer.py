"""`python -m asyncpp.bench.pd_transfer`: what one decode stage pulls for one request, by NIXL and by a copy.

Two stages' paged caches in this process (default: SmolLM2-135M's stage at
pp=2: 15 layers, 3 KV heads of 64, blocks of 16, bfloat16), each of
`--cache-blocks` blocks. A repetition picks `--num-blocks` blocks on each
side (`--placement random`: each anywhere, the worst case; `runs`: one run
of consecutive ids from a random start on each side) and moves K and V of
every layer of those blocks, timed, in an order that alternates:

* `nixl`: one `NixlTransport.read` between two agents (UCX backend), from
  the post until `poll` says DONE: one descriptor per run of blocks;
* `index_copy`: per tensor, `index_select` of the source blocks and
  `index_copy_` into the destination blocks, what a local copy does;
* `memcpy`: one contiguous `dst.copy_(src)` of as many bytes, the ceiling.

Before each timed call `--evict-mb` of other memory is read (untimed), so
each starts from memory rather than the CPU's caches; one torch thread
(`--threads`); medians over `--repeat`. The first read is checked bit for
bit. `first touch` repeats the NIXL read (and the memcpy) into freshly
mapped destination memory, as the first requests after a start-up do: the
kernel then allocates and zeroes every page the copy writes.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
import uuid

import numpy as np
import torch

from asyncpp.transport.nixl_agent import NixlTransport, TransferState, block_runs


def fresh_caches(count: int, shape: tuple[int, ...]) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """`count` bfloat16 tensors of `shape` carved from one new anonymous mapping: pages not yet touched."""
    per = int(np.prod(shape)) * 2
    buf = mmap.mmap(-1, count * per)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return buf, [flat[i * per : (i + 1) * per].view(torch.bfloat16).view(shape) for i in range(count)]


class PullBench:
    """A prefill and a decode stage's caches, their transports, and the timed pulls between them."""

    def __init__(self, num_blocks: int, block_size: int, layers: int, heads: int, head_dim: int,
                 placement: str, cache_blocks: int, evict_mb: int, seed: int) -> None:  # fmt: skip
        self.num_blocks, self.block_size, self.cache_blocks, self.placement = num_blocks, block_size, cache_blocks, placement
        self.shape = (cache_blocks * block_size, heads, head_dim)
        self.num_tensors = 2 * layers  # K and V of every layer of the stage
        g = torch.Generator().manual_seed(seed)
        self.src = [torch.randn(self.shape, generator=g).to(torch.bfloat16) for _ in range(self.num_tensors)]
        self.dst = [torch.zeros(self.shape, dtype=torch.bfloat16) for _ in range(self.num_tensors)]
        self.block_nbytes = self.src[0][:block_size].nbytes
        self.nbytes = num_blocks * self.block_nbytes * self.num_tensors
        self.rng = np.random.default_rng(seed)
        self.evict = torch.ones(max(1, evict_mb) << 18)  # float32
        self.evict_mb = evict_mb
        self.flat_src = torch.randint(0, 255, (self.nbytes,), dtype=torch.uint8)
        self.flat_dst = torch.zeros_like(self.flat_src)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        self.prefill = NixlTransport(f"bench-prefill-{tag}")
        t1 = time.perf_counter()
        self.decode = NixlTransport(f"bench-decode-{tag}")
        self.agent_create_s = (t1 - t0, time.perf_counter() - t1)
        self.prefill.register(self.src)
        self.decode.register(self.dst)
        self.remote = self.decode.add_remote(self.prefill.agent_metadata())

    def pick(self) -> tuple[list[int], list[int]]:
        n = self.num_blocks
        if self.placement == "runs":
            starts = self.rng.integers(0, self.cache_blocks - n + 1, size=2)
            return [list(range(int(s), int(s) + n)) for s in starts]  # type: ignore[return-value]
        return [self.rng.choice(self.cache_blocks, n, replace=False).tolist() for _ in range(2)]  # type: ignore[return-value]

    def runs(self, dst: list[torch.Tensor], local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
        return [
            run for d, s in zip(dst, self.src)
            for run in block_runs(local_ids, remote_ids, d.data_ptr(), s.data_ptr(), self.block_nbytes)
        ]  # fmt: skip

    def _evict(self) -> None:
        if self.evict_mb:
            self.evict.sum()

    def pull(self, transport: NixlTransport, runs: list[tuple[int, int, int]]) -> tuple[float, float]:
        """(seconds until DONE, seconds inside `read`) of one read."""
        self._evict()
        t0 = time.perf_counter()
        handle = transport.read(self.remote, runs)
        t1 = time.perf_counter()
        while (state := transport.poll(handle)) is TransferState.RUNNING:
            pass
        elapsed = time.perf_counter() - t0
        transport.release(handle)
        if state is not TransferState.DONE:
            raise SystemExit("the NIXL read failed")
        return elapsed, t1 - t0

    def nixl(self) -> tuple[float, float, int]:
        runs = self.runs(self.dst, *self.pick())
        return (*self.pull(self.decode, runs), len(runs))

    def index_copy(self) -> float:
        local_ids, remote_ids = self.pick()
        lidx, ridx = torch.tensor(local_ids), torch.tensor(remote_ids)
        self._evict()
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self.src):
            d.view(self.cache_blocks, -1).index_copy_(0, lidx, s.view(self.cache_blocks, -1).index_select(0, ridx))
        return time.perf_counter() - t0

    def memcpy(self) -> float:
        self._evict()
        t0 = time.perf_counter()
        self.flat_dst.copy_(self.flat_src)
        return time.perf_counter() - t0

    def check(self) -> bool:
        """A read lands the picked blocks bit for bit."""
        local_ids, remote_ids = self.pick()
        self.pull(self.decode, self.runs(self.dst, local_ids, remote_ids))

        def picked(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
            return t.view(self.cache_blocks, -1)[ids].view(torch.uint8)

        return all(torch.equal(picked(d, local_ids), picked(s, remote_ids)) for d, s in zip(self.dst, self.src))

    def first_touch(self) -> tuple[float, float]:
        """(NIXL read, memcpy) seconds into destination memory no one has touched yet."""
        with NixlTransport(f"{self.decode.name}-fresh-{uuid.uuid4().hex[:4]}") as fresh:
            warm = torch.zeros(64, dtype=torch.uint8)  # a first read sets up the connection, untimed
            buf, caches = fresh_caches(self.num_tensors, self.shape)
            fresh.register([warm, *caches])
            fresh.add_remote(self.prefill.agent_metadata())
            self.pull(fresh, [(warm.data_ptr(), self.src[0].data_ptr(), warm.nbytes)])
            nixl_s = self.pull(fresh, self.runs(caches, *self.pick()))[0]
        del caches
        buf.close()
        mbuf = mmap.mmap(-1, self.nbytes)
        dst = torch.frombuffer(mbuf, dtype=torch.uint8)
        self._evict()
        t0 = time.perf_counter()
        dst.copy_(self.flat_src)
        memcpy_s = time.perf_counter() - t0
        del dst
        mbuf.close()
        return nixl_s, memcpy_s

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def measure(num_blocks: int = 64, block_size: int = 16, layers: int = 15, heads: int = 3, head_dim: int = 64,
            repeat: int = 21, placement: str = "random", cache_blocks: int | None = None, evict_mb: int = 64,
            threads: int = 1, first_touch_repeat: int = 3, seed: int = 0) -> dict:  # fmt: skip
    """Medians of the three ways to move one request's blocks; rates in GB/s (1e9 B/s)."""
    cache_blocks = cache_blocks or 8 * num_blocks
    if num_blocks > cache_blocks:
        raise ValueError(f"{num_blocks} blocks do not fit a cache of {cache_blocks}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    bench = PullBench(num_blocks, block_size, layers, heads, head_dim, placement, cache_blocks, evict_mb, seed)
    try:
        bit_exact = bench.check()
        ops = {"nixl": bench.nixl, "index_copy": bench.index_copy, "memcpy": bench.memcpy}
        samples: dict[str, list] = {name: [] for name in ops}
        for r in range(repeat + 1):  # the first round warms up
            for name in list(ops) if r % 2 == 0 else list(ops)[::-1]:
                out = ops[name]()
                if r > 0:
                    samples[name].append(out)
        touches = [bench.first_touch() for _ in range(first_touch_repeat)]
    finally:
        bench.close()
        torch.set_num_threads(previous_threads)
    nixl_s = statistics.median(s[0] for s in samples["nixl"])
    index_copy_s = statistics.median(samples["index_copy"])
    memcpy_s = statistics.median(samples["memcpy"])

    def rate(seconds: float) -> float:
        return bench.nbytes / seconds / 1e9

    return {
        "nbytes": bench.nbytes,
        "block_nbytes": bench.block_nbytes,
        "num_descs": statistics.median(s[2] for s in samples["nixl"]),
        "placement": placement,
        "agent_create_s": bench.agent_create_s,
        "bit_exact": bit_exact,
        "nixl_gbps": rate(nixl_s),
        "nixl_in_read_share": statistics.median(s[1] / s[0] for s in samples["nixl"]),
        "index_copy_gbps": rate(index_copy_s),
        "memcpy_gbps": rate(memcpy_s),
        "nixl_over_memcpy": memcpy_s / nixl_s,
        "nixl_over_index_copy": index_copy_s / nixl_s,
        "first_touch_nixl_gbps": rate(statistics.median(t[0] for t in touches)) if touches else None,
        "first_touch_memcpy_gbps": rate(statistics.median(t[1] for t in touches)) if touches else None,
        "repeat": repeat,
        "threads": threads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64, help="blocks the request pulls")
    parser.add_argument("--cache-blocks", type=int, default=None, help="blocks in each stage's cache (default: 8x --num-blocks)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--placement", default="random", choices=["random", "runs"])
    parser.add_argument("--evict-mb", type=int, default=64, help="memory read before each timed call (untimed); 0: none")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--first-touch-repeat", type=int, default=3)
    args = parser.parse_args(argv)
    m = measure(args.num_blocks, args.block_size, args.layers, args.heads, args.head_dim, args.repeat, args.placement,
                args.cache_blocks, args.evict_mb, args.threads, args.first_touch_repeat)  # fmt: skip
    print(
        f"bfloat16: {args.layers} layers x K,V x {args.heads} heads x {args.head_dim}, blocks of {args.block_size} "
        f"({m['block_nbytes'] / 1024:.1f} KiB per tensor); {args.num_blocks} blocks ({args.placement}) = "
        f"{m['nbytes'] / 1e6:.2f} MB in {m['num_descs']:.0f} descriptors; {args.threads} thread(s), median of "
        f"{args.repeat}, {args.evict_mb} MB evicted before each call"
    )
    print(f"  agents created in {m['agent_create_s'][0]:.3f} s (first in the process), {m['agent_create_s'][1]:.3f} s (next)")
    print(f"  the first read is bit-exact: {m['bit_exact']}")
    print(f"  {'nixl':>12}: {m['nixl_gbps']:6.2f} GB/s  ({m['nixl_in_read_share']:.0%} of it inside read())")
    print(f"  {'index_copy':>12}: {m['index_copy_gbps']:6.2f} GB/s")
    print(f"  {'memcpy':>12}: {m['memcpy_gbps']:6.2f} GB/s")
    print(f"  nixl / memcpy: {m['nixl_over_memcpy']:.2f}x   nixl / index_copy: {m['nixl_over_index_copy']:.2f}x")
    if m["first_touch_nixl_gbps"] is not None:
        print(
            f"  first touch (fresh destination pages, median of {args.first_touch_repeat}): nixl "
            f"{m['first_touch_nixl_gbps']:.2f} GB/s, memcpy {m['first_touch_memcpy_gbps']:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
