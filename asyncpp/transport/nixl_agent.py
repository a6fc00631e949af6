"""`NixlTransport`: one NIXL agent (UCX backend) per stage, for KV pulls and activation hand-offs.

It registers a stage's tensors (KV caches, an activation ring) once, hands
out its agent metadata, adds remote agents from theirs, and moves bytes with
one-sided READs (remote -> local: prefill/decode disaggregation,
`kv_transfer.pd`) or WRITEs (local -> remote: pipeline hand-offs between
hosts, `transport.nixl`): one NIXL transfer per call, one descriptor per
`(local_addr, remote_addr, nbytes)` run (`block_runs` merges consecutive
blocks). A read's `notif` reaches the remote agent once, after every byte
of the read has landed; a read that fails or is released early never sends
it (the caller then sends its own with `send_notif`).

What NIXL 1.5.1 does here, found by experiment on a CPU-only host:

* The agent is built from NIXL's bindings, not its `nixl_agent` wrapper:
  the wrapper hard-codes a progress-thread poll delay of 0, and each such
  thread spins a whole CPU core. Without a progress thread a first read
  never completes unless the remote agent is progressed too (the UCX
  connection set-up needs it), so we keep the thread and give it a delay.
* Host memory moves by UCX's `cma` transport (`process_vm_readv`), inside
  the call that posts the read: `read` returns with the copy done, having
  released the GIL meanwhile (only a first read to a new remote may come
  back RUNNING, while the connection is set up). Over UCX's tcp transport
  (`UCX_TLS=tcp`) reads run asynchronously and `poll` drives them; device
  memory should too (not measured: no GPU here). Reading into pages never
  touched before is ~3x slower than into touched ones: pre-fault caches.
* Releasing a running transfer does NOT stop it: UCX's cancel leaves
  one-sided reads in flight, and bytes keep landing after the release
  returned (measured over tcp). So `release` waits (up to
  `release_timeout_s`) for a running read to end before freeing it, and
  raises `TimeoutError` if it does not, keeping the handle: the caller
  must then not reuse the local blocks; `release_ended` frees it once it
  ended.
* A peer that is stopped (SIGSTOP) still has host memory read by cma, but
  the read stays RUNNING until it resumes (its notification is not
  acknowledged), and so does one over tcp, which copies nothing meanwhile.
* A remote whose agent is gone fails the next read (NIXL reports the
  disconnect when the transfer is posted or polled; within milliseconds
  when it goes mid-read); a remote that only deregistered its memory does
  not: one-sided reads are not checked by the remote, so a producer must
  keep blocks until their reader notified.
* No UCX environment is needed (loopback tcp carries the connection set-up
  and notifications, cma the data), in one process or across processes.
  Across processes cma needs ptrace rights over the peer (Yama
  `ptrace_scope`, container capabilities); `UCX_TLS=tcp` avoids them.

Not thread-safe: one transport per stage, used from that stage's loop.
"""

from __future__ import annotations

import bisect
import enum
import importlib.util
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
import torch

from asyncpp.logging import get_logger

# How long NIXL's progress thread sleeps in poll() between UCX events it might have missed; events
# themselves wake it at once. 5 ms keeps an idle agent near 0.3 % of a core (measured: 6 agents, 1.5 %).
_PROGRESS_DELAY_US = 5000
_POLL_SLEEP_S = 50e-6  # between polls while `release` waits for a running read


def nixl_available() -> bool:
    """Whether nixl-cu12 is installed (the `pd` and `ray` extras), without importing it."""
    return importlib.util.find_spec("nixl_cu12") is not None


def _nixl() -> Any:
    try:
        from nixl_cu12 import _bindings
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the NIXL transport needs nixl-cu12 (pip install 'asyncpp[pd]')") from e
    return _bindings


@dataclass(frozen=True)
class MemoryRegion:
    """One registered contiguous buffer."""

    addr: int
    nbytes: int
    device_id: int = 0
    is_cuda: bool = False


class TransferState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """One posted read; opaque to callers apart from its sizes, for logs and stats."""

    __slots__ = ("_released", "_req", "_state", "nbytes", "num_descs", "remote")

    def __init__(self, remote: str, nbytes: int, num_descs: int, req: int | None, state: TransferState) -> None:
        self.remote = remote
        self.nbytes = nbytes
        self.num_descs = num_descs
        self._req = req  # NIXL's request handle; None when nothing was created (empty or failed read)
        self._state = state
        self._released = False

    def __repr__(self) -> str:
        return f"TransferHandle({self.remote!r}, {self.nbytes} B, {self.num_descs} descs, {self._state.name})"


