"""``--setup`` modules for the conformance tests: the sim device, plus the misbehaviour a test needs.

Each function is named on the command line (``--setup conformance_setups:sim_with_killing_neg``) and
runs in every worker after op_db is imported and before its table of OpInfos is made.
"""

import os
import signal

import torch


def sim_with_killing_neg():
    """sim, where the ``neg`` OpInfo's function kills its own process on the device: a vendor kernel that crashes."""
    from torch.testing._internal.common_methods_invocations import op_db

    import ditorch.sim

    ditorch.sim.register()
    opinfo = next(op for op in op_db if op.name == "neg" and not op.variant_test_name)
    original = opinfo.op

    def neg(x, *args, **kwargs):
        if x.device.type != "cpu":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(x, *args, **kwargs)

    opinfo.op = neg


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


def sim_gone_after_neg():
    """sim, where the ``neg`` OpInfo's function kills its own process on the device, and leaves the device gone: a
    worker started after it cannot set up (the file named by ``CONFORMANCE_TEST_GONE`` marks it)."""
    marker = os.environ["CONFORMANCE_TEST_GONE"]
    if os.path.exists(marker):
        raise RuntimeError("the device is gone")
    sim_with_killing_neg()
    from torch.testing._internal.common_methods_invocations import op_db

    opinfo = next(op for op in op_db if op.name == "neg" and not op.variant_test_name)
    killing = opinfo.op

    def neg(x, *args, **kwargs):
        if x.device.type != "cpu":
            open(marker, "w").close()
        return killing(x, *args, **kwargs)

    opinfo.op = neg
