// Quantized matmul with int8 activations on AVX512-VNNI (llama.cpp's approach), for every row
// count: y[M, N] = x[M, K] @ W[N, K]^T, W in groups of 32 input features with an unsigned code,
// a per-group scale d and offset c:  W[n, k] = d[n, g] * u[n, k] + c[n, g],  g = k / 32.
//   4-bit (GGUF Q4_0 / Q4_1): u in 0..15   (Q4_0: c = -8d; Q4_1: c = m)
//   8-bit (GGUF Q8_0):        u = q + 128 in 0..255 (c = -128d), so vpdpbusd's unsigned operand
//                             is always the weight and the signed one the activation.
//
// Activations: each row is quantized once per call, per group of 32, symmetric:
//   sx = absmax / 127 (fp32), xq = round_half_even(x / sx) in -127..127 (sx = 0, xq = 0 for an
//   all-zero group), S = sx * sum(xq) (the offset term uses the quantized activations' sum).
// So every output is the dot product of the exact weights with the dequantized activations
// xq * sx:  y[m, n] = sum_g  (d * (sx * dot_i32(u, xq))) + c * S, accumulated in fp32 in group
// order. The i32 dot of one group is exact; the same instruction sequence computes each output
// whatever M or the blocking, so results are independent of the row count (batch-invariant).
//
// Layout (made once at load time by radixrt/model/quant_matmul.py `pack_vnni`): output features
// in tiles of 16 (vector lanes), one blob per (tile, group), uint8 [N/16, K/32, B]:
//   4-bit: 4 vectors of 64 bytes; vector v, lane n, byte b: low nibble u[n, 32g + 8v + b],
//          high nibble u[n, 32g + 8v + 4 + b]   (two k-quads per vector)
//   8-bit: 8 vectors of 64 bytes; vector v, lane n, byte b: u[n, 32g + 4v + b]
//   then d[16], c[16] as float16 (when exact: GGUF's d and m are fp16) or float32;
//   B = 64 * bits + 64 (fp16) or + 128 (fp32).
// One blob stream per tile keeps decode (M = 1) a few sequential streams.
//
// Blocking: MT rows x TT tiles per pass (MT * TT i32 dot and fp32 accumulators in registers);
// work items are (row chunk, tile chunk) pairs, tile-chunk weights reused from L1/L2 by every
// row block of the chunk. Built only where the compiler has __AVX512VNNI__ (the builder adds
// -mavx512vnni when /proc/cpuinfo lists avx512_vnni); elsewhere the op refuses with an error
// and qgemm_vnni_isa() returns "none".

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define RADIXRT_QGEMM_VNNI 1
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;

constexpr int64_t kTile = 16;
constexpr int64_t kGroup = 32;

#if defined(RADIXRT_QGEMM_VNNI)
// Rows per work item (a multiple of every MT below) and weights per item at least.
constexpr int64_t kRowChunk = 96;
constexpr int64_t kMinWeightsPerTask = 1 << 16;

struct Problem {
  int64_t m, n_tiles, groups, k, bits, blob;
  bool half;
  const uint8_t* w;    // [n_tiles, groups, blob]
  const int8_t* xq;    // [m, k]
  const float* sx;     // [m, groups]
  const float* xs;     // [m, groups]: sx * sum(xq)
  int64_t code_bytes() const { return 64 * bits; }
};

inline __m512 load_scale(const uint8_t* p, bool half) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

template <typename Out>
inline void store16(Out* dst, __m512 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
    alignas(64) float tmp[kTile];
    _mm512_store_ps(tmp, v);
    for (int64_t i = 0; i < kTile; ++i) dst[i] = static_cast<Out>(tmp[i]);
  }
}

