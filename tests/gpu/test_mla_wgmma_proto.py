"""GPU check of benchmarks/mla_wgmma_proto.py (marked gpu; skipped without CUDA or the CuTe DSL):
the wgmma MLA partial prototype (S = Q K^T and P V from one 128-byte-swizzled stage) against
torch in fp32, over several stages, a partial last stage (rows masked) and one stage (stop 34
ran its check through benchmarks/h200_session.sh wgmma: o within 9.5e-4)."""
import os
import sys

import pytest

pytestmark = pytest.mark.gpu
from _needs_cute import torch  # noqa: E402  (skips this module without CUDA or the CuTe DSL)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import mla_wgmma_proto as proto  # noqa: E402


@pytest.fixture(scope="module")
def launcher():
    return proto.build()


@pytest.mark.parametrize("rows,ctas", [(512, 4), (100, 3), (32, 2)])
def test_wgmma_mla_partial_matches_torch(launcher, rows, ctas):
    err_o, err_m, err_l, run = proto.run_case(launcher, rows, ctas, seed=rows)
    assert proto.close_enough(err_o, err_m, err_l), (err_o, err_m, err_l)
    run()                                           # a second launch over the same buffers
    torch.cuda.synchronize()
