"""What a non-editable install ships: the CPU kernels are compiled on the user's machine from the
files under radixrt/attention/csrc, so the package data must carry every one of them (before stop
58 it listed the .cpp files only, and a wheel's build would have failed on the first header)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_package_data_ships_every_kernel_source_and_header() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["radixrt.attention"]
    csrc = ROOT / "radixrt" / "attention" / "csrc"
    files = sorted(p.relative_to(csrc.parent).as_posix() for p in csrc.iterdir() if p.is_file())
    assert any(f.endswith(".h") for f in files) and any(f.endswith(".cpp") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