// One pass: rows [m0, m0 + MT), tiles [t, t + TT), all groups.
template <int MT, int TT, int BITS, typename Out>
inline void block(const Problem& p, int64_t m0, int64_t t, Out* y, int64_t ldy) {
  __m512 acc[MT][TT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) acc[m][tt] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int8_t* xrow = p.xq + m0 * p.k;
  for (int64_t g = 0; g < p.groups; ++g) {
    const uint8_t* wb[TT];
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) wb[tt] = p.w + ((t + tt) * p.groups + g) * p.blob;
    __m512i dot[MT][TT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int tt = 0; tt < TT; ++tt) dot[m][tt] = _mm512_setzero_si512();
    const int8_t* xg = xrow + g * kGroup;
    if constexpr (BITS == 4) {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512i lo[TT], hi[TT];
#pragma GCC unroll 4
        for (int tt = 0; tt < TT; ++tt) {
          const __m512i raw = _mm512_loadu_si512(wb[tt] + 64 * v);
          lo[tt] = _mm512_and_si512(raw, low4);
          hi[tt] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m512i x0 = _mm512_set1_epi32(
              *reinterpret_cast<const int32_t*>(xg + m * p.k + 8 * v));
          const __m512i x1 = _mm512_set1_epi32(
              *reinterpret_cast<const int32_t*>(xg + m * p.k + 8 * v + 4));
#pragma GCC unroll 4
          for (int tt = 0; tt < TT; ++tt) {
            dot[m][tt] = _mm512_dpbusd_epi32(dot[m][tt], lo[tt], x0);
            dot[m][tt] = _mm512_dpbusd_epi32(dot[m][tt], hi[tt], x1);
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        __m512i u[TT];
#pragma GCC unroll 4
        for (int tt = 0; tt < TT; ++tt) u[tt] = _mm512_loadu_si512(wb[tt] + 64 * v);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m512i xv = _mm512_set1_epi32(
              *reinterpret_cast<const int32_t*>(xg + m * p.k + 4 * v));
#pragma GCC unroll 4
          for (int tt = 0; tt < TT; ++tt) dot[m][tt] = _mm512_dpbusd_epi32(dot[m][tt], u[tt], xv);
        }
      }
    }
    const int64_t sbytes = p.half ? 2 : 4;
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) {
      const uint8_t* sc = wb[tt] + p.code_bytes();
      const __m512 d = load_scale(sc, p.half);
      const __m512 c = load_scale(sc + kTile * sbytes, p.half);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * p.groups + g;
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][tt]), _mm512_set1_ps(p.sx[i]));
        acc[m][tt] = _mm512_fmadd_ps(f, d, acc[m][tt]);
        acc[m][tt] = _mm512_fmadd_ps(c, _mm512_set1_ps(p.xs[i]), acc[m][tt]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) store16(y + (m0 + m) * ldy + (t + tt) * kTile, acc[m][tt]);
}

// Tiles [t0, t1) for MT rows at m0: TT tiles per pass, the rest one by one.
template <int MT, int TT, int BITS, typename Out>
inline void rows_pass(const Problem& p, int64_t m0, int64_t t0, int64_t t1, Out* y, int64_t ldy) {
  int64_t t = t0;
  for (; t + TT <= t1; t += TT) block<MT, TT, BITS>(p, m0, t, y, ldy);
  for (; t < t1; ++t) block<MT, 1, BITS>(p, m0, t, y, ldy);
}

#ifndef VNNI_MT
#define VNNI_MT 4
#define VNNI_TT 2
#endif
constexpr int kRows = VNNI_MT;  // MT of the main pass
constexpr int kCols = VNNI_TT;  // TT of the main pass

// Rows [r0, r1) x tiles [t0, t1): the tile chunk stays in cache while the row blocks pass.
template <int BITS, typename Out>
void item(const Problem& p, int64_t r0, int64_t r1, int64_t t0, int64_t t1, Out* y, int64_t ldy) {
  const int64_t rows = r1 - r0;
  if (rows == 1) return rows_pass<1, 4, BITS>(p, r0, t0, t1, y, ldy);
  if (rows == 2) return rows_pass<2, 3, BITS>(p, r0, t0, t1, y, ldy);
  if (rows == 3) return rows_pass<3, 2, BITS>(p, r0, t0, t1, y, ldy);
  // Several tiles wide, rows inner: each tile pair is read from cache by every row block.
  constexpr int64_t kTilesPerPanel = kCols;
  for (int64_t ts = t0; ts < t1; ts += kTilesPerPanel) {
    const int64_t te = std::min(t1, ts + kTilesPerPanel);
    int64_t m = r0;
    for (; m + kRows <= r1; m += kRows) rows_pass<kRows, kCols, BITS>(p, m, ts, te, y, ldy);
    for (; m + 4 <= r1; m += 4) rows_pass<4, 1, BITS>(p, m, ts, te, y, ldy);
    switch (r1 - m) {
      case 1: rows_pass<1, kCols, BITS>(p, m, ts, te, y, ldy); break;
      case 2: rows_pass<2, kCols, BITS>(p, m, ts, te, y, ldy); break;
      case 3: rows_pass<3, kCols, BITS>(p, m, ts, te, y, ldy); break;
      default: break;
    }
  }
}

// Per row and group: sx, xq, S (see the header). x is float32 or bfloat16, contiguous.
template <typename In>
void quantize_rows(const In* x, int64_t m, int64_t k, int8_t* xq, float* sx, float* xs) {
  const int64_t groups = k / kGroup;
  auto work = [&](int64_t r0, int64_t r1) {
    alignas(64) float buf[kGroup];
    for (int64_t i = r0 * groups; i < r1 * groups; ++i) {
      const In* src = x + i * kGroup;
      for (int64_t e = 0; e < kGroup; ++e) buf[e] = static_cast<float>(src[e]);
      const __m512 a = _mm512_load_ps(buf), b = _mm512_load_ps(buf + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float s = amax / 127.f;
      int8_t* dst = xq + i * kGroup;
      if (s == 0.f) {  // all-zero group (or one too small for a normal scale: rounds to 0)
        std::fill(dst, dst + kGroup, 0);
        sx[i] = 0.f;
        xs[i] = 0.f;
        continue;
      }
      const __m512 vs = _mm512_set1_ps(s);
      const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_div_ps(a, vs),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_div_ps(b, vs),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      sx[i] = s;
      xs[i] = s * static_cast<float>(sum);
    }
  };
  if (m * k < (1 << 15)) {
    work(0, m);
  } else {
    at::parallel_for(0, m, 16, work);
  }
}
#endif  // RADIXRT_QGEMM_VNNI

std::tuple<Tensor, Tensor, Tensor> quantize_checked(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "qgemm_vnni: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "qgemm_vnni: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, "qgemm_vnni: x's input features (", x.size(1),
              ") must be a multiple of ", kGroup);
#if defined(RADIXRT_QGEMM_VNNI)
  const Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), groups = k / kGroup;
  Tensor xq = at::empty({m, k}, xc.options().dtype(at::kChar));
  Tensor sx = at::empty({m, groups}, xc.options().dtype(at::kFloat));
  Tensor xs = at::empty({m, groups}, xc.options().dtype(at::kFloat));
  if (m * k > 0) {
    if (xc.scalar_type() == at::kFloat) {
      quantize_rows(xc.data_ptr<float>(), m, k, xq.data_ptr<int8_t>(), sx.data_ptr<float>(),
                    xs.data_ptr<float>());
    } else {
      quantize_rows(xc.data_ptr<at::BFloat16>(), m, k, xq.data_ptr<int8_t>(),
                    sx.data_ptr<float>(), xs.data_ptr<float>());
    }
  }
  return {xq, sx, xs};
