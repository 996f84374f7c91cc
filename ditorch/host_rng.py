"""The random-number API of a device that draws from the CPU's default generator (sim, the host).

Such a device and the CPU see one random stream, so a run on it draws what the same run on the CPU
draws. Device modules re-export these under the ``torch.cuda`` names.
"""

from __future__ import annotations

import torch


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
    torch.default_generator.set_state(state)


def set_rng_state_all(states) -> None:
    for state in states:
        set_rng_state(state)
