"""``--setup`` modules for the conformance tests: the sim device, plus the misbehaviour a test needs.

Each function is named on the command line (``--setup conformance_setups:sim_with_killing_neg``) and
runs first in every process of the sweep, before op_db is imported: what they change is what the
OpInfos see.
"""

import os
import signal
import sys

import torch


def sim_with_killing_neg():
    """sim, where ``torch.neg`` on a device tensor kills its own process: a vendor kernel that crashes."""
    import ditorch.sim

    ditorch.sim.register()
    original = torch.neg

    def neg(x, *args, **kwargs):
        if x.device.type != "cpu":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(x, *args, **kwargs)

    torch.neg = neg  # op_db, imported after this, takes torch.neg as the OpInfo's function


def add_random_opinfo():
    """One more OpInfo, ``conformance_test_noise`` (first in op_db), whose output is random but which no table
    names."""
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.opinfo.core import OpInfo, SampleInput

    def samples(op, device, dtype, requires_grad, **kwargs):
        yield SampleInput(torch.randn(4, 3, device=device, dtype=dtype, requires_grad=requires_grad))

    if not any(op.name == "conformance_test_noise" for op in op_db):
        op_db.insert(0, OpInfo("conformance_test_noise", op=lambda x: x + torch.rand_like(x), dtypes=(torch.float32,),
                            sample_inputs_func=samples, supports_autograd=True))


def hide_expecttest():
    """The process behaves as if the ``expecttest`` package were not installed."""
    sys.modules["expecttest"] = None
