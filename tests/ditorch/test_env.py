"""The declared environment variables and their parsers."""

from __future__ import annotations

import dataclasses
import types

import pytest

from ditorch.env import VARIABLES, DeviceLayerConfig, read


def test_every_variable_is_declared_with_form_default_and_meaning():
    assert set(VARIABLES) == {"DITORCH_BACKEND", "DITORCH_QUIET", "DITORCH_DISABLE_MOCK",
                              "DITORCH_SHOW_DEVICE_AS_CUDA", "DITORCH_SIM_DEVICE_COUNT", "DITORCH_SIM_FAULTS",
                              "DITORCH_SIM_TF32", "DITORCH_SIM_NUMERICS", "DITORCH_SIM_SDPA",
                              "DITORCH_SIM_DEVICE_MEMORY", "DITORCH_SIM_TOTAL_MEMORY", "DITORCH_SIM_ASYNC",
                              "DITORCH_REDUCE_LOW_PRECISION_IN_FP32"}
    for var in VARIABLES.values():
        assert var.form and var.meaning
        read(var.name, {})  # the default parses


def test_defaults_match_the_original_contract():
    assert DeviceLayerConfig.from_env({}) == DeviceLayerConfig(
        backend=None, quiet=False, disable_mock=False, show_device_as_cuda=True)


def test_values_are_parsed_into_typed_config():
    config = DeviceLayerConfig.from_env({"DITORCH_BACKEND": "SIM", "DITORCH_QUIET": "1",
                                         "DITORCH_DISABLE_MOCK": "true", "DITORCH_SHOW_DEVICE_AS_CUDA": "0"})
    assert config == DeviceLayerConfig(backend="sim", quiet=True, disable_mock=True, show_device_as_cuda=False)
    assert read("DITORCH_SIM_DEVICE_COUNT", {"DITORCH_SIM_DEVICE_COUNT": "3"}) == 3


@pytest.mark.parametrize("name, value", [
    ("DITORCH_BACKEND", "tpu"), ("DITORCH_QUIET", "2"), ("DITORCH_DISABLE_MOCK", "y"),
    ("DITORCH_SHOW_DEVICE_AS_CUDA", "cuda"), ("DITORCH_SIM_DEVICE_COUNT", "two"), ("DITORCH_SIM_DEVICE_COUNT", "-1"),
])
def test_malformed_value_names_variable_value_and_form(name, value):
    with pytest.raises(ValueError) as error:
        read(name, {name: value})
    assert str(error.value) == f"{name}={value!r}: expected {VARIABLES[name].form}"


def test_forcing_an_uninstalled_vendor_backend_names_what_is_missing():
    from ditorch.backends import detect

    with pytest.raises(RuntimeError, match=r"DITORCH_BACKEND='npu': that backend needs the package torch_npu"):
        detect("npu")


def test_a_detected_vendor_that_refuses_to_import_beside_a_gpu_leaves_the_gpu_and_says_so(monkeypatch, caplog):
    # torch_npu >= 2.5 refuses to import under a CUDA build ("Two accelerators cannot be used at the same time"):
    # a GPU machine that merely had it installed failed `import ditorch`. MOCKED: no torch_npu, no GPU here.
    from ditorch import backends

    def refusing():
        raise RuntimeError("Two accelerators cannot be used at the same time")

    cuda = object()
    rows = tuple(dataclasses.replace(row, probe=(lambda: True) if row.name in ("npu", "cuda") else row.probe)
                 for row in backends.BACKENDS)
    monkeypatch.setattr(backends, "BACKENDS", rows)
    monkeypatch.setattr(backends, "adapter_module", lambda name: types.SimpleNamespace(
        load=refusing if name == "npu" else lambda: cuda))
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    with caplog.at_level("WARNING", logger="ditorch"):
        assert backends.detect() is cuda
    assert "torch_npu is installed but failed to import (RuntimeError: Two accelerators" in caplog.text
    assert "DITORCH_BACKEND=npu makes this an error" in caplog.text
    with pytest.raises(RuntimeError, match="Two accelerators"):  # forced, it is the user's to see
        backends.detect("npu")
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)  # no GPU: never the host in its place
    with pytest.raises(RuntimeError, match="Two accelerators"):
        backends.detect()


def test_sim_fault_specs_are_validated_with_the_variable_named():
    assert read("DITORCH_SIM_FAULTS", {}) == []
    with pytest.raises(ValueError, match=r"DITORCH_SIM_FAULTS='mm:explode'"):
        read("DITORCH_SIM_FAULTS", {"DITORCH_SIM_FAULTS": "mm:explode"})


def test_device_layer_doc_lists_every_variable_and_transfer_row():
    import os

    from ditorch.transfer import ROWS

    doc_path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "device_layer.md")
    with open(doc_path) as f:
        doc = f.read()
    assert [name for name in VARIABLES if f"`{name}`" not in doc] == []
    assert [row.owner for row in ROWS if f"`{row.owner}" not in doc] == []