def block_runs(
    local_block_ids: list[int], remote_block_ids: list[int], local_base: int, remote_base: int, block_nbytes: int
) -> list[tuple[int, int, int]]:
    """`(local_addr, remote_addr, nbytes)` runs copying remote block `remote_block_ids[i]` into local
    block `local_block_ids[i]` of one tensor: block pairs consecutive on both sides share one run.

    Pairs are taken in local-id order (the copies are independent), so a request's blocks listed in
    any order still merge. A local block named twice is refused: two copies would race on it.
    """
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(f"{len(local_block_ids)} local blocks for {len(remote_block_ids)} remote ones")
    if len(set(local_block_ids)) != len(local_block_ids):
        raise ValueError("a local block is the target of two copies")
    runs: list[tuple[int, int, int]] = []
    prev_local = prev_remote = -2
    for local_id, remote_id in sorted(zip(local_block_ids, remote_block_ids)):
        if local_id < 0 or remote_id < 0:
            raise ValueError(f"negative block id in ({local_id}, {remote_id})")
        if runs and local_id == prev_local + 1 and remote_id == prev_remote + 1:
            addr, raddr, nbytes = runs[-1]
            runs[-1] = (addr, raddr, nbytes + block_nbytes)
        else:
            runs.append((local_base + local_id * block_nbytes, remote_base + remote_id * block_nbytes, block_nbytes))
        prev_local, prev_remote = local_id, remote_id
    return runs


