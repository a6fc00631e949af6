"""`EngineChild`: one engine of a deployment of several (prefill/decode, data parallel), run as a
child `python -m asyncpp.launch`.

The child runs in its own session, so a Ctrl-C in the terminal reaches only
the launcher, which stops the children in order; the kernel sends it SIGTERM
if the launcher dies without reaping it (it then drains and stops its own
stages). It may be bound to a set of CPUs, which its stages inherit (and pin
their threads within). Its stderr is forwarded line by line, prefixed with
its role on the console; its ready line ("asyncpp ready: clients connect to
ADDRESS") is read for the address and kept back, so that whoever reads the
launcher's output sees only the router's (which may repeat what follows the
address, `ready_detail`). Stopping it is SIGTERM (it drains
within its grace period), then SIGKILL to its whole process group.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable

from asyncpp.logging import get_logger
from asyncpp.runtime.parent_death import preexec_dying_with_parent

READY_RE = re.compile(r"asyncpp ready: clients connect to (\S+)(?: \((.*)\))?")
NUM_TAIL_LINES = 40
MAX_LINE_BYTES = 1 << 20  # a longer log line ends the forwarding (asyncio's default is 64 KiB)


class EngineStartError(RuntimeError):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class EngineChild:
    def __init__(
        self, role: str, args: list[str], *, cpus: tuple[int, ...] | None = None, prefix_output: bool = True,
        log_role: str = "pd_launch",
    ) -> None:  # fmt: skip
        self.role = role
        self.args = args  # after `python -m asyncpp.launch`
        self.cpus = cpus  # None: the launcher's CPUs
        self.prefix = f"[{role}] " if prefix_output else ""
        self.proc: asyncio.subprocess.Process | None = None
        self.output_tail: collections.deque[str] = collections.deque(maxlen=NUM_TAIL_LINES)
        self.is_stopping = False
        self.ready_detail = ""  # what its ready line says after the address (its compute plan), unbracketed
        self._address: asyncio.Future | None = None
        self._pump: asyncio.Task | None = None
        self.log = get_logger(role=log_role, engine=role)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        cpus = self.cpus

        def pin() -> None:  # between fork and exec: system calls only
            if cpus:
                os.sched_setaffinity(0, cpus)

        in_child = preexec_dying_with_parent(signal.SIGTERM, pin)  # the engine drains and stops its stages
        self._address = asyncio.get_running_loop().create_future()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asyncpp.launch", *self.args,
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=in_child,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), limit=MAX_LINE_BYTES,
        )  # fmt: skip
        self._pump = asyncio.create_task(self._forward_output(), name=f"{self.role}_output")
        self.log.info("engine_started", pid=self.proc.pid, cpus=list(cpus) if cpus else None)

    async def _forward_output(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.output_tail.append(line)
            m = READY_RE.search(line)
            if m and not self._address.done():
                self.ready_detail = m.group(2) or ""
                self._address.set_result(m.group(1))
                continue
            sys.stderr.write(self.prefix + line)
        if not self._address.done():
            code = await self.proc.wait()
            tail = "".join(self.output_tail)
            self._address.set_exception(
                EngineStartError(f"the {self.role} engine exited with code {code} before it was ready:\n{tail}", code)
            )

    async def wait_ready(self, timeout_s: float) -> str:
        """The engine's client address, once it is ready."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._address), timeout_s)
        except TimeoutError:
            raise EngineStartError(f"the {self.role} engine was not ready within {timeout_s:g} s") from None

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL its process group; always reaped."""
        if self.proc is None:
            return None
        self.is_stopping = True
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.log.warning("engine_killed", pid=self.proc.pid, timeout_s=timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: its stages go too
                await self.proc.wait()
        if self._pump is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pump, 2.0)  # its last lines
        if self._address is not None and self._address.done() and not self._address.cancelled():
            self._address.exception()  # a start-up failure nobody waited for is not an error to report again
        return self.proc.returncode


async def watch_exit(child: EngineChild, mark_gone: Callable[[str], None]) -> None:
    """A child engine that exits while its launcher runs (not stopped by it): `mark_gone(why)`, then
    return; until then, wait (cancel it at shutdown)."""
    code = await child.wait()
    if not child.is_stopping:
        mark_gone(f"its process exited with code {code}")
