"""The GPU validation script's CPU-runnable parts (scripts/gpu_check.sh, benchmarks/moe_kernel.py,
benchmarks/kernel_parity.py) at tiny shapes through the Triton interpreter, so CI runs the code a GPU run will."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import kernel_parity  # noqa: E402
import moe_kernel  # noqa: E402


@pytest.mark.parametrize(
    "name,peak",
    [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
     ("NVIDIA A100-SXM4-80GB", 2000.0), ("Tesla T4", None)],
)  # fmt: skip
def test_peak_bandwidth_by_device_name(name, peak):
    assert moe_kernel.peak_gbps_for(name) == peak


def test_moe_kernel_dry_run_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    args = ["--dry-run", "--models", "tiny-olmoe", "--tokens", "4", "--budgets", "none", "4"]
    assert moe_kernel.main(args + ["--output", str(out), "--markdown", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["budget"] for r in rows] == [None, 4]
    assert rows[1]["experts_read"] <= 4 < rows[0]["experts_read"]
    assert all(r["rel_err_vs_eager"] < 1e-5 for r in rows)
    assert all(r["bytes_moved"] > r["bytes_read"] > 0 for r in rows)
    assert all(r["frac_peak"] is None for r in rows)  # no peak known for the CPU: printed as n/a
    assert "grouped_mm/triton" in md.read_text() and "| n/a |" in md.read_text()


def test_kernel_parity_cpu_smoke_is_strict(tmp_path):
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    args = ["--cpu-smoke", "--families", "qwen3_moe", "--tokens", "16", "--batch", "1", "--strict"]
    assert kernel_parity.main(args + ["--output", str(out), "--markdown", str(md)]) == 0
    result = json.loads(out.read_text())
    assert result["fp32_ok"] and len(result["rows"]) == len(kernel_parity.BUDGETS)
    assert all(r["ids_identical"] == 1.0 for r in result["rows"])
    assert md.read_text().count("| pass |") == len(kernel_parity.BUDGETS)


@pytest.mark.slow
def test_gpu_check_script_dry_run(tmp_path):
    """The whole script on CPU (~30-40 s): environment, four stages, summary."""
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), str(tmp_path), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for stage in ("pytest", "parity", "eval_parity", "moe_kernel"):
        assert f"| {stage} | ok |" in summary
    assert "fp32 strict" in summary and "grouped_mm/triton" in summary
    assert "identical generations" in summary and "| 4 |" in summary
