"""Shared test set-up. TRITON_INTERPRET must be set before any kernel module is imported (DESIGN §11.7)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads of two torch processes
# made small CPU runs 10-20x slower (measured); must be set before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from vat.eval.benchmarks import SPEC_BENCH_FILE  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_BENCH = SPEC_BENCH_FILE  # packaged with vat: present in every clone and install, so no test skips for it


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def spec_bench_file() -> str:
    """The Spec-Bench question file packaged with vat (ignores ``$VAT_SPEC_BENCH``: tests count its 480 rows)."""
    return SPEC_BENCH


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): reproducible fp32 reduction order, and no contention with
    another torch process on a 2-core machine. A module opts in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
