"""Run by tests/op_tools/test_run_report.py under torchrun (2 processes) on sim: two optimizer steps of a DDP tiny
Llama under one tool per scenario named on the command line, with what the scenario injects, the results in
``OUT/<scenario>``; this rank's verdicts in ``OUT/rank<N>.json``, by scenario.

Scenarios: ``clean`` (OpOverflowCheck and OpAutoCompare together), ``nan`` (OpOverflowCheck, silu gives NaN on
rank 1 in step 1), ``noise`` (OpAutoCompare, silu off by 1e-2 on rank 1 in step 1), ``desync`` (OpTimeMeasure over
three steps, rank 1 nudges one weight after step 0 and runs its matmuls 8 ms slower), ``rerun`` (desync's again,
nothing injected: a later run that a test writes into desync's folder).
"""

import contextlib
import os
import sys

import rank_reports  # tests/, on the path torchrun's children get
import tiny_models
import torch
import torch.distributed as dist

import ditorch
import op_tools

NUDGED = "model.layers.0.mlp.up_proj.weight"


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    report = {scenario: run(out, scenario, local_rank) for scenario in scenarios}
    rank_reports.finish(os.path.join(out, f"rank{dist.get_rank()}.json"), report)


def run(out: str, scenario: str, local_rank: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_models.tiny_llama().cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    results = os.path.join(out, scenario)
    tools = {"clean": ("OpOverflowCheck", "OpAutoCompare"), "nan": ("OpOverflowCheck",),
             "noise": ("OpAutoCompare",), "desync": ("OpTimeMeasure",), "rerun": ("OpTimeMeasure",)}[scenario]
    fault = {"nan": "silu:nan", "noise": "silu:noise=1e-2"}.get(scenario, "")
    steps = 3 if scenario in ("desync", "rerun") else 2
    report: dict = {}
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(getattr(op_tools, name)(results_dir=results)) for name in tools]
        for step in range(steps):
            injected = fault if rank == 1 and step == 1 else ""
            if scenario == "desync" and rank == 1:
                injected = "mm:slow=8;addmm:slow=8;bmm:slow=8"  # well above a loaded VM's jitter
            ids = torch.randint(0, 128, (2, 16), generator=generator).cuda()
            with ditorch.sim.faults(injected):
                tiny_models.lm_step(ddp, optimizer, ids)
            if scenario == "desync" and rank == 1 and step == 0:
                with torch.no_grad():
                    model.get_parameter(NUDGED)[0, 0] += 1e-3
    for name, tool in zip(tools, started):
        report[name] = {"verdict": tool.verdict(), "found": tool.found(), "not_checked": tool.not_checked()}
    return report


if __name__ == "__main__":
    main()
