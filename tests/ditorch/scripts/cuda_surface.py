"""Run under a backend (DITORCH_BACKEND, or stand-in vendor packages on PYTHONPATH): report, as JSON on the
last line, how each public torch.cuda callable is classified and what the patched attribute does, and
(with --common) whether the torch.cuda calls common in scripts, and the PyTorch flows that reach
torch.cuda, work. Used by tests/ditorch/test_cuda_surface.py."""

import json
import sys
import traceback

import torch

import ditorch
from ditorch import cuda_api
from ditorch.adapters import vendor

# torch.cuda calls common in training scripts and libraries (statements, run in order).
COMMON = {
    "is_available": "assert torch.cuda.is_available()",
    "device_count": "assert torch.cuda.device_count() >= 1",
    "current_device": ("assert isinstance(torch.cuda.current_device(), int); "
                       "torch.ones(1, device=torch.device('cuda', torch.cuda.current_device()))"),
    "set_device": "torch.cuda.set_device(0); torch.cuda.set_device('cuda:0')",
    "device": "with torch.cuda.device(0): pass",
    # a negative ordinal is a no-op, as torch.cuda documents: scripts pass --local_rank=-1 outside a launcher
    "set_device(-1)": "torch.cuda.set_device(-1); assert torch.cuda.current_device() == 0",
    "device(-1)": "with torch.cuda.device(-1): assert torch.cuda.current_device() == 0",
    "get_device_name": "assert isinstance(torch.cuda.get_device_name(0), str)",
    "get_device_properties": "assert torch.cuda.get_device_properties(0).total_memory >= 0",
    "get_device_capability": "assert len(torch.cuda.get_device_capability()) == 2",
    "is_bf16_supported": "torch.cuda.is_bf16_supported()",
    "is_tf32_supported": "torch.cuda.is_tf32_supported()",
    "is_initialized": "torch.cuda.is_initialized()",
    "init": "torch.cuda.init()",
    "get_arch_list": "assert isinstance(torch.cuda.get_arch_list(), list)",
    "synchronize": "torch.cuda.synchronize(); torch.cuda.synchronize('cuda')",
    "empty_cache": "torch.cuda.empty_cache()",
    "ipc_collect": "torch.cuda.ipc_collect()",
    "manual_seed": "torch.cuda.manual_seed(0); torch.cuda.manual_seed_all(0)",
    "seed": "torch.cuda.seed(); torch.cuda.initial_seed()",
    "rng_state": "torch.cuda.set_rng_state(torch.cuda.get_rng_state()); torch.cuda.get_rng_state_all()",
    "memory_allocated": "assert torch.cuda.memory_allocated() >= 0 and torch.cuda.max_memory_allocated() >= 0",
    "memory_reserved": "assert torch.cuda.memory_reserved() >= 0 and torch.cuda.max_memory_reserved() >= 0",
    "memory_cached": "torch.cuda.memory_cached()",
    "reset_peak_memory_stats": "torch.cuda.reset_peak_memory_stats(); torch.cuda.reset_max_memory_allocated()",
    "memory_stats": "assert isinstance(torch.cuda.memory_stats(), dict)",
    "memory_summary": "assert 'memory' in torch.cuda.memory_summary()",
    "mem_get_info": "free, total = torch.cuda.mem_get_info(); assert 0 <= free <= total",
    "set_per_process_memory_fraction": ("torch.cuda.set_per_process_memory_fraction(0.9); "
                                        "assert torch.cuda.get_per_process_memory_fraction() == 0.9"),
    "utilization": "assert torch.cuda.utilization() >= 0",
    "is_current_stream_capturing": "assert torch.cuda.is_current_stream_capturing() is False",
    "streams": ("s = torch.cuda.Stream()\nwith torch.cuda.stream(s): torch.ones(2, device='cuda')\n"
                "torch.cuda.current_stream().wait_stream(s); torch.cuda.default_stream().synchronize()"),
    "Event": ("a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
              "a.record(); torch.ones(4, device='cuda').sum(); b.record(); b.synchronize()\n"
              "assert a.elapsed_time(b) >= 0"),
    "nvtx.range_push": "assert torch.cuda.nvtx.range_push('step') == 0 and torch.cuda.nvtx.range_pop() == 0",
    "nvtx.range": "with torch.cuda.nvtx.range('epoch {}', 1): torch.cuda.nvtx.mark('here')",
    "nvtx.range_start": "torch.cuda.nvtx.range_end(torch.cuda.nvtx.range_start('load'))",
    "device_of": "with torch.cuda.device_of(torch.ones(1, device='cuda')): pass",
    "amp.autocast": ("import warnings; warnings.simplefilter('ignore', FutureWarning)\n"
                     "with torch.cuda.amp.autocast(dtype=torch.bfloat16): torch.ones(2, 2, device='cuda') @ "
                     "torch.ones(2, 2, device='cuda')"),
}