#else
  TORCH_CHECK(false, "qgemm_vnni: this kernel library was built without AVX512-VNNI");
#endif
}

// (xq int8 [M, K], sx float32 [M, K/32], S = sx * sum(xq) float32 [M, K/32]): the activation
// quantization qgemm_vnni applies (exposed for tests and references).
std::tuple<Tensor, Tensor, Tensor> qgemm_vnni_quantize(const Tensor& x) {
  return quantize_checked(x);
}

Tensor qgemm_vnni(const Tensor& x, const Tensor& packed, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm_vnni: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "qgemm_vnni: packed must be contiguous uint8 [N/16, K/32, bytes], got ",
              packed.sizes(), " ", packed.scalar_type());
  const int64_t code_bytes = 64 * bits, blob = packed.size(2);
  TORCH_CHECK(blob == code_bytes + 64 || blob == code_bytes + 128, "qgemm_vnni: packed's last "
              "dim must be ", code_bytes + 64, " (fp16 scales) or ", code_bytes + 128,
              " (fp32) for ", bits, "-bit codes, got ", blob);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * kGroup, "qgemm_vnni: x must be [M, ",
              packed.size(1) * kGroup, "] for this weight, got ", x.sizes());
#if defined(RADIXRT_QGEMM_VNNI)
  const int64_t m = x.size(0), k = x.size(1), n_tiles = packed.size(0), n = n_tiles * kTile;
  Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  auto [xq, sx, xs] = quantize_checked(x);
  Problem p{m, n_tiles, k / kGroup, k, bits, blob, blob == code_bytes + 64,
            packed.data_ptr<uint8_t>(), xq.data_ptr<int8_t>(), sx.data_ptr<float>(),
            xs.data_ptr<float>()};
  // Work items: row chunks x tile chunks, row-chunk-major (a thread's consecutive items share
  // activations). Tile chunks hold at least kMinWeightsPerTask weight-rows of work.
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk;
  const int64_t rows_in_chunk = std::min(m, kRowChunk);
  const int64_t tiles_per_item = std::clamp<int64_t>(
      kMinWeightsPerTask / std::max<int64_t>(1, kTile * k * rows_in_chunk), 4, 64);
  const int64_t tile_chunks = (n_tiles + tiles_per_item - 1) / tiles_per_item;
  const int64_t items = row_chunks * tile_chunks;
  auto run = [&](auto* yp) {
    auto work = [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t rc = i / tile_chunks, tc = i % tile_chunks;
        const int64_t r0 = rc * kRowChunk, r1 = std::min(m, r0 + kRowChunk);
        const int64_t t0 = tc * tiles_per_item, t1 = std::min(n_tiles, t0 + tiles_per_item);
        if (bits == 4) {
          item<4>(p, r0, r1, t0, t1, yp, n);
        } else {
          item<8>(p, r0, r1, t0, t1, yp, n);
        }
      }
    };
    if (items == 1 || m * n * k < 2 * kMinWeightsPerTask) {
      work(0, items);
    } else {
      at::parallel_for(0, items, 1, work);
    }
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(y.data_ptr<at::BFloat16>());
  } else {
    run(y.data_ptr<float>());
  }
  return y;
#else
  TORCH_CHECK(false, "qgemm_vnni: this kernel library was built without AVX512-VNNI");
#endif
}

std::string qgemm_vnni_isa() {
#if defined(RADIXRT_QGEMM_VNNI)
  return "avx512vnni";
#else
  return "none";
#endif
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("qgemm_vnni(Tensor x, Tensor packed, int bits) -> Tensor");
  m.def("qgemm_vnni_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qgemm_vnni_isa() -> str", &radixrt_cpu::qgemm_vnni_isa);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("qgemm_vnni", &radixrt_cpu::qgemm_vnni);
  m.impl("qgemm_vnni_quantize", &radixrt_cpu::qgemm_vnni_quantize);
}
