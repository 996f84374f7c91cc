import gc
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

# Set in the child interpreter a `gpu` test runs in (see pytest_pyfunc_call).
GPU_CHILD = "DITORCH_TESTS_GPU_CHILD"
# The sources the suite's Python children import: compiled once per session (see pytest_configure).
COMPILED = ("ditorch", "op_tools", "tests", "benchmarks")


def pytest_configure(config):
    """Write the bytecode of the project's sources once, in the controller, before any test runs.

    The suite starts some 500 Python children, each importing ditorch and op_tools (and the tests' helpers). Where
    ``PYTHONDONTWRITEBYTECODE`` is set (CI's image sets it), no child writes a ``.pyc``, so every child compiled
    the same sources again: 0.15-0.2 s of CPU each. ``compileall`` writes them whatever that variable says, and
    every interpreter still reads them (a source newer than its ``.pyc`` is recompiled as usual). ``__pycache__``
    is ignored by git.
    """
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller compiled them
        return
    import compileall

    for folder in COMPILED:
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=2)


def pytest_collection_modifyitems(config, items):
    from hardware import cuda_gpu_present

    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not cuda_gpu_present():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


# What `import ditorch.sim` raises on a torch without the Python PrivateUse1 hooks (before 2.10).
SIM_NEEDS = "ditorch.sim needs PyTorch >= 2.10"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a torch older than sim needs, a test that failed only because it (or a child it ran) could not import
    sim is skipped, saying so: the rest of the suite is then a check of that torch (docs/device_layer.md)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and SIM_NEEDS in str(report.longrepr):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"needs the sim device: {SIM_NEEDS}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a test module that imports sim: skipped whole, saying so."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and SIM_NEEDS in str(report.longrepr):
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"needs the sim device: {SIM_NEEDS}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run each `gpu` test in its own interpreter.

    The suite registers the sim device in this process, and once any PrivateUse1 backend is registered
    PyTorch takes it as the process's accelerator (``at::getAccelerator()``), so every CUDA backward in
    this process would trip the autograd engine's stream assert (pytorch/pytorch#161129). A fresh
    interpreter keeps CUDA the accelerator, whatever ran before the test.
    """
    if not pyfuncitem.get_closest_marker("gpu") or os.environ.get(GPU_CHILD):
        return None
    from subprocess_env import child_env

    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", pyfuncitem.nodeid]
    done = subprocess.run(command, cwd=str(pyfuncitem.config.rootpath), env=child_env({GPU_CHILD: "1"}),
                          capture_output=True, text=True, timeout=900)
    output = done.stdout[-6000:] + done.stderr[-3000:]
    if done.returncode != 0:
        pytest.fail(f"in its own interpreter, {pyfuncitem.nodeid} failed:\n{output}", pytrace=False)
    skipped = re.search(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", done.stdout, re.M)
    if skipped:
        pytest.skip(skipped.group(1))
    return True


@pytest.fixture(scope="session", autouse=True)
def _forked_python():
    """Python children forked from a server that has imported torch (``tests/forked_python.py``), unless
    ``TESTS_FORKED_PYTHON=0``; for the whole session, so that a module's shared launches are forked too."""
    if os.environ.get("TESTS_FORKED_PYTHON") == "0":
        yield
        return
    import forked_python

    subprocess.Popen = forked_python.RoutingPopen  # subprocess.run and check_output start children through it
    yield
    subprocess.Popen = forked_python._REAL_POPEN


@pytest.fixture(scope="module", autouse=True)
def _collector_frozen():
    """What is alive when a module starts (pytest, torch, transformers, earlier modules' fixtures) taken out of the
    garbage collector's scans, after one collection (so no garbage is kept): a full collection of a test process's
    heap took 0.3 s or more, the tests' own objects are still collected, and refcounting frees frozen ones."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="module", autouse=True)
def _children_import(request):
    """A module marked ``children_import(name)`` forks its children from a server that has imported that
    (``forked_python.CHILDREN_IMPORT``) too; module-scoped, so that the module's shared launches are forked from it
    as well."""
    import forked_python

    marker = request.node.get_closest_marker("children_import")
    forked_python.ALSO_IMPORTED = forked_python.CHILDREN_IMPORT[marker.args[0]] if marker else ()
    yield
    forked_python.ALSO_IMPORTED = ()


@pytest.fixture(autouse=True)
def _fresh_interpreter(request, monkeypatch):
    """A test marked ``fresh_interpreter`` starts its Python children as new interpreters."""
    if request.node.get_closest_marker("fresh_interpreter"):
        import forked_python

        monkeypatch.setattr(forked_python, "ENABLED", False)


@pytest.fixture(autouse=True)
def _no_tool_left_started():
    """A test that leaves a tool's mode on the stack is an error of its own, and the mode is taken off: left there,
    every later test of the worker ran under it (one test that never stopped its tool failed 25 others)."""
    yield
    import torch

    left = torch.overrides._get_current_function_mode_stack()
    if left:
        for _ in left:
            torch.overrides._pop_mode()
        names = [type(getattr(mode, "tool", mode)).__name__ for mode in left]
        pytest.fail(f"the test left modes on the torch function mode stack: {', '.join(names)}")


@pytest.fixture
def logged(caplog):
    """``logged()``: the messages ditorch and op_tools logged so far in this test, one per line block, in order
    (what their own handler prints on a console; under pytest, pytest's handlers take the records instead)."""
    return lambda: "\n".join(r.getMessage() for r in caplog.records)


@pytest.fixture(scope="session")
def sim():
    """The simulated accelerator, registered once per test process; yields its device name."""
    from hardware import sim_missing

    if sim_missing():
        pytest.skip(sim_missing())
    import ditorch.sim

    ditorch.sim.register()
    return "sim"


@pytest.fixture(autouse=True)
def _no_leftover_faults():
    yield
    if "ditorch.sim" in sys.modules:
        sys.modules["ditorch.sim"].clear_faults()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random inputs whichever tests ran before it (and in whichever worker)."""
    import torch

    torch.manual_seed(0)
