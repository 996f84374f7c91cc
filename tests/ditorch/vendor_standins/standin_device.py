"""Shared by the stand-in vendor packages: rename PrivateUse1 and register a small device module."""

import types

import torch


def register(name: str, extra: dict | None = None) -> types.ModuleType:
    module = types.ModuleType(f"torch.{name}")
    state = {"device": 0, "stream": None}
    module.is_available = lambda: True
    module.device_count = lambda: 2
    module.current_device = lambda: state["device"]
    module.set_device = lambda device: state.update(device=torch.device(device).index or 0
                                                    if not isinstance(device, int) else device)
    module.synchronize = lambda device=None: None
    module.set_stream = lambda stream: state.update(stream=stream)
    module.current_stream = lambda device=None: state["stream"]
    module._lazy_init = lambda: None
    module._is_in_bad_fork = lambda: False
    module.is_initialized = lambda: True
    module.manual_seed_all = lambda seed: None
    module.state = state
    for key, value in (extra or {}).items():
        setattr(module, key, value)
    torch.utils.rename_privateuse1_backend(name)
    torch._register_device_module(name, module)
    return module
