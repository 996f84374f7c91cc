"""TrainingMonitor's configuration: its keyword arguments, ``OP_TRAINING_MONITOR_*`` and the config file's
``[monitor]`` section, parsed once into one typed, frozen ``TrainingMonitorConfig``.

The monitor handles no op, so it is no ``OpTool``; its settings still go the way every tool's go (``settings.py``):
each keyword stands for one variable and is parsed by that variable's parser, and arguments win over variables,
variables over the config file, the file over the defaults.

>>> config = TrainingMonitorConfig.resolve(every=2, parameters=[r"model\\.layers\\.0\\."])
>>> config.every, config.activations
(2, 'blocks')
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

from .settings import file_values, validate_arguments
from .tool_registry import non_op_tool
from .variables import (
    TRAINING_MONITOR_ACTIVATIONS,
    TRAINING_MONITOR_EVERY,
    TRAINING_MONITOR_HTML,
    TRAINING_MONITOR_MOMENTS,
    TRAINING_MONITOR_PARAMETERS,
    TRAINING_MONITOR_REPLICAS,
    TRAINING_MONITOR_SCALE_DROPS,
    TRAINING_MONITOR_SPIKE_FACTOR,
    TRAINING_MONITOR_STATE_EVERY,
    TRAINING_MONITOR_TENSORBOARD,
    TRAINING_MONITOR_UPDATE_RATIO,
    TRAINING_MONITOR_WARMUP,
    CommonConfig,
    EnvVar,
    Sources,
)


@non_op_tool("monitor")
@dataclasses.dataclass(frozen=True)
class TrainingMonitorConfig:
    """What ``TrainingMonitor`` reads, once: each field from its keyword argument, its variable (``keywords``), the
    config file's ``[monitor]`` key or its default."""

    tool_name: ClassVar[str] = "TrainingMonitor"  # in messages: TrainingMonitor(every=0): ...
    env_prefix: ClassVar[str] = ""  # no op lists
    keywords: ClassVar[dict[str, EnvVar]] = {
        "every": TRAINING_MONITOR_EVERY, "state_every": TRAINING_MONITOR_STATE_EVERY,
        "parameters": TRAINING_MONITOR_PARAMETERS,
        "activations": TRAINING_MONITOR_ACTIVATIONS, "spike_factor": TRAINING_MONITOR_SPIKE_FACTOR,
        "warmup": TRAINING_MONITOR_WARMUP, "tensorboard": TRAINING_MONITOR_TENSORBOARD,
        "update_ratio": TRAINING_MONITOR_UPDATE_RATIO, "moments": TRAINING_MONITOR_MOMENTS,
        "scale_drops": TRAINING_MONITOR_SCALE_DROPS, "replicas": TRAINING_MONITOR_REPLICAS,
        "html": TRAINING_MONITOR_HTML,
    }

    every: int  # record every N-th optimizer step, from step 0
    state_every: int  # weights, update ratios and moments every N-th monitored step (a pass over every weight each)
    parameters: tuple[re.Pattern, ...] | None  # matched at the start of parameter names; None: every parameter
    activations: str | tuple[re.Pattern, ...]  # variables.BLOCKS, or patterns matching whole module names; (): none
    spike_factor: float  # > 1
    warmup: int
    tensorboard: bool | None  # None: when tensorboard is installed
    update_ratio: bool
    moments: bool  # the norms of Adam's exp_avg and exp_avg_sq
    scale_drops: int
    replicas: bool  # the replica_mismatch rule under data parallel
    html: bool  # the HTML page at stop()
    common: CommonConfig  # results_dir, verbose, … (the keywords every tool shares), and torchrun's rank

    @classmethod
    def from_env(cls, sources: Sources | None = None) -> TrainingMonitorConfig:
        """The variables (ValueError naming the variable, its value and the expected form), under ``sources``."""
        read = {field: var.read(sources) for field, var in cls.keywords.items()}
        return cls(**read, common=CommonConfig.from_env(sources))

    @classmethod
    def resolve(cls, **arguments: Any) -> TrainingMonitorConfig:
        """The configuration of ``TrainingMonitor(**arguments)``: each argument that is not ``None`` over its
        variable, the variable over the config file, the file over the default. Arguments take a Python value
        (``every=2``, ``parameters=["lm_head"]``, ``tensorboard=False``) or the variable's text (``every="2"``);
        a malformed one is a ValueError (TypeError for a value of the wrong type) naming ``TrainingMonitor(every=0)``,
        the value and the expected form; an unknown keyword a TypeError with the closest one."""
        return cls.from_env(Sources(validate_arguments(cls, arguments), file_values(cls)))
