// A bf16 linear on AMX tiles (TDPBF16PS): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 sums
// rounded once to bf16 (nearest even), for CPUs with AMX-BF16 (radixrt/model/prepack.py packs
// dense bf16 weights for it where it is faster than oneDNN).
//
// Layout (made once at load time by prepack.amx_pack): W in blocks of 32 outputs x 32 inputs,
// bf16 [N/32, K/32, 2, 16, 32]: block (nb, kb), half t, row r holds, for outputs
// n = 32 nb + 16 t + 0..15, the input pair (32 kb + 2r, 32 kb + 2r + 1): one B tile per half, an
// N block's blocks contiguous in K order.
//
// Each output is one fp32 tile lane accumulated over K in steps of 32 (kb = 0, 1, ...), the same
// steps whatever M, the row blocking, the chunking or the thread count; a row's outputs depend
// only on its own activations (the last rows' tile is padded with zero rows). So the result is
// row-invariant. The bias is added to the fp32 sum, which is rounded once. It is bitwise torch's
// own bf16 linear (oneDNN) wherever oneDNN's kernel also takes K in order (seen: 1-8 rows and
// 512 rows on SmolLM2's shapes); elsewhere a few outputs in 10^4 differ, by the fp32 sums' order.
//
// Blocking: 32 rows x 32 outputs per pass (four C tiles; two A tiles of activation rows read in
// place, two B tiles of weights), all of K. N blocks are split over the threads; a thread takes
// its blocks in groups of kGroupBytes of weights (kept in L2) and passes every 32-row block of
// activations (in L1) over a group before the next (rows in 256-row chunks with every N block
// inside was 0.75-0.9x oneDNN for gate_up [3072, 576] at 512-1300 rows: its weights left L2).
// Measured on a 2-vCPU Xeon with AMX (SmolLM2's four layer matmuls, weights in the caches, against
// oneDNN's plain call, layer sums): 64 rows 2.0x, 256 rows 1.5x, 512 rows 1.07x, 768-1300 rows
// 1.09-1.18x (the 576-wide outputs 1.5-1.9x at 768-1024, where oneDNN drops to 1.3-1.6
// TFLOP/s), 2048 rows and more 0.73-0.78x; prefills on the default model: 256 tokens 1.18x, 512
// 1.11x, 1024 1.15x, 1300 1.05x, 1536 0.91x: hence prepack.AMX_MAX_ROWS.

#include <torch_headers.h>  // first: precompiled by the build
#include <c10/util/BFloat16.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(RADIXRT_AMX_TILES) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXRT_AMX_LINEAR 1
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;

constexpr int64_t kBlock = 32;  // outputs and inputs per weight block
#if defined(RADIXRT_AMX_LINEAR)
// Weight bytes of the N blocks a thread takes together over every row (they stay in L2 while
// each 32-row block of activations, in L1, passes over them).
constexpr int64_t kGroupBytes = 256 << 10;
constexpr int64_t kBlockElems = 2 * 16 * 32;  // bf16 elements of one (nb, kb) block

// `rows` rows of 16 fp32 sums (+ bias) rounded to bf16 at y (row stride ldy).
inline void store_rows(const float* c, int64_t rows, const float* bias, at::BFloat16* y,
                       int64_t ldy) {
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(c + r * 16);
    if (bias) v = _mm512_add_ps(v, b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows [0, rows) (rows <= 16 * (TWO ? 2 : 1)) of a at stride lda (elements) x N block `w`
// (ksteps blocks): y's 32 outputs of those rows. Tiles (TileConfig, amx_tiles.h: all 16 x 64
// bytes) 0-3: C (rows 0-15 / 16-31 x outputs 0-15 / 16-31), 4-5: A, 6-7: B.
template <bool TWO>
inline void pass(const at::BFloat16* a, int64_t lda, const at::BFloat16* w, int64_t ksteps,
                 const float* bias, at::BFloat16* y, int64_t ldy, int64_t rows, float* cbuf) {
  const int64_t stride = lda * static_cast<int64_t>(sizeof(at::BFloat16));
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < ksteps; ++kb) {
    const at::BFloat16* b = w + kb * kBlockElems;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kBlockElems / 2, 64);
    _tile_loadd(4, a + kb * kBlock, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a + 16 * lda + kb * kBlock, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
  _tile_stored(1, cbuf + 256, 64);
  if constexpr (TWO) {
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
  }
  const int64_t top = std::min<int64_t>(rows, 16);
  store_rows(cbuf, top, bias, y, ldy);
  store_rows(cbuf + 256, top, bias ? bias + 16 : nullptr, y + 16, ldy);
  if (TWO && rows > 16) {
    store_rows(cbuf + 512, rows - 16, bias, y + 16 * ldy, ldy);
    store_rows(cbuf + 768, rows - 16, bias ? bias + 16 : nullptr, y + 16 * ldy + 16, ldy);
  }
}
#endif  // RADIXRT_AMX_LINEAR

// Whether this build and process can run amx_linear.
bool amx_linear_available() {
#if defined(RADIXRT_AMX_LINEAR)
  return amx_usable();
#else
  return false;
#endif
}

Tensor amx_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  TORCH_CHECK(amx_linear_available(),
              "amx_linear: this kernel library or CPU has no usable AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "amx_linear: x must be 2-D bfloat16 [M, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 32,
              "amx_linear: packed must be contiguous bfloat16 [N/32, K/32, 2, 16, 32], got ",
              packed.sizes());
  const int64_t m = x.size(0), k = x.size(1), n_blocks = packed.size(0), ksteps = packed.size(1);
  TORCH_CHECK(k == ksteps * kBlock, "amx_linear: x has ", k, " features, the weight ",
              ksteps * kBlock);
  const int64_t n = n_blocks * kBlock;
  Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "amx_linear: bias must be [", n,
                "], got ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if defined(RADIXRT_AMX_LINEAR)
  const Tensor xc = x.contiguous();
  const auto* xa = xc.data_ptr<at::BFloat16>();
  const auto* w = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t full = m / 16 * 16;
  std::vector<at::BFloat16> tail;  // the last rows short of a tile, padded with zero rows
  if (full < m) {
    tail.assign(16 * k, at::BFloat16(0.f));
    std::memcpy(tail.data(), xa + full * k, (m - full) * k * sizeof(at::BFloat16));
  }
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    static const TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float cbuf[4 * 256];
    const int64_t group = std::max<int64_t>(
        1, kGroupBytes / (ksteps * kBlockElems * static_cast<int64_t>(sizeof(at::BFloat16))));
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group);
      for (int64_t r = 0; r < m; r += 32) {
        for (int64_t nb = g0; nb < g1; ++nb) {
          const at::BFloat16* wb = w + nb * ksteps * kBlockElems;
          const float* bb = bp ? bp + nb * kBlock : nullptr;
          at::BFloat16* yb = yp + r * n + nb * kBlock;
          if (r + 32 <= full) {
            pass<true>(xa + r * k, k, wb, ksteps, bb, yb, n, 32, cbuf);
          } else {  // the last rows: a whole tile of them if there is one, then the tail
            int64_t q = r;
            if (q + 16 <= full) {
              pass<false>(xa + q * k, k, wb, ksteps, bb, yb, n, 16, cbuf);
              q += 16;
            }
            if (q < m)
              pass<false>(tail.data(), k, wb, ksteps, bb, yp + q * n + nb * kBlock, n, m - q,
                          cbuf);
          }
        }
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_linear_available() -> bool", &radixrt_cpu::amx_linear_available);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) { m.impl("amx_linear", &radixrt_cpu::amx_linear); }
