import pytest
import torch

import op_tools
from op_tools.config.variables import VARIABLES, OpFilter


def test_every_variable_is_declared_with_form_default_and_meaning():
    for prefix in ("OP_CAPTURE", "OP_OBSERVE", "OP_OVERFLOW_CHECK", "OP_FALLBACK", "OP_DTYPE_CAST"):
        assert f"{prefix}_LIST" in VARIABLES and f"{prefix}_DISABLE_LIST" in VARIABLES
    for name in ("OP_TOOLS_RESULTS_DIR", "OP_TOOLS_VERBOSE", "OP_TOOLS_PRINT_STACK", "OP_CAPTURE_MODE",
                 "OP_OVERFLOW_CHECK_RAISE", "OP_DTYPE_CAST_DICT"):
        var = VARIABLES[name]
        assert var.form and var.meaning


def test_lists_match_exact_names_and_whole_name_regexes(monkeypatch):
    monkeypatch.setenv("OP_OBSERVE_LIST", "torch.add,torch.nn.functional.*")
    monkeypatch.setenv("OP_OBSERVE_DISABLE_LIST", "torch.nn.functional.silu")
    f = OpFilter.from_env("OP_OBSERVE")
    assert f.allows("torch.add") and f.allows("torch.nn.functional.linear")
    assert not f.allows("torch.nn.functional.silu")  # DISABLE wins
    assert not f.allows("torch.addmm")  # a regex must match the whole name
    monkeypatch.setenv("OP_OBSERVE_LIST", "")
    assert not OpFilter.from_env("OP_OBSERVE").allows("torch.add")  # empty: none
    monkeypatch.delenv("OP_OBSERVE_LIST")
    monkeypatch.delenv("OP_OBSERVE_DISABLE_LIST")
    assert OpFilter.from_env("OP_OBSERVE").allows("torch.anything")  # unset: all


@pytest.mark.parametrize(("name", "value", "tool"), [
    ("OP_CAPTURE_LIST", "torch.add,(", op_tools.OpCapture),
    ("OP_FALLBACK_DISABLE_LIST", "[a-", op_tools.OpFallback),
    ("OP_DTYPE_CAST_DICT", "torch.float16->torch.flot32", op_tools.OpDtypeCast),
    ("OP_DTYPE_CAST_DICT", "torch.float16", op_tools.OpDtypeCast),
    ("OP_DTYPE_CAST_DICT", "torch.float16->torch.int8", op_tools.OpDtypeCast),  # would truncate the inputs
    ("OP_DTYPE_CAST_DICT", "torch.bfloat16->torch.float32,torch.float16->torch.bool", op_tools.OpDtypeCast),
    # two targets for one dtype: the last one silently won
    ("OP_DTYPE_CAST_DICT", "torch.float16->torch.float64,torch.half->torch.float32", op_tools.OpDtypeCast),
    ("LINEAR_OP_DTYPE_CAST_DICT", "torch.float32->torch.float16", op_tools.OpAutoCompare),
    ("OP_CAPTURE_MODE", "everything", op_tools.OpCapture),
    ("OP_OVERFLOW_CHECK_RAISE", "maybe", op_tools.OpOverflowCheck),
])
def test_malformed_variable_is_a_value_error_naming_it(monkeypatch, name, value, tool):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name) as info:
        tool().start()
    assert repr(value) in str(info.value) and "expected" in str(info.value)
    assert not torch.overrides._get_current_function_mode_stack()  # nothing left started


@pytest.mark.parametrize("casts", [{torch.float16: torch.int8}, {"float16": "bool"}, {torch.float32: torch.complex64},
                                   "torch.float16->torch.uint8"])
def test_a_cast_that_is_not_to_a_floating_dtype_is_refused(casts):
    with pytest.raises(ValueError, match=r"casts=.*'torch\.\w+->torch\.\w+'"):
        op_tools.OpDtypeCast(casts=casts)


@pytest.mark.parametrize("table", ["torch.float32->torch.float16", "torch.half->torch.bfloat16"])
def test_the_original_ditorchs_narrowing_casts_are_taken_and_said(sim, monkeypatch, caplog, table):
    # The original's own examples of OP_DTYPE_CAST_DICT narrow: a script setting them must run as it did there,
    # the ops computed in the narrower dtype, their results cast back to the caller's.
    monkeypatch.setenv("OP_DTYPE_CAST_DICT", table)
    source, target = (getattr(torch, name.removeprefix("torch.")) for name in table.split("->"))
    x, w = torch.randn(4, 8, device=sim).to(source), torch.randn(3, 8, device=sim).to(source)
    with caplog.at_level("WARNING", logger="op_tools"), op_tools.OpDtypeCast():
        y = torch.nn.functional.linear(x, w)
    assert y.dtype == source and torch.equal(y, torch.nn.functional.linear(x.to(target), w.to(target)).to(source))
    assert f"{table.replace('half', 'float16')} narrows" in caplog.text


