"""TF32 emulation: float32 matmuls and convolutions computed as tensor cores compute them.

On an Ampere or later GPU, with ``torch.backends.cuda.matmul.allow_tf32`` (cuBLAS) or
``torch.backends.cudnn.allow_tf32`` (cuDNN, on by default) a float32 GEMM or convolution reads
its operands as TF32 (1 sign, 8 exponent, 10 mantissa bits) and accumulates in float32. The sim
device does the same when its switches are on. Matmuls follow CUDA's own switch, read at each call
as cuBLAS reads it: ``torch.backends.cuda.matmul.allow_tf32``, which
``torch.set_float32_matmul_precision("high")`` (or ``"medium"``) and
``torch.backends.cuda.matmul.fp32_precision = "tf32"`` set too; ``torch.sim.matmul.allow_tf32`` is
that same switch. Convolutions follow sim's own ``torch.sim.conv.allow_tf32``, not cuDNN's switch,
whose default (on) would make every sim convolution TF32. ``DITORCH_SIM_TF32`` turns either on at
``register()``. The float32 operands are rounded to the nearest TF32 value (ties to even on the 13
dropped bits; inf and nan kept) and the CPU kernel runs on them in float32. Off by default, so that
sim stays bit-identical to the CPU.

Which ops: the GEMMs ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``addbmm``, ``_addmm_activation``
(what ``linear``, ``matmul`` and ``einsum`` reach the device as), and ``convolution`` with its
backward ``convolution_backward`` (every ``conv*d``/``conv_transpose*d``). Not ``mv``/``addmv``:
PyTorch's cuBLAS ``gemv<float>`` disables TF32 (``NoTF32Guard``, aten/src/ATen/cuda/CUDABlas.cpp:
"gemv is bw bound, and does not benefit from TF32"), nor ``dot``/``addr``, which use no tensor
core. The bias of ``addmm`` (the accumulator C of cuBLAS) stays float32. Backward matmuls and
convolutions that reach the device are rounded too: on a GPU they run in TF32 as well.

>>> torch.sim.matmul.allow_tf32 = True          # doctest: +SKIP
>>> torch.sim.float32_reduced_precision()       # doctest: +SKIP
{'matmul': 'tf32'}
"""

from __future__ import annotations

import threading

import torch

from .kernels import KERNELS

