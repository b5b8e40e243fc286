import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_sessionstart(session):
    """Under DYNAMOE_REQUIRE_CPU_KERNELS (`make test`) the CPU kernels must load: a build failure stops
    the run here, once, with the compiler's output, instead of turning every kernel test into a skip."""
    from dynamoe.ops import cpu_kernels

    if not cpu_kernels.required():
        return
    try:
        module = cpu_kernels.load()
    except RuntimeError as exc:
        pytest.exit(str(exc), returncode=1)
    if module is None:
        pytest.exit(f"dynamoe: the CPU kernels did not load and {cpu_kernels.ENV_REQUIRE} is set", returncode=1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
