"""The control plane of a run whose stages may be on other hosts: tcp:// on each node's own IP, one token.

Same methods as `RunAddresses` (the stage loop cannot tell them apart); the
engine's ends (plans, outputs) are on the launcher's node, each stage's
receiving ends (activations; the sampled tokens on stage 0) on its own node,
each bound to the address Ray reports for that node, never to all interfaces.
Every port is the one the OS gave its socket, bound on port 0 with the token
before the address is reported: none is picked free and bound later, when
another user of that host could have taken it and been sent the token.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class TcpAddresses:
    run_id: str
    run_dir: str  # on the launcher's host (StageGroup removes it)
    token: str  # every control connection presents it (`asyncpp.wire.token_auth`)
    plan_addrs: tuple[str, ...]  # by pp_rank: bound by the engine
    outputs_addr: str  # bound by the engine
    activation_addrs: tuple[str, ...]  # by pp_rank, "" for stage 0: bound by the receiving stage
    sampled_addr: str  # bound by stage 0; "" when no sampled tokens pass (no async scheduling)

    def plan(self, pp_rank: int) -> str:
        return self.plan_addrs[pp_rank]

    def activations(self, pp_rank: int) -> str:
        return self.activation_addrs[pp_rank]

    @property
    def sampled_tokens(self) -> str:
        return self.sampled_addr

    @property
    def stage_outputs(self) -> str:
        return self.outputs_addr

    def ring_name(self, pp_rank: int) -> str:
        return f"asyncpp-{self.run_id}-ring{pp_rank}"

    def shared_kv_name(self, boundary: int) -> str:
        return f"asyncpp-{self.run_id}-kv{boundary}"

    def ring_names(self, pp_size: int) -> list[str]:
        return [self.ring_name(rank) for rank in range(1, pp_size)]


def new_token() -> str:
    return secrets.token_hex(16)


def tcp(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
