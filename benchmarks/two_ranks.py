"""What the benchmarks run over two ranks share: the script launched again under torchrun with ``--worker``
(``DITORCH_BACKEND=sim``: "cuda" and "nccl" are sim's), and each worker's process group.

    returncode = two_ranks.launch(__file__, ["--size", "tiny"])      # in the parent
    rank, local_rank = two_ranks.join()                              # in each worker
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(script: str, arguments: list[str], env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> int:
    """Run ``script --worker *arguments`` on two ranks (``torch.distributed.run --standalone``), one OpenMP thread
    each, the tools quiet; ``env``: more variables, ``drop``: variables the workers must not inherit. Its exit
    status."""
    path = os.pathsep.join(p for p in (ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")) if p)
    variables = dict(os.environ, DITORCH_BACKEND="sim", DITORCH_QUIET="1", OMP_NUM_THREADS="1", OP_TOOLS_VERBOSE="0",
                     TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=path, **(env or {}))
    for name in drop:
        variables.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(script), "--worker", *arguments]
    return subprocess.run(command, env=variables, cwd=ROOT).returncode


def join() -> tuple[int, int]:
    """In a worker: its device set from ``LOCAL_RANK`` and the process group begun; ``(rank, local rank)``."""
    import torch
    import torch.distributed as dist

    import ditorch  # noqa: F401 - DITORCH_BACKEND=sim: "cuda" and "nccl" are sim's

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return dist.get_rank(), local_rank
