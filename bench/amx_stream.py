"""How fast the AMX linear's loop structure streams its weights, from memory and from L2, on a
bare kernel (no epilogue, no bias, outputs dropped), so that what limits `amx_linear` at 64 rows
(`radixrt/attention/csrc/amx_linear.cpp`) can be told apart: the tile arithmetic, the memory
stream, or their overlap.

    python bench/amx_stream.py [--k 576 1536] [--reps 3] [--out F]

Each case runs on 2 threads, each over its half of a weight buffer in the AMX linear's packed
layout (blocks of 32 outputs x 32 inputs, 2 KiB per K step of a 32-output block) against 64 rows
(or 32) of bf16 activations held in cache, and prints weight GB/s:
- `tiles-only`: the B tiles loaded, no arithmetic (what tile loads draw from memory);
- `amx_linear`: amx_linear's structure at 64 rows: N blocks in groups of 256 KiB, each 32-row
  block passed over a group's blocks before the next row block (the first pass reads the
  weights from memory, the second from L2), the next group prefetched into L2 (prefetcht1)
  spread over the group's K steps; four C tiles (32 rows x 32 outputs) per pass;
- `amx_linear-nopf`: the same without the software prefetch;
- `1-block-nopf`: groups of one block (both row blocks over it in turn), no software prefetch;
- `32-rows` / `32-rows-nopf`: one 32-row block only (half the arithmetic per weight byte);
- `int8`: `amx_linear`'s passes on int8 codes (TDPBUSD, one scale per output row and per
  activation row, so the sums run over all of K): twice the weights per byte and per tile op,
  i.e. what a per-channel int8 (W8A8) copy of the weights would stream at 64 rows.
From memory the buffer is 1 GiB (more than this VM's LLC holds of it); from L2, 1 MiB cycled,
so the figure is the structure's arithmetic rate expressed in weight bytes. With the compute
rate c and the memory rate m, full overlap reads at min(c, m), none at 1 / (1/c + 1/m).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.common import cpu_name, markdown_table  # noqa: E402
from radixrt.attention import cpu_kernels  # noqa: E402

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>

namespace {
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config() { for (int t = 0; t < 8; ++t) { colsb[t] = 64; rows[t] = 16; } }
};
constexpr int64_t kStep = 2048;  // weight bytes per K step of a 32-output block
}  // namespace

bool amx_ready() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// One sweep over `w` (kind 0: tiles only, 1: the linear's passes in bf16, 2: the
// same passes on int8 codes, TDPBUSD: 64 inputs per 2 KiB step) with `row_blocks` 32-row blocks
// of `a` (64 rows of K bf16, or of 2K int8 for kind 2: the same bytes a row), groups of
// `group_bytes`, software prefetch of the next group on or off.
void sweep(torch::Tensor w, torch::Tensor a, int64_t k, int64_t kind, int64_t row_blocks,
           int64_t group_bytes, bool prefetch) {
  const char* wb = static_cast<const char*>(w.data_ptr());
  const char* ab = static_cast<const char*>(a.data_ptr());
  const int64_t ksteps = k / 32, block = ksteps * kStep, blocks = w.numel() / block;
  const int64_t lda = k * 2;
#pragma omp parallel num_threads(2)
  {
    const int id = omp_get_thread_num();
    const int64_t b0 = id * blocks / 2, b1 = (id + 1) * blocks / 2;
    const Config cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float c[4][256];
    if (kind == 0) {
      for (const char* p = wb + b0 * block; p < wb + b1 * block; p += kStep) {
        _tile_loadd(6, p, 64);
        _tile_loadd(7, p + kStep / 2, 64);
      }
    } else {
      const int64_t group = std::max<int64_t>(1, group_bytes / block);
      for (int64_t g0 = b0; g0 < b1; g0 += group) {
        const int64_t g1 = std::min(b1, g0 + group);
        const char* pf = wb + g1 * block;
        const int64_t lines = prefetch ? (std::min(b1, g1 + group) - g1) * block / 64 : 0;
        const int64_t steps = row_blocks * (g1 - g0) * ksteps;
        const int64_t per = (lines + steps - 1) / steps;
        int64_t done = 0;
        for (int64_t rb = 0; rb < row_blocks; ++rb) {
          const char* x = ab + rb * 32 * lda;
          for (int64_t nb = g0; nb < g1; ++nb) {
            const char* wn = wb + nb * block;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kb = 0; kb < ksteps; ++kb) {
              for (int64_t i = 0; i < per && done < lines; ++i, ++done) {
                _mm_prefetch(pf + done * 64, _MM_HINT_T1);
              }
              _tile_loadd(4, x + kb * 64, lda);
              _tile_loadd(6, wn + kb * kStep, 64);
              _tile_loadd(7, wn + kb * kStep + kStep / 2, 64);
              _tile_loadd(5, x + 16 * lda + kb * 64, lda);
              if (kind == 2) {  // int8: 64 inputs a step, int32 sums
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 4, 7);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
              } else {  // bf16: 32 inputs a step, fp32 sums
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
              }
            }
            _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
          }
        }
      }
    }
    _tile_release();
  }
}
"""