class NixlTransport:
    """One NIXL agent (UCX backend) per pipeline stage."""

    _live_names: ClassVar[set[str]] = set()  # of this process's open transports
    _names_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str, release_timeout_s: float = 5.0, progress_delay_us: int = _PROGRESS_DELAY_US) -> None:
        nb = _nixl()
        with NixlTransport._names_lock:
            # NIXL itself accepts two agents of one name, but remotes key everything by name.
            if name in NixlTransport._live_names:
                raise ValueError(f"a NIXL agent named {name!r} is already open in this process")
            NixlTransport._live_names.add(name)
        self._nb = nb
        self._name = name
        self._log = get_logger(role="nixl", agent=name)
        self._release_timeout_s = release_timeout_s
        try:
            config = nb.nixlAgentConfig()
            config.useProgThread = True
            config.useListenThread = False  # metadata travels through our handshake, not NIXL's listener
            config.pthrDelay = progress_delay_us
            config.syncMode = nb.NIXL_THREAD_SYNC_NONE
            t0 = time.perf_counter()
            self._agent = nb.nixlAgent(name, config)
            self._backend = self._agent.createBackend("UCX", {})
        except BaseException:
            self._forget_name()
            raise
        self._regions: list[MemoryRegion] = []  # sorted by addr
        self._reg_lists: list[Any] = []  # what deregistration takes back
        self._tensors: list[torch.Tensor] = []  # keep registered memory alive until close
        self._remotes: dict[str, bytes] = {}  # name -> the metadata it was added with
        self._handles: set[TransferHandle] = set()
        self._abandoned: set[TransferHandle] = set()  # running when `release` gave up on them
        self._closed = False
        self._log.debug("nixl_agent_created", create_s=round(time.perf_counter() - t0, 4))

    @property
    def name(self) -> str:
        return self._name

    # ---- memory and peers -------------------------------------------------------------------
    def register(self, tensors: list[torch.Tensor]) -> list[MemoryRegion]:
        """Register contiguous CPU or CUDA tensors until `close`; call before `agent_metadata`."""
        self._check_open()
        made = []
        for t in tensors:
            if not t.is_contiguous() or t.nbytes == 0:
                raise ValueError(f"only non-empty contiguous tensors can be registered, got {tuple(t.shape)}")
            region = MemoryRegion(t.data_ptr(), t.nbytes, t.device.index or 0, t.device.type == "cuda")
            if any(r.addr < region.addr + region.nbytes and region.addr < r.addr + r.nbytes for r in [*self._regions, *made]):
                raise ValueError(f"memory at {region.addr:#x} (+{region.nbytes}) is already registered")
            made.append(region)
        for is_cuda in (False, True):
            group = [r for r in made if r.is_cuda == is_cuda]
            if not group:
                continue
            rows = np.array([(r.addr, r.nbytes, r.device_id) for r in group], dtype=np.uint64)
            reg_list = self._nb.nixlRegDList(self._seg(is_cuda), rows)
            self._agent.registerMem(reg_list, [self._backend])
            self._reg_lists.append(reg_list)
        self._tensors.extend(tensors)
        self._regions = sorted([*self._regions, *made], key=lambda r: r.addr)
        return made

    def agent_metadata(self) -> bytes:
        """What a remote agent needs to add us: our name, connection info and the memory registered so far."""
        self._check_open()
        return self._agent.getLocalMD()

    def add_remote(self, agent_metadata: bytes) -> str:
        """Add a remote agent; returns its name. Adding the same metadata again is a no-op; metadata of
        another agent of a name already added (a restarted peer) needs `remove_remote` first."""
        self._check_open()
        for name, md in self._remotes.items():
            if md == agent_metadata:
                return name
        try:
            name = self._agent.loadRemoteMD(agent_metadata)
        except self._nb.nixlNotAllowedError as e:
            raise ValueError("an agent of that name was already added with other metadata; remove_remote it first") from e
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes[name] = agent_metadata
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent and disconnect from it; unknown names are ignored."""
        self._check_open()
        if self._remotes.pop(name, None) is not None:
            self._agent.invalidateRemoteMD(name)

    # ---- transfers --------------------------------------------------------------------------
    def read(
        self,
        remote: str,
        runs: list[tuple[int, int, int]],
        notif: bytes = b"",
        remote_is_cuda: bool = False,
        remote_device_id: int = 0,
    ) -> TransferHandle:
        """Post ONE transfer reading every `(local_addr, remote_addr, nbytes)` run from `remote`.

        `notif` reaches the remote once the whole read landed. No runs: nothing is read and the
        notif is sent at once. Bad arguments raise `ValueError`; a failing transfer never raises,
        it reads as FAILED.
        """
        return self._transfer("READ", remote, runs, notif, remote_is_cuda, remote_device_id)

    def write(
        self,
        remote: str,
        runs: list[tuple[int, int, int]],
        notif: bytes = b"",
        remote_is_cuda: bool = False,
        remote_device_id: int = 0,
    ) -> TransferHandle:
        """Post ONE transfer writing every `(local_addr, remote_addr, nbytes)` run to `remote`, the
        same way as `read` (pipeline hand-offs between hosts, `transport.nixl`)."""
        return self._transfer("WRITE", remote, runs, notif, remote_is_cuda, remote_device_id)

    def _transfer(
        self, op: str, remote: str, runs: list[tuple[int, int, int]], notif: bytes, remote_is_cuda: bool,
        remote_device_id: int,
    ) -> TransferHandle:  # fmt: skip
        self._check_open()
        if remote not in self._remotes:
            raise ValueError(f"unknown remote agent {remote!r}; add_remote it first")
        local_is_cuda, local_device_id = self._check_local_runs(runs)
        nbytes = sum(n for _, _, n in runs)
        event = f"nixl_{op.lower()}_failed"
        if not runs:
            state = TransferState.DONE
            if notif:
                try:
                    self._agent.genNotif(remote, notif, [self._backend])
                except Exception as e:  # noqa: BLE001 - any NIXL error: the peer is unreachable
                    self._log.warning("nixl_notif_failed", remote=remote, error=repr(e))
                    state = TransferState.FAILED
            return TransferHandle(remote, 0, 0, None, state)
        local = np.array([(a, n, local_device_id) for a, _, n in runs], dtype=np.uint64)
        far = np.array([(ra, n, remote_device_id) for _, ra, n in runs], dtype=np.uint64)
        nb = self._nb
        try:
            req = self._agent.createXferReq(
                getattr(nb, f"NIXL_{op}"), nb.nixlXferDList(self._seg(local_is_cuda), local),
                nb.nixlXferDList(self._seg(remote_is_cuda), far), remote, notif, [self._backend],
            )  # fmt: skip
        except (nb.nixlNotFoundError, nb.nixlInvalidParamError) as e:
            # Local runs and the remote were checked above: what is left is the remote's memory.
            raise ValueError(f"runs outside the memory {remote!r} registered ({e})") from e
        except Exception as e:  # noqa: BLE001 - the peer is unusable (disconnected)
            self._log.warning(event, remote=remote, error=repr(e))
            return TransferHandle(remote, nbytes, len(runs), None, TransferState.FAILED)
        handle = TransferHandle(remote, nbytes, len(runs), req, TransferState.RUNNING)
        self._handles.add(handle)
        try:
            status = self._agent.postXferReq(req)
            handle._state = TransferState.DONE if status == nb.NIXL_SUCCESS else TransferState.RUNNING
        except Exception as e:  # noqa: BLE001 - e.g. the remote agent is gone
            self._log.warning(event, remote=remote, error=repr(e))
            handle._state = TransferState.FAILED
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """The read's state, without blocking; FAILED on any NIXL error."""
        if handle._state is TransferState.RUNNING and not handle._released:
            try:
                status = self._agent.getXferStatus(handle._req)
                if status == self._nb.NIXL_SUCCESS:
                    handle._state = TransferState.DONE
                elif status != self._nb.NIXL_IN_PROG:
                    handle._state = TransferState.FAILED
            except Exception as e:  # noqa: BLE001 - any NIXL error fails the read
                self._log.warning("nixl_read_failed", remote=handle.remote, error=repr(e))
                handle._state = TransferState.FAILED
        return handle._state

    def release(self, handle: TransferHandle) -> None:
        """Free the read's NIXL handle; once this returns, nothing of the read touches local memory.

        NIXL cannot abort a running read (see the module docstring), so a running one is waited for,
        up to `release_timeout_s`; past that `TimeoutError` is raised, the handle is kept (`close`
        tries again) and the local memory it targets must not be reused. Releasing twice is a no-op.
        """
        if handle._released:
            return
        deadline = time.monotonic() + self._release_timeout_s
        while self.poll(handle) is TransferState.RUNNING:
            if time.monotonic() > deadline:
                self._abandoned.add(handle)
                raise TimeoutError(
                    f"a NIXL read from {handle.remote!r} still runs after {self._release_timeout_s} s;"
                    " its local memory may still be written"
                )
            time.sleep(_POLL_SLEEP_S)
        handle._released = True
        self._handles.discard(handle)
        self._abandoned.discard(handle)
        if handle._req is not None:
            try:
                self._agent.releaseXferReq(handle._req)
            except Exception as e:  # noqa: BLE001 - the transfer has ended; only NIXL's bookkeeping leaks
                self._log.warning("nixl_release_failed", remote=handle.remote, error=repr(e))

    def release_ended(self) -> int:
        """Release the reads `release` gave up on that have ended since (a peer that was stopped
        resumed); returns how many are still running. Never waits."""
        for handle in list(self._abandoned):
            if self.poll(handle) is not TransferState.RUNNING:
                self.release(handle)
        return len(self._abandoned)

    # ---- notifications ----------------------------------------------------------------------
    def send_notif(self, remote: str, msg: bytes) -> None:
        """Send `msg` to `remote` outside any transfer; raises if it cannot be sent."""
        self._check_open()
        if remote not in self._remotes:
            raise ValueError(f"unknown remote agent {remote!r}; add_remote it first")
        self._agent.genNotif(remote, msg, [self._backend])

    def get_notifs(self) -> list[bytes]:
        """Notifications received since the last call, from any remote, each once."""
        self._check_open()
        by_agent = self._agent.getNotifs({}, [self._backend])
        return [msg for msgs in by_agent.values() for msg in msgs]

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release every read (waiting for running ones), deregister memory, destroy the agent. Idempotent."""
        if self._closed:
            return
        for handle in list(self._handles):
            try:
                self.release(handle)
            except TimeoutError as e:
                self._log.error("nixl_close_read_still_running", error=str(e))
        for reg_list in self._reg_lists:
            try:
                self._agent.deregisterMem(reg_list, [self._backend])
            except Exception as e:  # noqa: BLE001 - closing goes on
                self._log.warning("nixl_deregister_failed", error=repr(e))
        self._closed = True
        self._reg_lists.clear()
        self._regions.clear()
        self._remotes.clear()
        self._handles.clear()
        self._abandoned.clear()
        self._agent = None  # the last reference: NIXL's destructor joins its thread, closes connections
        self._tensors.clear()
        self._forget_name()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL transport {self._name!r} is closed")

    def _forget_name(self) -> None:
        with NixlTransport._names_lock:
            NixlTransport._live_names.discard(self._name)

    def _seg(self, is_cuda: bool) -> Any:
        return self._nb.VRAM_SEG if is_cuda else self._nb.DRAM_SEG

    def _check_local_runs(self, runs: list[tuple[int, int, int]]) -> tuple[bool, int]:
        """(is_cuda, device_id) of the local memory every run lies in; `ValueError` otherwise."""
        starts = [r.addr for r in self._regions]
        kinds = set()
        for addr, _, nbytes in runs:
            i = bisect.bisect_right(starts, addr) - 1
            if nbytes <= 0 or i < 0 or addr + nbytes > starts[i] + self._regions[i].nbytes:
                raise ValueError(f"run at {addr:#x} (+{nbytes}) is not inside registered local memory")
            kinds.add((self._regions[i].is_cuda, self._regions[i].device_id))
        if len(kinds) > 1:
            raise ValueError("one read's local runs must all lie on one device")
        return kinds.pop() if kinds else (False, 0)
