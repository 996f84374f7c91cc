"""Every environment variable the device layer reads, declared once: name, form, default, meaning.

Each variable is parsed when it is read, by its declared parser; a malformed value raises
``ValueError`` naming the variable, the value and the expected form. ``DeviceLayerConfig``
holds the parsed values that ``import ditorch`` acts on.

>>> from ditorch.env import VARIABLES, read
>>> read("DITORCH_QUIET", {"DITORCH_QUIET": "1"})
True
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any, Callable

BACKEND_NAMES = ("npu", "mlu", "dipu", "musa", "cuda", "sim", "cpu")


def parse_flag(text: str) -> bool:
    if text in ("1", "true", "True", "yes", "on"):
        return True
    if text in ("0", "false", "False", "no", "off", ""):
        return False
    raise ValueError("not a flag")


def parse_backend(text: str) -> str | None:
    if text == "":
        return None
    if text.lower() not in BACKEND_NAMES:
        raise ValueError("unknown backend")
    return text.lower()


def parse_positive_int(text: str) -> int:
    value = int(text)  # ValueError on non-integers, reworded by read()
    if value < 1:
        raise ValueError("not positive")
    return value


def parse_optional_positive_int(text: str) -> int | None:
    return None if text == "" else parse_positive_int(text)


_BYTE_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_optional_bytes(text: str) -> int | None:
    """``"512MiB"`` -> 536870912; empty -> None."""
    if text == "":
        return None
    number = text.rstrip("KMGTiB")
    unit = text[len(number):]
    if unit not in _BYTE_UNITS:
        raise ValueError("unknown unit")
    return parse_positive_int(number.strip()) * _BYTE_UNITS[unit]


def parse_sim_async(text: str) -> int:
    value = int(text or "0")  # ValueError on non-integers, reworded by read()
    if value < 0:
        raise ValueError("negative")
    return value


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """How many ranks this node runs (torchrun's ``LOCAL_WORLD_SIZE``), 1 outside torchrun: the device count
    of a device that stands in for a node's accelerators (sim, the host)."""
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "").strip()
    if not text:
        return 1
    try:
        return parse_positive_int(text)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r}: expected a positive integer (set by torchrun)") from None


def parse_sim_faults(text: str) -> list:
    # Delegated: the fault grammar lives with the sim device, and it words its own errors.
    from .sim.fault_injection import parse_faults

    return parse_faults(text)


def parse_sim_tf32(text: str) -> frozenset:
    from .sim.tf32 import parse_families

    return parse_families(text)


def parse_sim_numerics(text: str):
    from .sim.gpu_numerics import parse_mode

    return parse_mode(text)


