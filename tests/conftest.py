import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def sim():
    """The simulated accelerator, registered once per test process; yields its device name."""
    import ditorch.sim

    ditorch.sim.register()
    return "sim"


@pytest.fixture(autouse=True)
def _no_leftover_faults():
    yield
    if "ditorch.sim" in sys.modules:
        sys.modules["ditorch.sim"].clear_faults()
