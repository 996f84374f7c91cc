"""Calls that draw random numbers: known by name, by their arguments, or caught by a generator's state moving.

A rerun of such a call on the CPU draws other numbers (another generator, another stream): comparing the two
says nothing, and the rerun would consume the user's random stream. OpAutoCompare never reruns them; it
counts them as not comparable. A random call written in Python out of torch calls (``COMPOSITES``: attention with
dropout) is run with those calls handled one by one, so the ones that draw nothing are compared; a random call
that is one op with more inside (``scaled_dot_product_attention`` with ``dropout_p``) says so in its reason.

>>> random_reason("torch.nn.functional.dropout", (x,), {"p": 0.1, "training": True})
'random'
>>> random_reason("torch.nn.functional.dropout", (x,), {"p": 0.1, "training": False}) is None   # the identity
True
"""

from __future__ import annotations

import functools
import re

import torch

# Ops whose results are random draws whatever their arguments.
_RANDOM_NAMES = re.compile(r"^(rand|randn|randint|rand_like|randn_like|randint_like|randperm|bernoulli_?|normal_?|"
                           r"uniform_?|random_?|exponential_|geometric_|cauchy_|log_normal_|multinomial|poisson|"
                           r"gumbel_softmax|_sample_dirichlet|_standard_gamma|binomial)$")
# Ops that draw only for some arguments: (position, keyword, default) of the probability, and of the training flag
# (None: always training). A call draws when the probability is above 0 and it trains.
_DRAW_WHEN = {
    "dropout": ((1, "p", 0.5), (2, "training", True)),
    "dropout1d": ((1, "p", 0.5), (2, "training", True)),
    "dropout2d": ((1, "p", 0.5), (2, "training", True)),
    "dropout3d": ((1, "p", 0.5), (2, "training", True)),
    "alpha_dropout": ((1, "p", 0.5), (2, "training", False)),
    "feature_alpha_dropout": ((1, "p", 0.5), (2, "training", False)),
    "native_dropout": ((1, "p", None), (2, "train", True)),
    "feature_dropout": ((1, "p", None), (2, "train", True)),
    "scaled_dot_product_attention": ((4, "dropout_p", 0.0), None),
    "_scaled_dot_product_attention_math": ((4, "dropout_p", 0.0), None),
    "multi_head_attention_forward": ((10, "dropout_p", None), (13, "training", True)),
    "rrelu": ((None, None, 1.0), (3, "training", False)),
    "rrelu_": ((None, None, 1.0), (3, "training", False)),
}
# Random calls written in Python out of torch calls: OpAutoCompare runs them with the calls they make handled one by
# one, so those that draw nothing (the softmax beside attention's dropout) are compared.
COMPOSITES = frozenset({"torch.nn.functional.multi_head_attention_forward", "torch.nn.functional.gumbel_softmax"})
# Random calls that are one op with more than the draw inside (no Python calls to descend into): the skip reason says
# what goes uncompared.
_ONE_OP = dict.fromkeys(("scaled_dot_product_attention", "_scaled_dot_product_attention_math"),
                        "random (attention with dropout, one op: nothing inside compared)")
_TORCH_DROPOUT = {"torch.dropout", "torch.dropout_", "torch.feature_dropout", "torch.feature_dropout_",
                  "torch.alpha_dropout", "torch.alpha_dropout_", "torch.feature_alpha_dropout",
                  "torch.feature_alpha_dropout_"}  # (input, p, train): train is positional and required


@functools.lru_cache(maxsize=4096)
def _by_name(name: str) -> str | None:
    short = name.rsplit(".", 1)[-1]
    if name.startswith("torch.nn.init.") or _RANDOM_NAMES.match(short):
        return "always"
    if name in _TORCH_DROPOUT:
        return "torch.dropout"
    if short.removesuffix("_") in _DRAW_WHEN or short in _DRAW_WHEN:
        return "depends"
    return None


def random_reason(name: str, args: tuple, kwargs: dict) -> str | None:
    """``'random'`` when this call draws random numbers (by its name, or its probability and training arguments)."""
    kind = _by_name(name)
    if kind is None:
        return None
    if kind == "always":
        return "random"
    if kind == "torch.dropout":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.0)
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        return "random" if train and _positive(p) else None
    short = name.rsplit(".", 1)[-1]
    probability, training = _DRAW_WHEN.get(short) or _DRAW_WHEN[short.removesuffix("_")]
    if training is not None and not _value(args, kwargs, training):
        return None
    if probability[0] is None:
        return "random"
    return "random" if _positive(_value(args, kwargs, probability)) else None


def skip_text(name: str) -> str:
    """The skip reason of a random call that is not run as a composite: ``'random'``, or what its one op hides."""
    return _ONE_OP.get(name.rsplit(".", 1)[-1], "random")


def _value(args: tuple, kwargs: dict, where):
    position, keyword, default = where
    return args[position] if position < len(args) else kwargs.get(keyword, default)


def _positive(p) -> bool:
    try:
        return p is None or float(p) > 0
    except (TypeError, ValueError):
        return True  # a tensor probability or something unexpected: assume it draws


class GeneratorProbe:
    """A cheap token of a device's default generator: compare two to know whether a call drew random numbers.

    CUDA-like generators expose their Philox offset (no synchronisation); others their state bytes (the sim
    device's generator is the CPU's: 5 KB, about a microsecond).
    """

    def __init__(self, device: torch.device) -> None:
        self._read = _reader(device)

    def token(self):
        return self._read() if self._read is not None else None


def _reader(device: torch.device):
    generator: torch.Generator | None
    if device.type == "cpu":
        generator = torch.default_generator
    else:
        module = getattr(torch, device.type, None)
        generators = getattr(module, "default_generators", None)
        index = device.index if device.index is not None else _current(module)
        generator = generators[index] if generators is not None and index is not None and index < len(generators) \
            else None
        if generator is None:
            get_state = getattr(module, "get_rng_state", None)
            if not callable(get_state):
                return None
            return lambda: bytes(get_state().numpy())
    try:
        generator.get_offset()
    except (RuntimeError, AttributeError):
        return lambda: bytes(generator.get_state().numpy())
    return generator.get_offset


def _current(module) -> int | None:
    current = getattr(module, "current_device", None)
    try:
        return current() if callable(current) else 0
    except Exception:  # noqa: BLE001 - a device module that cannot answer: use its first generator
        return 0


def cpu_generator_token() -> bytes:
    """The CPU default generator's state: the CPU reference must leave it as it found it."""
    return bytes(torch.default_generator.get_state().numpy())
