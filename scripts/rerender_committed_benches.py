"""Re-render every committed bench under docs/bench from its recorded per-prompt counts (``vat bench --render``).

    python scripts/rerender_committed_benches.py [docs/bench/tiny_dflash ...]

The benches ran in one shared output directory, so a committed bench keeps only its own cells and reads the cells it
shared (``eagle3``, ``vat``, the baselines of the headline bench, ``dflash`` of the DFlash bench) from the bench that
holds them. Each bench is rendered in a temporary directory holding its config and links to every cell it names,
then bench.json, bench.md and the PNGs are copied back. Nothing is trained or evaluated.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs", "bench")
SOURCES = ["tiny", "tiny_dflash"]  # the benches whose cells others shared, searched in this order


def cell_dirs(label: str, own: str) -> str | None:
    """The cells directory of ``label``: the bench's own, else the first shared source's."""
    for bench in [own, *SOURCES]:
        path = os.path.join(DOCS, bench, "cells", label)
        if os.path.isdir(path):
            return path
    return None


def rerender(bench_dir: str) -> None:
    from omegaconf import OmegaConf

    name = os.path.basename(bench_dir.rstrip("/"))
    cfg = OmegaConf.load(os.path.join(bench_dir, "bench_config.yaml"))
    labels = [*cfg.methods, *cfg.baselines]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(bench_dir, "bench_config.yaml"), tmp)
        os.makedirs(os.path.join(tmp, "cells"))
        for label in labels:
            source = cell_dirs(label, name)
            if source is None:
                print(f"{name}: no recorded cells for `{label}`", flush=True)
                continue
            os.symlink(source, os.path.join(tmp, "cells", label))
        subprocess.run([sys.executable, "-m", "vat", "bench", os.path.join(tmp, "bench_config.yaml"),
                        f"output_dir={tmp}", "--render"], check=True)
        for path in glob.glob(os.path.join(tmp, "bench.*")) + glob.glob(os.path.join(tmp, "*.png")):
            shutil.copy(path, bench_dir)


def main() -> int:
    dirs = sys.argv[1:] or sorted(os.path.dirname(p) for p in glob.glob(os.path.join(DOCS, "*", "cells")))
    for bench_dir in dirs:
        rerender(bench_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
