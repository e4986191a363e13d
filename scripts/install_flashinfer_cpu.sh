#!/usr/bin/env bash
# Install FlashInfer's Python package (no CUDA toolkit, no torch re-resolution) so that
# `import flashinfer` works on a CPU-only machine and the conformance test can bind every call the
# FlashInfer backend makes to the real signatures. Nothing here can *run* a kernel (that needs a
# CUDA GPU, sm75+). Idempotent: does nothing when the pinned version already imports.
#
# Usage: scripts/install_flashinfer_cpu.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail

PY="${1:-.venv/bin/python}"
FLASHINFER_VERSION="0.7.2.post1"

if "$PY" - "$FLASHINFER_VERSION" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version

assert version("flashinfer-python") == sys.argv[1]
import flashinfer  # noqa: F401  (must import without CUDA)
PYEOF
then
    echo "flashinfer-python ${FLASHINFER_VERSION} already importable"
    exit 0
fi

# --no-deps: the wheel's own requirements would pull a CUDA torch and nvidia-* / cuda-python /
# nccl wheels (GPU-only, unused by `import flashinfer`); torch is already pinned (CPU build) by
# pyproject.toml. The pure-Python runtime dependencies the import needs follow. `pip check`
# reports the skipped GPU-only requirements; that is expected here.
"$PY" -m pip install --no-deps "flashinfer-python==${FLASHINFER_VERSION}"
"$PY" -m pip install \
    "apache-tvm-ffi>=0.1.11,<0.2" \
    einops ninja nvidia-ml-py tabulate click requests "packaging>=24.2" tqdm numpy

"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'imports')"
