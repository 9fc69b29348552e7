"""Shared test set-up. TRITON_INTERPRET must be set before any kernel module is imported (docs/kernels.md)."""

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


@pytest.fixture(scope="module")
def train_workspace(tmp_path_factory):
    """A saved tiny OLMoE target and a prepared chat dataset built with its tokenizer (`vat train` tests)."""
    from helpers import write_reversed_chats
    from tiny_models import save_tiny_target

    from vat.data_prep.chat import prepare_chat

    root = tmp_path_factory.mktemp("train")
    target = save_tiny_target(root / "target", "olmoe", num_experts=8, top_k=2)
    chats = write_reversed_chats(root / "chats.jsonl", 48)
    prepare_chat(chats, target, str(root / "data"), max_length=256, progress=False)
    return {"target": target, "data": str(root / "data"), "root": root}


@pytest.fixture(scope="module")
def saved_target_and_draft(tmp_path_factory):
    """A saved tiny OLMoE target (with tokenizer) and a random EAGLE-3 draft saved by vat's checkpoint writer
    (`vat eval` tests): (root, target_dir, draft_dir)."""
    from tiny_models import save_tiny_target
    from transformers import AutoConfig

    from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from vat.export.checkpoint import save_draft

    root = tmp_path_factory.mktemp("eval")
    target_dir = save_tiny_target(str(root / "target"), "olmoe")
    config = AutoConfig.from_pretrained(target_dir)
    cfg = Eagle3Config.for_target(config, draft_vocab_size=config.vocab_size, target_path=target_dir)
    torch.manual_seed(0)
    draft_dir = save_draft(Eagle3Drafter(cfg), cfg, str(root / "run" / "final"))
    return root, target_dir, draft_dir
