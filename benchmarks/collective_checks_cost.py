"""What OpAutoCompare's collective checks and every tool's replica fingerprints cost a 2-rank DDP training step on sim.

The file launches itself: ``python -m torch.distributed.run --standalone --nproc_per_node=2`` runs it again with
``--worker`` (``DITORCH_BACKEND=sim``, ``DITORCH_QUIET=1``, ``OMP_NUM_THREADS=1``, ``OP_TOOLS_VERBOSE=0``). Each
rank trains a DDP Llama (forward, backward through DDP's gradient buckets, AdamW step, ``loss.item()``) on a batch
of its own, under seven configurations:

    (a) no tool                                  (b) OpAutoCompare(collectives=False), fingerprints off
    (c) OpAutoCompare default: collectives checked, fingerprints on
    (d) OpOverflowCheck, fingerprints off        (e) OpOverflowCheck default (fingerprints on)
    (f) OpTimeMeasure, fingerprints off          (g) OpTimeMeasure default (fingerprints on)

"Fingerprints off" is ``OP_TOOLS_REPLICA_FINGERPRINTS=0``, set in the worker's ``os.environ`` before the tool starts
(it is read then). The tool is started per step: ``with Tool(results_dir=...)`` around one step, both ranks lined
up by a barrier outside it; the step is timed inside the ``with`` (the tool's start and stop, which write its files,
are timed apart). One warm-up step per configuration, then ``--rounds`` rounds, each one step of every
configuration in turn, in the same two processes. Printed: rank 0's median and fastest step wall time and median
process CPU time per configuration, and c/b, e/d, g/f, the cost of the collective checks plus fingerprints
(OpAutoCompare) and of the fingerprints alone (the other two), as a wall-time ratio and as extra ms per step.
Every tool started here registers DDP's communication hook, which all-reduces the buckets synchronously while a
tool runs: (b) to (g) all pay that, (a) does not.

Sizes: ``tiny`` (tests/tiny_models.py's Llama: hidden 64, 2 layers, vocab 128; batch 2x16 per rank) and ``real``
(a transformers Llama of hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 8192; batch 2x64 per rank).

    python benchmarks/collective_checks_cost.py [--size tiny|real] [--rounds 6]    # 2 cores: ~20 s tiny, ~4 min real
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]

import two_ranks  # noqa: E402 - beside this file

# key -> (label, tool class name or None, tool keywords, fingerprints on)
CONFIGS = {
    "a": ("no tool", None, {}, False),
    "b": ("OpAutoCompare collectives=False, fp off", "OpAutoCompare", {"collectives": False}, False),
    "c": ("OpAutoCompare default", "OpAutoCompare", {"collectives": True}, True),
    "d": ("OpOverflowCheck, fp off", "OpOverflowCheck", {}, False),
    "e": ("OpOverflowCheck default", "OpOverflowCheck", {}, True),
    "f": ("OpTimeMeasure, fp off", "OpTimeMeasure", {}, False),
    "g": ("OpTimeMeasure default", "OpTimeMeasure", {}, True),
}
# (with, without, what the difference is)
PAIRS = (("c", "b", "OpAutoCompare collective checks + fingerprints"),
         ("e", "d", "OpOverflowCheck fingerprints"),
         ("g", "f", "OpTimeMeasure fingerprints"))
SIZES = {
    "tiny": ("tests/tiny_models.py Llama (hidden 64, 2 layers, vocab 128)", 128, 2, 16),
    "real": ("Llama hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 8192", 8192, 2, 64),
}


def build_model(size: str):
    import tiny_models

    if size == "tiny":
        return tiny_models.tiny_llama()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def worker(args: argparse.Namespace) -> None:
    """One rank: the DDP model, every configuration's steps timed; rank 0 writes its samples to ``args.out``."""
    import tiny_models
    import torch
    import torch.distributed as dist

    import op_tools

    rank, local_rank = two_ranks.join()
    torch.manual_seed(0)  # the same initial weights on both ranks, as DDP expects
    model = build_model(args.size).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _, vocab, batch, length = SIZES[args.size]
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (batch, length), generator=generator).cuda()

    def one_step(key: str) -> tuple[float, float, float]:
        _, name, keywords, fingerprints = CONFIGS[key]
        os.environ["OP_TOOLS_REPLICA_FINGERPRINTS"] = "1" if fingerprints else "0"
        dist.barrier()  # both ranks start the step together: rank 0's time is not spent waiting for rank 1
        begin = time.perf_counter()
        tool = getattr(op_tools, name)(results_dir=args.results, **keywords) if name else contextlib.nullcontext()
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), tool:
            start, cpu = time.perf_counter(), time.process_time()
            tiny_models.lm_step(ddp, optimizer, ids)
            step, cpu = time.perf_counter() - start, time.process_time() - cpu
        return step, time.perf_counter() - begin - step, cpu

    for key in CONFIGS:  # warm-up: DDP's bucket rebuild, AdamW's state, the hook, the gloo twin group, first calls
        one_step(key)
    samples: dict[str, list] = {key: [] for key in CONFIGS}
    for _ in range(args.rounds):
        for key in CONFIGS:
            samples[key].append(one_step(key))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"samples": samples, "torch": torch.__version__}, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> None:
    """Run the workers under torchrun, then print rank 0's figures."""
    scratch = tempfile.mkdtemp(prefix="collective_checks_cost_")
    out = os.path.join(scratch, "rank0.json")
    arguments = ["--size", args.size, "--rounds", str(args.rounds), "--out", out, "--results",
                 os.path.join(scratch, "results")]
    wall = time.perf_counter()
    try:
        # the configurations set collectives by keyword
        status = two_ranks.launch(__file__, arguments, drop=("OP_AUTOCOMPARE_COLLECTIVES",))
        if status != 0 or not os.path.exists(out):
            sys.exit(f"collective_checks_cost: the workers failed (exit status {status})")
        with open(out) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - wall
    samples = result["samples"]
    step = {key: statistics.median(s[0] for s in samples[key]) for key in CONFIGS}
    description, _, batch, length = SIZES[args.size]
    print(f"torch {result['torch']}, sim, 2 ranks (torch.distributed.run, OMP_NUM_THREADS=1), {os.cpu_count()} cpus; "
          f"DDP {description}, batch {batch}x{length} per rank, AdamW; tool started per step; rank 0's median of "
          f"{args.rounds} alternating rounds after 1 warm-up step each; run took {wall:.0f} s")
    print(f"{'':<44}{'step ms':>10}{'fastest ms':>12}{'cpu ms':>10}{'start+stop ms':>15}")
    for key, (label, *_) in CONFIGS.items():
        fastest = min(s[0] for s in samples[key])
        start_stop, cpu = (statistics.median(s[i] for s in samples[key]) for i in (1, 2))
        print(f"({key}) {label:<40}{step[key] * 1e3:>10.1f}{fastest * 1e3:>12.1f}{cpu * 1e3:>10.1f}"
              f"{start_stop * 1e3:>15.1f}")
    for on, off, what in PAIRS:
        ratio, extra = step[on] / step[off], (step[on] - step[off]) * 1e3
        print(f"summary: collective_checks_cost: {args.size}: {what}: {on}/{off} {ratio:.2f}x, {extra:+.1f} ms/step "
              f"({step[off] * 1e3:.1f} -> {step[on] * 1e3:.1f} ms; no tool {step['a'] * 1e3:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=tuple(SIZES))
    parser.add_argument("--rounds", type=int, default=6, help="measured steps per configuration, one per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
