import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# CI runs the state machines hard (>= 2000 examples each); local runs stay quick.
settings.register_profile("ci", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

os.environ.setdefault("TWINSERVE_SIM_CHECK", "1")   # sim self-checks event skipping in tests


@pytest.fixture(scope="module")
def one_torch_thread():
    """The machines' 2 cores are shared: with 2 intra-op threads every small op waits on a
    descheduled sibling thread (several times slower). Model tests run on one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
