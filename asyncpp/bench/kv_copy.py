"""`python -m asyncpp.bench.kv_copy`: the offload connector's block moves against a plain copy.

One stage's paged cache (default: SmolLM2-135M's stage at pp=2: 15 layers,
3 KV heads of 64, blocks of 16, bfloat16) and its store. A repetition picks
`--blocks` blocks and as many slots (`--placement random`, the worst case:
each anywhere; `runs`: consecutive block ids and consecutive slots, each run
at a random start, as a request's blocks and a store's free slots usually
lie), then times, in an order that alternates between repetitions:

* `memcpy`: `dst.copy_(src)` of the same number of bytes, contiguous (with
  `--device cuda`: a device -> pinned host copy of them);
* per store (`--stores`: shm, dir): `BlockMover.save` of those blocks into
  those slots and `BlockMover.load` of them back into other blocks, placed
  alike (on CPU the report says whether the `kv_records` kernel copied);
* `old` (CPU only): what the worker did before the mover, `gather_blocks`
  then `store.write` per block, and `store.read_into` per block then
  `scatter_blocks`.

Before each timed call `--evict-mb` of other memory is read (untimed), so
every call, the memcpy's too, starts from memory rather than the CPU's
caches. Everything runs on one torch thread (`--threads`); figures are
medians over `--repeats`. The first load of each store is checked bit for
bit against the blocks saved.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from asyncpp.kernels.isa import native_level
from asyncpp.kernels.kv_records import kv_record_kernel
from asyncpp.kv_transfer.offload.blocks import gather_blocks, scatter_blocks
from asyncpp.kv_transfer.offload.mover import BlockMover
from asyncpp.kv_transfer.offload.store import BlockStore, DirBlockStore, ShmBlockStore, StoreLayout, store_fingerprint


class Bench:
    """A cache, its stores and movers, and the timed operations on them."""

    def __init__(self, args: argparse.Namespace, store_dir: Path) -> None:
        self.args = args
        self.device = torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        g = torch.Generator().manual_seed(0)
        rows = args.num_blocks * args.block_size
        self.caches = [
            tuple(torch.randn(rows, args.kv_heads, args.head_dim, generator=g).to(dtype).to(self.device) for _ in range(2))
            for _ in range(args.layers)
        ]
        self.layout = StoreLayout(
            args.num_slots, args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype,
            store_fingerprint("bench", 0, args.layers, args.dtype, args.block_size, args.kv_heads, args.head_dim),
        )
        self.stores: dict[str, BlockStore] = {}
        for name in args.stores:
            if name == "shm":
                store = ShmBlockStore(f"asyncpp-bench-kv-{os.getpid()}-{uuid.uuid4().hex[:6]}", self.layout, create=True)
                # Fault its pages in now: a serving store's are after its first round of saves, and a
                # first touch (the kernel allocating and zeroing a page) would dominate the copy.
                store.payload_records()[:] = 0
                self.stores[name] = store
            else:
                self.stores[name] = DirBlockStore(store_dir, self.layout)
        chunk = args.max_chunk_mb << 20
        self.movers = {name: BlockMover(self.caches, args.block_size, store, chunk) for name, store in self.stores.items()}
        self.nbytes = args.blocks * self.layout.payload_nbytes
        self.rng = np.random.default_rng(1)
        self.evict = torch.ones(max(1, args.evict_mb) << 18)  # float32
        if self.device.type == "cuda":
            self.src = torch.randint(0, 255, (self.nbytes,), dtype=torch.uint8, device=self.device)
            self.dst = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.src = torch.randint(0, 255, (self.nbytes,), dtype=torch.uint8)
            self.dst = torch.empty_like(self.src)

    def pick(self) -> tuple[list[int], list[bytes], list[int]]:
        n = self.args.blocks
        return self._place(self.args.num_blocks), [self.rng.bytes(32) for _ in range(n)], self._place(self.args.num_slots)

    def _place(self, num: int) -> list[int]:
        """`--blocks` distinct ids below `num`, as `--placement` lays them out."""
        n = self.args.blocks
        if self.args.placement == "runs":
            start = int(self.rng.integers(0, num - n + 1))
            return list(range(start, start + n))
        return self.rng.choice(num, n, replace=False).tolist()

    def timed(self, fn) -> float:
        if self.args.evict_mb:
            self.evict.sum()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def memcpy(self) -> float:
        return self.timed(lambda: self.dst.copy_(self.src, non_blocking=True))

    def save(self, name: str) -> float:
        block_ids, hashes, slots = self.pick()
        return self.timed(lambda: self.movers[name].save(block_ids, hashes, slots, contextlib.nullcontext))

    def load(self, name: str) -> float:
        block_ids, hashes, slots = self.pick()
        self.movers[name].save(block_ids, hashes, slots, contextlib.nullcontext)
        targets = self.pick()[0]
        misses: dict[int, str] = {}
        elapsed = self.timed(lambda: misses.update(self.movers[name].load(targets, hashes, slots, contextlib.nullcontext)))
        if misses:
            raise SystemExit(f"{name}: load missed {misses}")
        return elapsed

    def old_save(self, name: str) -> float:
        block_ids, hashes, slots = self.pick()
        store = self.stores[name]

        def run() -> None:
            payload = gather_blocks(self.caches, block_ids, self.args.block_size)
            for i, (block_hash, slot) in enumerate(zip(hashes, slots)):
                store.write(slot, block_hash, payload[i])

        return self.timed(run)

    def old_load(self, name: str) -> float:
        block_ids, hashes, slots = self.pick()
        self.movers[name].save(block_ids, hashes, slots, contextlib.nullcontext)
        targets = self.pick()[0]
        store = self.stores[name]

        def run() -> None:
            payload = torch.empty((len(targets), *self.layout.payload_shape), dtype=self.caches[0][0].dtype)
            for i, (block_hash, slot) in enumerate(zip(hashes, slots)):
                if store.read_into(slot, block_hash, payload[i]) is not None:
                    raise SystemExit(f"{name}: old load missed slot {slot}")
            scatter_blocks(self.caches, targets, self.args.block_size, payload)

        return self.timed(run)

    def check(self, name: str) -> bool:
        """A save then a load into other blocks gives back the same bits."""
        block_ids, hashes, slots = self.pick()
        targets = self.pick()[0]
        mover = self.movers[name]
        bs = self.args.block_size
        saved = [cache[b * bs : (b + 1) * bs].clone() for k, v in self.caches for cache in (k, v) for b in block_ids]
        mover.save(block_ids, hashes, slots, contextlib.nullcontext)
        if mover.load(targets, hashes, slots, contextlib.nullcontext):
            return False
        loaded = [cache[t * bs : (t + 1) * bs] for k, v in self.caches for cache in (k, v) for t in targets]
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(saved, loaded))

    def close(self) -> None:
        self.movers.clear()
        for store in self.stores.values():
            store.close()
            if isinstance(store, ShmBlockStore):
                store.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=2048, help="blocks in the cache")
    parser.add_argument("--num-slots", type=int, default=1024, help="slots in the store")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per save or load")
    parser.add_argument(
        "--placement", default="random", choices=["random", "runs"],
        help="random: blocks and slots anywhere (the worst case); runs: consecutive ids from a random start",
    )  # fmt: skip
    parser.add_argument("--stores", nargs="+", default=["shm", "dir"], choices=["shm", "dir"])
    parser.add_argument("--dir", type=Path, default=None, help="the dir store's folder (default: a temporary one, on /dev/shm if there)")
    parser.add_argument("--max-chunk-mb", type=int, default=16, help="the mover's chunk (one cache-guard entry)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--evict-mb", type=int, default=64, help="memory read before each timed call (untimed); 0: none")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-old", action="store_true", help="skip the pre-mover path")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.blocks > min(args.num_blocks, args.num_slots):
        raise SystemExit(f"--blocks {args.blocks}: more than the cache's {args.num_blocks} blocks or the store's {args.num_slots} slots")
    torch.set_num_threads(args.threads)

    with contextlib.ExitStack() as stack:
        store_dir = args.dir
        if store_dir is None:  # in memory, as the shm store: the figures then compare the two formats, not disks
            where = "/dev/shm" if Path("/dev/shm").is_dir() else None
            store_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncpp-bench-kv-", dir=where)))
        bench = Bench(args, store_dir)
        stack.callback(bench.close)
        report(bench, args)
    return 0


def report(bench: Bench, args: argparse.Namespace) -> None:
    ops = {"memcpy": bench.memcpy}
    for name in bench.stores:
        ops[f"{name} save"] = lambda name=name: bench.save(name)
        ops[f"{name} load"] = lambda name=name: bench.load(name)
        if args.device == "cpu" and not args.no_old:
            ops[f"{name} old save"] = lambda name=name: bench.old_save(name)
            ops[f"{name} old load"] = lambda name=name: bench.old_load(name)
    for name in bench.stores:
        print(f"{name}: a save then a load into other blocks is bit-exact: {bench.check(name)}")
    names = list(ops)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats + 1):  # the first round warms up
        for name in names if r % 2 == 0 else names[::-1]:
            elapsed = ops[name]()
            if r > 0:
                samples[name].append(elapsed)
    baseline = "device -> pinned host copy" if args.device == "cuda" else "dst.copy_(src)"
    print(
        f"{args.device} {args.dtype}: {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, blocks of "
        f"{args.block_size} ({bench.layout.payload_nbytes / 1024:.1f} KiB each); {args.blocks} blocks of "
        f"{args.num_blocks} -> slots of {args.num_slots} ({args.placement}) = {bench.nbytes / 1e6:.2f} MB a call; {args.threads} thread(s), "
        f"median of {args.repeats}, {args.evict_mb} MB evicted before each call; memcpy = {baseline}"
    )
    if args.device == "cpu":
        kernel = kv_record_kernel()
        how = "numpy (no kv_records kernel)" if kernel is None else f"the kv_records kernel at {native_level()}"
        print(f"  host copies: {how}{'' if kernel is None or kernel.hw_crc else ', software CRC32C'}")
    memcpy_s = statistics.median(samples["memcpy"])
    for name in names:
        med = statistics.median(samples[name])
        rate = bench.nbytes / med / 1e9
        print(f"  {name:>14}: {med * 1e3:8.3f} ms  {rate:6.2f} GB/s  {memcpy_s / med:5.2f}x memcpy")


if __name__ == "__main__":
    raise SystemExit(main())