# What PyTorch itself does with torch.cuda (or the device's module) in ordinary training.
FLOWS = {
    "optimizer step (graph-capture checks)": """
model = torch.nn.Linear(4, 2).cuda()
for opt in (torch.optim.AdamW(model.parameters()), torch.optim.Adam(model.parameters(), foreach=True)):
    model(torch.ones(3, 4, device='cuda')).sum().backward(); opt.step(); opt.zero_grad()
""",
    "GradScaler and autocast": """
model = torch.nn.Linear(4, 2).cuda(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler('cuda')
with torch.autocast('cuda', dtype=torch.bfloat16):
    loss = model(torch.ones(3, 4, device='cuda')).float().sum()
scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
""",
    "activation checkpointing (device RNG state saved and restored)": """
import torch.utils.checkpoint as cp
layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).cuda()
x = torch.ones(2, 4, device='cuda', requires_grad=True)
cp.checkpoint(layer, x, use_reentrant=False).sum().backward()
cp.checkpoint(layer, x, use_reentrant=True).sum().backward()
assert x.grad is not None
""",
    "DataLoader: 2 workers, pin_memory, .cuda(non_blocking=True)": """
data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.arange(16))
loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, pin_memory=True)
import warnings
with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)  # the host: "no accelerator is found" for pin_memory
    batches = [(x.cuda(non_blocking=True), y.cuda(non_blocking=True)) for x, y in loader]
assert len(batches) == 4 and all(x.is_cuda for x, _ in batches)
""",
    "torch.random.fork_rng over the device": """
with torch.random.fork_rng(device_type='cuda'):
    torch.randn(2, device='cuda')
""",
}


def run(statements: dict) -> dict:
    results = {}
    for name, code in statements.items():
        try:
            exec(code, {"torch": torch})
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=-3)
    return results


def _attribute(api: str):
    obj = torch
    for part in api.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def behaviour(api: str) -> str:
    """"refused" when calling the patched attribute raises ditorch's NotImplementedError naming ``api``."""
    obj = _attribute(api)
    if not cuda_api.is_refusal(obj):
        return "not refused"
    try:
        obj()
    except NotImplementedError as error:
        named = f"{api} is not available on the {ditorch.backend.name} backend" in str(error)
        return "refused" if named else str(error)
    return "refusal stand-in did not raise"


def coverage_report() -> dict:
    """``{api: [how ditorch classifies it, what the patched torch.cuda attribute does]}`` for this backend."""
    backend = ditorch.backend
    # After a vendor's own transfer, ditorch maps only the gaps; the rest is the vendor's.
    # (less the names its transfer mapped itself where ditorch would refuse them: vendor.VENDOR_KEPT)
    own = [n for n in vendor.gap_names() if n not in vendor.VENDOR_KEPT] if backend.name in ("npu", "mlu") else None
    apis = [api for api in cuda_api.surface() if own is None or api.split(".")[2] in own]
    return {api: [cuda_api.resolve(api, backend)[0], behaviour(api)] for api in apis}


def warnings_given() -> list[str]:
    """The warnings of an LSTM step and a float32 autocast, which a CUDA run gives none of."""
    import warnings

    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        lstm = torch.nn.LSTM(4, 4, batch_first=True).cuda()
        lstm(torch.randn(2, 3, 4).cuda())[0].sum().backward()
        if ditorch.backend.name == "sim":  # the host's is torch's CPU autocast, which refuses float32 itself
            with torch.autocast("cuda", dtype=torch.float32):
                torch.ones(2, 2).cuda() @ torch.ones(2, 2).cuda()
    return [str(w.message).splitlines()[0] for w in given]


def main() -> None:
    report = {"backend": ditorch.backend.name, "coverage": coverage_report()}
    if "--common" in sys.argv:
        report["common"] = run(COMMON)
        report["flows"] = run(FLOWS)
        report["warnings"] = warnings_given()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