def test_casts_to_wider_floating_dtypes_are_accepted():
    with op_tools.OpDtypeCast(casts="torch.half->torch.double,torch.float32->torch.float32,"
                                    "torch.complex32->torch.complex64,torch.float8_e4m3fn->torch.float16") as tool:
        pass
    assert tool.cast == {torch.float16: torch.float64, torch.float32: torch.float32,
                         torch.complex32: torch.complex64, torch.float8_e4m3fn: torch.float16}


def test_lists_select_exactly_the_named_ops_in_a_fresh_process(run_script):
    code = """
    x = torch.ones(2, 3, device="sim")
    with op_tools.OpObserve():
        torch.add(x, 1); x.mul(2); torch.nn.functional.relu(x); torch.nn.functional.silu(x)
    """
    env = {"OP_OBSERVE_LIST": "torch.add,torch.nn.functional.*", "OP_OBSERVE_DISABLE_LIST": ".*silu",
           "OP_TOOLS_VERBOSE": "1"}
    result = run_script(code, env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "apply OpObserveHook on torch.add" in out
    assert "apply OpObserveHook on torch.nn.functional.relu" in out
    assert "skip OpObserveHook on torch.Tensor.mul" in out
    assert "skip OpObserveHook on torch.nn.functional.silu" in out
    assert "torch.add    forward_id:" in out and "torch.Tensor.mul    forward_id:" not in out


@pytest.mark.parametrize(("value", "on"), [("2", True), ("10", True), ("00", False), ("0", False)])
def test_a_flag_given_as_a_number_is_on_when_positive_as_the_original_read_it(monkeypatch, value, on):
    # the original ditorch read its flags as int(value) > 0: a script's OP_TOOLS_PRINT_STACK=2 meant on
    monkeypatch.setenv("OP_TOOLS_PRINT_STACK", value)
    with op_tools.OpObserve() as tool:
        pass
    assert tool.common.print_stack is on


def test_a_variable_changed_after_the_tool_read_it_is_said_at_its_end(sim, monkeypatch, caplog, tmp_path):
    # The original ditorch read its variables at each call (its README sets OP_DTYPE_CAST_DICT after apply_feature);
    # ours reads them once: a change while the tool ran was silently not taken
    monkeypatch.delenv("OP_DTYPE_CAST_DICT", raising=False)
    monkeypatch.setenv("OP_CAPTURE_DISABLE_LIST", "torch.Tensor.add")
    x = torch.randn(4, device=sim)
    with caplog.at_level("WARNING", logger="op_tools"):
        with op_tools.OpCapture(results_dir=str(tmp_path)) as capture:
            monkeypatch.setenv("OP_CAPTURE_DISABLE_LIST", "torch.Tensor.mul")
            monkeypatch.setenv("OP_DTYPE_CAST_DICT", "torch.float32->torch.float16")  # not OpCapture's
            x * 2
        assert capture.handled["torch.Tensor.mul"] == 1  # as read at start()
        assert "OpCapture: OP_CAPTURE_DISABLE_LIST changed while the tool ran ('torch.Tensor.add' when it started, " \
               "'torch.Tensor.mul' now)" in caplog.text.replace("\n  ", " ")
        assert "OP_DTYPE_CAST_DICT" not in caplog.text
        caplog.clear()
        with op_tools.OpCapture(results_dir=str(tmp_path)):
            x * 2
        assert "changed while the tool ran" not in caplog.text


def test_max_cache_size_0_appends_each_row_as_the_original_did(monkeypatch):
    # the original's OP_TOOLS_MAX_CACHE_SIZE=0 wrote each row as it came; 0 was refused as malformed
    from op_tools.config.variables import MAX_CACHE_SIZE

    monkeypatch.setenv("OP_TOOLS_MAX_CACHE_SIZE", "0")
    assert MAX_CACHE_SIZE.read() == 0  # more than 0 rows held: each is written as it comes
    monkeypatch.setenv("OP_TOOLS_MAX_CACHE_SIZE", "-1")
    with pytest.raises(ValueError, match="OP_TOOLS_MAX_CACHE_SIZE='-1'"):
        MAX_CACHE_SIZE.read()
