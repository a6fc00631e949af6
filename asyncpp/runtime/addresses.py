"""Where the processes of one run talk: ipc:// paths in a private run directory."""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class RunAddresses:
    run_id: str
    run_dir: str
    token: str | None = None  # local runs need none: the run dir is private (0700)

    @staticmethod
    def create() -> "RunAddresses":
        run_id = uuid.uuid4().hex[:12]
        run_dir = tempfile.mkdtemp(prefix=f"asyncpp-{run_id}-")
        os.chmod(run_dir, 0o700)
        return RunAddresses(run_id, run_dir)

    def plan(self, pp_rank: int) -> str:
        return f"ipc://{self.run_dir}/plan-{pp_rank}"

    def activations(self, pp_rank: int) -> str:
        return f"ipc://{self.run_dir}/act-{pp_rank}"

    @property
    def sampled_tokens(self) -> str:
        return f"ipc://{self.run_dir}/sampled"

    @property
    def stage_outputs(self) -> str:
        return f"ipc://{self.run_dir}/outputs"

    def ring_name(self, pp_rank: int) -> str:
        # POSIX shm names are short; the run id keeps concurrent runs apart.
        return f"asyncpp-{self.run_id}-ring{pp_rank}"

    def shared_kv_name(self, boundary: int) -> str:
        """The shared KV cache of the layers around stage boundary `boundary` (0: stages 0 and 1)."""
        return f"asyncpp-{self.run_id}-kv{boundary}"

    def ring_names(self, pp_size: int) -> list[str]:
        """Every shared-memory ring a run may create: stage r's activation ring (r >= 1), and as
        stage 0's the token ring (`asyncpp.transport.token_ring`), on CPU stages."""
        return [self.ring_name(rank) for rank in range(pp_size)]