def parse_sim_sdpa(text: str):
    from .sim.attention import parse_algorithm

    return parse_algorithm(text)


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    form: str
    default: str
    meaning: str
    parse: Callable[[str], Any]
    # A misspelt name of such a variable is an error, not a warning: the run would go on, on another device.
    selects_device: bool = False


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("DITORCH_BACKEND", "one of " + ", ".join(BACKEND_NAMES) + " (empty: detect)", "",
           "Force the backend instead of detecting it; an unavailable backend is an error.", parse_backend,
           selects_device=True),
    EnvVar("DITORCH_QUIET", "0 or 1", "0",
           "1 silences the banner line printed by `import ditorch` (and the no-accelerator line).", parse_flag),
    EnvVar("DITORCH_DISABLE_MOCK", "0 or 1", "0",
           "1 detects the backend but patches nothing (no CUDA-to-device transfer).", parse_flag),
    EnvVar("DITORCH_SHOW_DEVICE_AS_CUDA", "0 or 1", "1",
           "1 makes `tensor.device`, `repr(tensor)` and `tensor.type()` report the accelerator as `cuda`; 0 shows "
           "its own name "
           "(`sim:0`, `npu:0`). `tensor.is_cuda` is true on the accelerator either way: CUDA-written code asks it.",
           parse_flag),
    EnvVar("DITORCH_SIM_DEVICE_COUNT", "a positive integer (the number of sim devices)", "",
           "How many sim devices `ditorch.sim.register()` creates; unset: one per local rank under torchrun "
           "(`LOCAL_WORLD_SIZE`), else 1, so `torch.cuda.set_device(local_rank)` works as on a real node.",
           parse_optional_positive_int, selects_device=True),
    EnvVar("DITORCH_SIM_FAULTS", "'pattern[@dtype]:kind[,p=<fraction>][,rank=<r>]' joined by ';' (see "
           "ditorch/sim/fault_injection.py)", "",
           "Faults the sim device injects into matching aten ops: unsupported, nan, inf, noise=<rel>, "
           "bitflip=<N> (one bit of one element every N-th call), slow=<ms>, scratch=<rel> (the kernel scales an "
           "input it only reads first), unversioned; p= makes an output "
           "fault intermittent, rank= keeps a fault to one rank.", parse_sim_faults),
    EnvVar("DITORCH_SIM_TF32", "0, 1 (both), or a comma list of matmul, conv", "0",
           "Float32 op families the sim device computes with TF32 operands, as tensor cores do, turned on by "
           "`ditorch.sim.register()`: matmul sets `torch.backends.cuda.matmul.allow_tf32` (sim's matmuls follow it "
           "as cuBLAS does; `torch.sim.matmul.allow_tf32` is the same switch), conv `torch.sim.conv.allow_tf32`. "
           "0 leaves both as the script sets them; off, sim is bit-identical to the CPU.",
           parse_sim_tf32),
    EnvVar("DITORCH_SIM_NUMERICS", "cpu or gpu", "cpu",
           "gpu makes the sim device sum (`sum`, `mean`) in the order of a CUDA reduction kernel (a warp of 32 "
           "threads with 4 accumulators each and a pairwise tree over contiguous terms, a thread per result over "
           "strided ones, float32 accumulation for half types) and split GEMMs of inner dimension above 256 along "
           "it (split-K), computes `_log_softmax` in CUDA's association and `addcmul`/`addcdiv` with a fused "
           "multiply-add, which differ legitimately from the CPU's; cpu keeps sim bit-identical to the CPU.",
           parse_sim_numerics),
    EnvVar("DITORCH_SIM_SDPA", "math, or chunked[:<keys per block>]", "math",
           "The algorithm of `scaled_dot_product_attention` on the sim device: PyTorch's math path, or a "
           "flash-attention-style chunked online softmax through the fused-attention ops.", parse_sim_sdpa),
    EnvVar("DITORCH_SIM_DEVICE_MEMORY", "0 or 1", "0",
           "1 makes a sim tensor's `untyped_storage()` report sim memory that the host cannot read, as a GPU "
           "tensor's does, so that tools take their device-memory branches (statistics on the device) on sim; "
           "views then do not share a storage. 0 reports the CPU storage holding the values.", parse_flag),
    EnvVar("DITORCH_SIM_TOTAL_MEMORY", "a positive number of bytes, or of KiB, MiB, GiB or TiB (e.g. 2GiB)", "",
           "The memory of each sim device (`get_device_properties().total_memory`, `mem_get_info()`); an allocation "
           "that would take the device's allocated bytes past it raises `torch.OutOfMemoryError` "
           "(`torch.cuda.OutOfMemoryError`), as a GPU's does. Unset: the host's physical memory.",
           parse_optional_bytes),
    EnvVar("DITORCH_SIM_ASYNC", "an integer >= 0 (kernel launches)", "0",
           "N makes the sim device asynchronous as a GPU is: an event completes, and a non-blocking copy to the host "
           "lands (its destination holds NaN until then), N kernel launches after it was recorded or made, or at a "
           "synchronisation. 0 keeps sim synchronous: every event complete, every copy landed.", parse_sim_async),
    EnvVar("DITORCH_REDUCE_LOW_PRECISION_IN_FP32", "0 or 1", "0",
           "1 carries bfloat16/float16 reductions (all_reduce, reduce, reduce_scatter, reduce_scatter_tensor) in "
           "float32: cast up, reduce, copy back. Costs a float32 copy of each reduced tensor (twice a bf16 "
           "tensor's memory) and a cast and a copy per collective; read when a process group is created (sim, "
           "the host) or by `import ditorch` (vendor backends).", parse_flag),
)}


# DITORCH_* names this repository's scripts and tests read, not the library: no typo warning for them.
USED_ELSEWHERE = {
    "DITORCH_TORCH_PIN": "scripts/install.sh: the torch requirement it installs",
    "DITORCH_TESTS_GPU_CHILD": "tests/conftest.py: set in the interpreter a gpu test runs in",
}


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``DITORCH_*`` variable set that ditorch does not read, with the closest name it reads.

    Raises ``ValueError`` instead for a misspelt variable that chooses the device (``DITORCH_BACKNED=sim``) while
    the right one is unset: the run would otherwise go on, on another device, and fail far from the cause.

    >>> unknown_variables({"DITORCH_QUITE": "1"})
    ['DITORCH_QUITE is not a variable ditorch reads; did you mean DITORCH_QUIET?']
    """
    environ = os.environ if environ is None else environ
    known = [*VARIABLES, *USED_ELSEWHERE]
    found = []
    for name in sorted(environ):
        if name.startswith("DITORCH_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            meant = VARIABLES.get(close[0]) if close else None
            if meant is not None and meant.selects_device and meant.name not in environ:
                raise ValueError(f"{name} is not a variable ditorch reads; did you mean {meant.name}? Ignored, the "
                                 f"run would go on without it, on devices other than those it asks for: set "
                                 f"{meant.name}={environ[name]} instead, or unset {name}.")
            hint = f"; did you mean {close[0]}?" if close else " (docs/env_variables.md lists them)"
            found.append(f"{name} is not a variable ditorch reads{hint}")
    return found


def read(name: str, environ: Mapping[str, str] | None = None):
    """The parsed value of the declared variable ``name`` (its default when unset)."""
    var = VARIABLES[name]
    text = (os.environ if environ is None else environ).get(name, var.default).strip()
    try:
        return var.parse(text)
    except ValueError as error:
        if name in str(error):  # the parser already named the variable (fault specs do)
            raise
        raise ValueError(f"{name}={text!r}: expected {var.form}") from None


@dataclasses.dataclass(frozen=True)
class DeviceLayerConfig:
    """What ``import ditorch`` does, parsed once from the environment."""

    backend: str | None
    quiet: bool
    disable_mock: bool
    show_device_as_cuda: bool

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DeviceLayerConfig:
        return cls(
            backend=read("DITORCH_BACKEND", environ),
            quiet=read("DITORCH_QUIET", environ),
            disable_mock=read("DITORCH_DISABLE_MOCK", environ),
            show_device_as_cuda=read("DITORCH_SHOW_DEVICE_AS_CUDA", environ),
        )
