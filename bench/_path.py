"""Import fix-up for the entry scripts run as `python bench/<script>.py`.

Python puts the script's folder (bench/) first on sys.path, where `datasets.py` would shadow the
Hugging Face `datasets` package for anything transformers imports. Replace it with the repository
root, so the bench modules are imported as `bench.<module>` and nothing is shadowed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fix() -> None:
    here = str(ROOT / "bench")
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