# name: (kind, 32-row blocks, group bytes, software prefetch)
CASES = {
    "tiles-only": (0, 0, 0, False),
    "amx_linear": (1, 2, 256 << 10, True),
    "amx_linear-nopf": (1, 2, 256 << 10, False),
    "1-block-nopf": (1, 2, 1, False),
    "32-rows": (1, 1, 256 << 10, True),
    "32-rows-nopf": (1, 1, 256 << 10, False),
    "int8": (2, 2, 256 << 10, True),
}
# Where the weights come from: (buffer bytes, sweeps timed together): one sweep of 1 GiB, many
# of a buffer that stays in L2.
SOURCES = {"memory": (1 << 30, 1), "L2": (1 << 20, 200)}


def _build():  # noqa: ANN202 (a compiled module)
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        name="radixrt_amx_stream", cpp_sources=[_SOURCE], functions=["amx_ready", "sweep"],
        extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
        extra_ldflags=["-fopenmp"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[576, 1536],
                    help="input features (SmolLM2: 576 for qkv, o, gate_up; 1536 for down)")
    ap.add_argument("--reps", type=int, default=3, help="sweeps per case (the best is kept)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if not {"amx_tile", "amx_bf16", "amx_int8"} <= cpu_kernels.cpu_flags():
        sys.exit("amx_stream: this CPU has no AMX-BF16 / AMX-INT8 tiles")
    mod = _build()
    if not mod.amx_ready():
        sys.exit("amx_stream: the kernel did not grant this process the AMX tile state")
    rows = []
    for k in args.k:
        block = k // 32 * 2048
        a = torch.randn(64, k).bfloat16()
        for where, (size, sweeps) in SOURCES.items():
            w = torch.randint(-2**15, 2**15, (size // block * block // 2,),
                              dtype=torch.int16).view(torch.uint8)
            w = w & 0x3F  # small exponents: finite bf16 values
            row = {"k": k, "from": where}
            for name, (kind, rbs, gbytes, pf) in CASES.items():
                best = 0.0
                for _ in range(args.reps):
                    t = time.perf_counter()
                    for _ in range(sweeps):
                        mod.sweep(w, a, k, kind, rbs, gbytes, pf)
                    gbps = sweeps * w.numel() / (time.perf_counter() - t) / 1e9
                    best = max(best, gbps)
                row[name] = round(best, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nWeight GB/s on 2 threads, best of --reps, by loop structure\n")
    print(markdown_table(["K", "from", *CASES], ([r["k"], r["from"], *(r[c] for c in CASES)]
                                                  for r in rows)))
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": 2, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
