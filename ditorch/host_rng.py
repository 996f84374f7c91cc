"""The random-number API of a device that draws from the CPU's default generator (sim, the host).

Such a device and the CPU see one random stream, so a run on it draws what the same run on the CPU
draws. Device modules re-export these under the ``torch.cuda`` names.

``get_rng_state`` returns the CPU generator's state (5,056 bytes); ``set_rng_state`` takes that, or a state in
CUDA's Philox layout (16 bytes: a uint64 seed, then an int64 offset), which DTensor's random ops set and a CUDA
checkpoint holds. A Philox state ``(seed, offset)`` reseeds the CPU generator with a seed made of both, so equal
states draw equal numbers and distinct offsets unrelated ones; ``philox_state`` reads the stream back in that
layout for DTensor's RNG tracker (``torch/distributed/tensor/_random.py``), which moves offsets to give replicas
the same numbers and shards their own.

>>> import torch
>>> set_rng_state(philox_state())            # where the stream stands, in DTensor's layout
>>> a = torch.randn(2)
>>> set_rng_state(philox_state()); a.equal(torch.randn(2))
False
"""

from __future__ import annotations

import dataclasses

import torch

PHILOX_STATE_BYTES = 16  # CUDA's generator state: seed (uint64), offset (int64)
_MASK = (1 << 64) - 1


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()


seed_all = seed


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    if state.numel() == PHILOX_STATE_BYTES:
        seed, offset = state.to("cpu").contiguous().view(torch.int64).tolist()
        _PHILOX.reseed(seed & _MASK, offset)
    else:
        torch.default_generator.set_state(state)


def set_rng_state_all(states) -> None:
    for state in states:
        set_rng_state(state)


def philox_state() -> torch.Tensor:
    """The CPU generator's stream as a Philox state ``(seed, offset)``, as DTensor reads a CUDA generator's: the
    state last set, one offset on where the stream has been drawn from since; ``(initial seed, 0)`` after a
    ``manual_seed`` or a CPU-layout ``set_rng_state``."""
    return _PHILOX.state()


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def _to_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclasses.dataclass
class _PhiloxPosition:
    """The Philox state last set, and what it made of the CPU generator (to know whether it is still there)."""

    seed: int = 0
    offset: int = 0
    host_seed: int | None = None  # the CPU generator's seed it set; None until one is set
    host_state: torch.Tensor | None = None  # the CPU generator's state just after

    def reseed(self, seed: int, offset: int) -> None:
        # Both through splitmix64: mt19937 keeps 32 bits of its seed, so neighbouring offsets must differ there.
        host_seed = _splitmix64(seed ^ _splitmix64(offset))
        torch.default_generator.manual_seed(host_seed)
        self.seed, self.offset, self.host_seed = seed, offset, host_seed
        self.host_state = torch.default_generator.get_state()

    def state(self) -> torch.Tensor:
        generator = torch.default_generator
        if self.host_state is None or generator.initial_seed() != self.host_seed:
            seed, offset = generator.initial_seed(), 0  # seeded since: a fresh stream, as manual_seed makes on CUDA
        else:
            seed, offset = self.seed, self.offset
            if not torch.equal(generator.get_state(), self.host_state):
                offset += 4  # drawn from since: DTensor's next draw must not repeat those numbers
        return torch.tensor([_to_signed(seed), offset], dtype=torch.int64).view(torch.uint8)


_PHILOX = _PhiloxPosition()
