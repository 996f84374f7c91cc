"""How the tests' torchrun scripts end: this rank's JSON report written, then the group torn down by all ranks
together (a gloo rank whose peer leaves while it still talks aborts)."""

from __future__ import annotations

import json

import torch.distributed as dist


def finish(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