ENV_VAR = "DITORCH_SIM_TF32"
FAMILIES = ("matmul", "conv")
FORM = "0, 1 (both), or a comma list of matmul, conv"
# Per family: op -> the arguments read as TF32 (never the accumulator: addmm's self, out=).
OPERANDS: dict[str, dict[str, tuple[str, ...]]] = {
    "matmul": {
        "mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
        "addmm_": ("mat1", "mat2"), "_addmm_activation": ("mat1", "mat2"), "baddbmm": ("batch1", "batch2"),
        "baddbmm_": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"), "addbmm_": ("batch1", "batch2"),
    },
    "conv": {
        "convolution": ("input", "weight"), "_convolution": ("input", "weight"),
        "convolution_backward": ("grad_output", "input", "weight"),
    },
}
_DROPPED = 13  # float32 has 23 mantissa bits, TF32 10
_HALF = (1 << (_DROPPED - 1)) - 1  # 0xFFF: with the kept bit's parity, rounds half to even
_KEEP = -(1 << _DROPPED)  # ~0x1FFF as an int32


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest TF32 value, ties to even; inf and nan unchanged.

    Works on the bit patterns: adding ``0xFFF`` plus the lowest kept bit and clearing the 13 low
    bits rounds the magnitude to nearest even (a carry into the exponent is the correct result,
    up to inf for values beyond TF32's largest).
    """
    finite = x.isfinite()
    bits = torch.where(finite, x, 0.0).view(torch.int32)
    rounded = ((bits + (bits >> _DROPPED).bitwise_and_(1).add_(_HALF)).bitwise_and_(_KEEP)).view(torch.float32)
    return torch.where(finite, rounded, x)


def _as_tf32(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return round_to_tf32(value)
    return value


def _rounding_kernel(op, names: tuple[str, ...]):
    positions = [i for i, a in enumerate(op._schema.arguments) if a.name in names]

    def kernel(*args, **kwargs):
        args = [_as_tf32(a) if i in positions else a for i, a in enumerate(args)]
        for name in names:
            if name in kwargs:
                kwargs[name] = _as_tf32(kwargs[name])
        return op(*args, **kwargs)

    return kernel


def _overloads(family: str):
    for name, names in OPERANDS[family].items():
        packet = getattr(torch.ops.aten, name)
        for overload_name in packet.overloads():
            yield getattr(packet, overload_name), names


# Newer torch: the matmul precision as its new API resolves it ("tf32", "ieee", "none"); the legacy setters update it,
# and unlike torch._C._get_cublas_allow_tf32 it does not raise once a script has mixed the two APIs.
_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)


def cuda_matmul_allows_tf32() -> bool:
    """Whether cuBLAS would run float32 GEMMs in TF32 now: ``torch.backends.cuda.matmul.allow_tf32``, also set
    by ``torch.set_float32_matmul_precision("high")`` or ``("medium")`` and by ``fp32_precision = "tf32"``."""
    if _FP32_PRECISION is not None:
        return _FP32_PRECISION("cuda", "matmul") == "tf32"
    return torch._C._get_cublas_allow_tf32()


def _cuda_switched_kernel(op, names: tuple[str, ...]):
    rounding = _rounding_kernel(op, names)

    def kernel(*args, **kwargs):
        # read at each call, as cuBLAS does: a script sets the switch whenever it likes, and no hook tells
        return rounding(*args, **kwargs) if cuda_matmul_allows_tf32() else op(*args, **kwargs)

    return kernel


class Float32Precision:
    """Which families run in TF32 on sim. matmul follows CUDA's switch (its kernels, installed once, read it at
    each call); switching conv installs or removes its kernels."""

    def __init__(self) -> None:
        self._on: set[str] = set()
        self._lock = threading.Lock()
        self._follows_cuda = False

    def follow_cuda_matmul_switch(self) -> None:
        """Install the matmul kernels that read ``torch.backends.cuda.matmul.allow_tf32`` (idempotent)."""
        with self._lock:
            if not self._follows_cuda:
                KERNELS.update((op, _cuda_switched_kernel(op, names)) for op, names in _overloads("matmul"))
                self._follows_cuda = True

    def enabled(self, family: str) -> bool:
        return cuda_matmul_allows_tf32() if family == "matmul" else family in self._on

    def set(self, family: str, on: bool) -> None:
        if family not in FAMILIES:
            raise ValueError(f"sim: unknown op family {family!r}; expected one of {', '.join(FAMILIES)}")
        if family == "matmul":
            # the legacy setter keeps the legacy and new APIs' states in step (the new one's setter does not)
            torch.backends.cuda.matmul.allow_tf32 = on
            return
        with self._lock:
            if on == (family in self._on):
                return
            for op, names in _overloads(family):
                if on:
                    KERNELS[op] = _rounding_kernel(op, names)
                else:
                    KERNELS.pop(op, None)
            (self._on.add if on else self._on.discard)(family)

    def reduced(self) -> dict[str, str]:
        return {family: "tf32" for family in FAMILIES if self.enabled(family)}


PRECISION = Float32Precision()


class FamilySwitch:
    """``torch.sim.matmul`` / ``torch.sim.conv``: ``allow_tf32`` as on ``torch.backends.cuda.matmul`` (the matmul
    one is ``torch.backends.cuda.matmul.allow_tf32`` itself)."""

    def __init__(self, family: str) -> None:
        self._family = family

    @property
    def allow_tf32(self) -> bool:
        return PRECISION.enabled(self._family)

    @allow_tf32.setter
    def allow_tf32(self, on: bool) -> None:
        PRECISION.set(self._family, bool(on))

    def __repr__(self) -> str:
        return f"<torch.sim.{self._family}: allow_tf32={self.allow_tf32}>"


def float32_reduced_precision() -> dict[str, str]:
    """Which float32 op families sim computes in a reduced internal precision now, and in which.

    ``{"matmul": "tf32", "conv": "tf32"}`` with both TF32 switches on, ``{}`` with none. Tools ask
    ``getattr(torch, device.type).float32_reduced_precision()`` to know a device's declared math.
    """
    return PRECISION.reduced()


def parse_families(text: str) -> frozenset:
    """``DITORCH_SIM_TF32``'s value as the set of families it turns on; ValueError if malformed."""
    text = text.strip()
    if text in ("", "0"):
        return frozenset()
    if text == "1":
        return frozenset(FAMILIES)
    families = [part.strip() for part in text.split(",")]
    if not all(family in FAMILIES for family in families):
        raise ValueError(f"{ENV_VAR}={text!r}: expected {FORM}")
    return frozenset(families)


def configure(families: frozenset) -> None:
    """What ``register()`` does with ``DITORCH_SIM_TF32``: matmuls follow CUDA's switch from now on, turned on if
    ``families`` has matmul (else left as the script set it); conv on exactly if ``families`` has it."""
    PRECISION.follow_cuda_matmul_switch()
    if "matmul" in families:
        PRECISION.set("matmul", True)
    PRECISION.set("conv", "conv" in families)
