// Quantized small-M matmul (decode): y[M, N] = x[M, K] @ W[N, K]^T, W kept in groups of 32 input
// features with a per-group scale d and offset c:  W[n, k] = d[n, g] * q[n, k] + c[n, g], g = k / 32.
//
// Layout (built once at load time by radixrt/model/quant_matmul.py `pack_tiles`): output features
// in tiles of 16, input features in groups of 32 = 16 pairs (k = 32g + 2j, 32g + 2j + 1):
//   codes  uint8 [N/16, K/32, 64 * bits]   per (tile, group), pair j, output lane n:
//          bits 4: byte j*16 + n = q[n, 2j] | q[n, 2j+1] << 4      (q in 0..15)
//          bits 8: bytes j*32 + 2n, j*32 + 2n + 1 = q[n, 2j], q[n, 2j+1] (int8)
//   scale, offset  [N/16, K/32, 16], both float32 or both float16 (GGUF's d and m are fp16,
//          so fp16 holds them exactly and reads 4 bytes less per group)
// Lanes are output features, so a decoded vector serves every activation row and no horizontal
// reduction is needed.
//
// Numerics (all paths): weights are the exact values above up to one fp32 rounding; products
// and sums are fp32. AVX512-BF16 path: codes become exact bf16 integers, x is bf16 (an fp32 x is
// rounded to bf16 first, as torch's int4 kernel does), dot products per group by vdpbf16ps, then
// acc += d * dot + c * sum(x over the group). AVX2 / generic paths: w = d * q + c in fp32 against
// fp32 x (a bf16 x converts exactly). Each output row is computed by the same instruction
// sequence whatever M, so results are independent of the row count (batch-invariant).
//
// Instruction set: chosen by the compiler flags the builder picks from /proc/cpuinfo
// (radixrt/attention/cpu_kernels.py): __AVX512BF16__ -> avx512bf16, else __AVX2__ + __FMA__ ->
// avx2, else generic C++.

#include <torch_headers.h>  // first: precompiled by the build
#include <c10/util/BFloat16.h>

#include "argmax.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define RADIXRT_QGEMV_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define RADIXRT_QGEMV_AVX2 1
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;

constexpr int64_t kTile = 16;   // output features per tile (vector lanes)
constexpr int64_t kGroup = 32;  // input features per scale group
constexpr int64_t kPairs = kGroup / 2;
// Weights per parallel work item at least: waking a thread costs more than a few us of work.
constexpr int64_t kMinWeightsPerTask = 1 << 16;

// What one call sees: pointers into contiguous tensors.
struct Problem {
  int64_t m, n_tiles, groups, k, bits;
  const uint8_t* codes;
  const void* scale;
  const void* offset;
  bool half;  // scale / offset are float16 (else float32)
  int64_t group_bytes() const { return 64 * bits; }
  // Element i of scale / offset (base), as float.
  float at(const void* base, int64_t i) const {
    return half ? static_cast<float>(static_cast<const at::Half*>(base)[i])
                : static_cast<const float*>(base)[i];
  }
};

template <typename Out>
inline void store_row(Out* dst, const float* src) {
  for (int64_t i = 0; i < kTile; ++i) dst[i] = static_cast<Out>(src[i]);
}

// ---------------------------------------------------------------------------------------------
// Generic C++ (any ISA): dequantize one (tile, group) into fp32 w[32][16], then multiply.
inline void decode_group_f32(const Problem& p, int64_t tg, float (*w)[kTile]) {
  const uint8_t* c = p.codes + tg * p.group_bytes();
  float d[kTile], o[kTile];
  for (int64_t n = 0; n < kTile; ++n) {
    d[n] = p.at(p.scale, tg * kTile + n);
    o[n] = p.at(p.offset, tg * kTile + n);
  }
  for (int64_t j = 0; j < kPairs; ++j) {
    for (int64_t n = 0; n < kTile; ++n) {
      float q0, q1;
      if (p.bits == 4) {
        const uint8_t b = c[j * kTile + n];
        q0 = static_cast<float>(b & 0xF);
        q1 = static_cast<float>(b >> 4);
      } else {
        q0 = static_cast<float>(static_cast<int8_t>(c[j * 32 + 2 * n]));
        q1 = static_cast<float>(static_cast<int8_t>(c[j * 32 + 2 * n + 1]));
      }
      w[2 * j][n] = d[n] * q0 + o[n];
      w[2 * j + 1][n] = d[n] * q1 + o[n];
    }
  }
}

template <typename Out>
void tiles_generic(const Problem& p, const float* x, Out* y, int64_t ldy, int64_t t0, int64_t t1) {
  std::vector<float> acc(p.m * kTile);
  float w[kGroup][kTile];
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t tg = t * p.groups + g;
      decode_group_f32(p, tg, w);
      for (int64_t m = 0; m < p.m; ++m) {
        const float* xr = x + m * p.k + g * kGroup;
        float* a = acc.data() + m * kTile;
        for (int64_t k = 0; k < kGroup; ++k) {
          const float xv = xr[k];
          for (int64_t n = 0; n < kTile; ++n) a[n] += w[k][n] * xv;
        }
      }
    }
    for (int64_t m = 0; m < p.m; ++m) store_row(y + m * ldy + t * kTile, acc.data() + m * kTile);
  }
}

#if defined(RADIXRT_QGEMV_AVX2)
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: one tile = 2 x 8 fp32 lanes. A pass covers MT rows of x and TT adjacent tiles
// (2 * MT * TT accumulators): few rows take several tiles so that enough independent FMA chains
// hide the FMA latency, without changing any output's arithmetic (row-count independent).
constexpr int kRowsAvx2 = 4;

inline __m256 load8(const Problem& p, const void* base, int64_t i) {
  if (p.half)
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const at::Half*>(base) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

// int32 codes of pair j: even k / odd k, lanes 0-7 / 8-15.
inline void decode_pair_i32(const uint8_t* c, int64_t j, int64_t bits, __m256i* ev, __m256i* od) {
  if (bits == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * kTile));
    const __m256i b0 = _mm256_cvtepu8_epi32(b);
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i low4 = _mm256_set1_epi32(0xF);
    ev[0] = _mm256_and_si256(b0, low4);
    ev[1] = _mm256_and_si256(b1, low4);
    od[0] = _mm256_srli_epi32(b0, 4);
    od[1] = _mm256_srli_epi32(b1, 4);
  } else {
    // 16 bytes = 8 lanes x (even, odd): int16 pairs in int32 lanes.
    const __m256i v0 = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * 32)));
    const __m256i v1 = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * 32 + 16)));
    ev[0] = _mm256_srai_epi32(_mm256_slli_epi32(v0, 16), 16);
    ev[1] = _mm256_srai_epi32(_mm256_slli_epi32(v1, 16), 16);
    od[0] = _mm256_srai_epi32(v0, 16);
    od[1] = _mm256_srai_epi32(v1, 16);
  }
}

template <int MT, int TT, typename Out>
inline void tile_avx2(const Problem& p, const float* x, Out* y, int64_t ldy, int64_t t) {
  __m256 acc[TT][MT][2];
#pragma GCC unroll 8
  for (int tt = 0; tt < TT; ++tt)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[tt][m][0] = acc[tt][m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    const float* xg = x + g * kGroup;
    __m256 d[TT][2], o[TT][2];
    const uint8_t* c[TT];
#pragma GCC unroll 8
    for (int tt = 0; tt < TT; ++tt) {
      const int64_t tg = (t + tt) * p.groups + g;
      c[tt] = p.codes + tg * p.group_bytes();
      d[tt][0] = load8(p, p.scale, tg * kTile);
      d[tt][1] = load8(p, p.scale, tg * kTile + 8);
      o[tt][0] = load8(p, p.offset, tg * kTile);
      o[tt][1] = load8(p, p.offset, tg * kTile + 8);
    }
    for (int64_t j = 0; j < kPairs; ++j) {
#pragma GCC unroll 8
      for (int tt = 0; tt < TT; ++tt) {
        __m256i ev[2], od[2];
        decode_pair_i32(c[tt], j, p.bits, ev, od);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // h = 0: k = 2j, h = 1: k = 2j + 1
          const __m256i* q = h ? od : ev;
          const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[0]), d[tt][0], o[tt][0]);
          const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[1]), d[tt][1], o[tt][1]);
#pragma GCC unroll 8
          for (int m = 0; m < MT; ++m) {
            const __m256 xv = _mm256_broadcast_ss(xg + m * p.k + 2 * j + h);
            acc[tt][m][0] = _mm256_fmadd_ps(w0, xv, acc[tt][m][0]);
            acc[tt][m][1] = _mm256_fmadd_ps(w1, xv, acc[tt][m][1]);
          }
        }
      }
    }
  }
  alignas(32) float out[kTile];
  for (int tt = 0; tt < TT; ++tt) {
    for (int m = 0; m < MT; ++m) {
      _mm256_store_ps(out, acc[tt][m][0]);
      _mm256_store_ps(out + 8, acc[tt][m][1]);
      store_row(y + m * ldy + (t + tt) * kTile, out);
    }
  }
}

// Tiles [t0, t1) for MT rows: TT tiles per pass, the rest one by one.
template <int MT, int TT, typename Out>
inline void rows_avx2(const Problem& p, const float* x, Out* y, int64_t ldy, int64_t t0,
                      int64_t t1) {
  int64_t t = t0;
  for (; t + TT <= t1; t += TT) tile_avx2<MT, TT>(p, x, y, ldy, t);
  for (; t < t1; ++t) tile_avx2<MT, 1>(p, x, y, ldy, t);
}

template <typename Out>
void tiles_avx2(const Problem& p, const float* x, Out* y, int64_t ldy, int64_t t0, int64_t t1) {
  int64_t m0 = 0;
  for (; m0 + kRowsAvx2 <= p.m; m0 += kRowsAvx2)
    rows_avx2<kRowsAvx2, 1>(p, x + m0 * p.k, y + m0 * ldy, ldy, t0, t1);
  const float* xr = x + m0 * p.k;
  Out* yr = y + m0 * ldy;
  switch (p.m - m0) {
    case 1: rows_avx2<1, 3>(p, xr, yr, ldy, t0, t1); break;
    case 2: rows_avx2<2, 2>(p, xr, yr, ldy, t0, t1); break;
    case 3: rows_avx2<3, 1>(p, xr, yr, ldy, t0, t1); break;
    default: break;
  }
}
#endif  // RADIXRT_QGEMV_AVX2

#if defined(RADIXRT_QGEMV_BF16)
// ---------------------------------------------------------------------------------------------
// AVX512-BF16: a decoded pair vector holds (q[n, 2j], q[n, 2j+1]) as exact bf16 in lane n;
// vdpbf16ps against the broadcast bf16 pair (x[m, 2j], x[m, 2j+1]) sums a group's products per
// lane in order j = 0..15; then acc += d * dot + c * xsum. A pass covers MT rows and TT adjacent
// tiles (2 * MT * TT registers): few rows take several tiles, so that enough independent
// vdpbf16ps chains hide its latency, without changing any output's arithmetic.
constexpr int kRowsBf16 = 8;

inline __m512 load16(const Problem& p, const void* base, int64_t tg) {
  if (p.half)
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const at::Half*>(base) + tg * kTile)));
  return _mm512_loadu_ps(static_cast<const float*>(base) + tg * kTile);
}

// bf16 bit patterns of 0..15, indexed by a 16-bit code (vpermw uses its low 5 bits).
alignas(64) const uint16_t kBf16Codes[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

// Pair vector j of a (tile, group) as 32 exact bf16 codes.
inline __m512i decode_pair_bf16(const uint8_t* c, int64_t j, int64_t bits, __m512i lut) {
  if (bits == 4) {
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * kTile)));
    // (b << 12 | b) & 0x000F000F: low word = low nibble, high word = high nibble (b < 256).
    const __m512i idx = _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 12), b,
                                                  _mm512_set1_epi32(0x000F000F), 0xA8);
    return _mm512_permutexvar_epi16(idx, lut);
  }
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * 32))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * 32 + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo, 16..31 from hi
}

template <int MT, int TT, typename Out>
inline void tile_bf16(const Problem& p, const uint16_t* x, const float* xsum, Out* y,
                      int64_t ldy, int64_t t) {
  __m512 acc[TT][MT];
#pragma GCC unroll 8
  for (int tt = 0; tt < TT; ++tt)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[tt][m] = _mm512_setzero_ps();
  const __m512i lut = _mm512_load_si512(kBf16Codes);
  for (int64_t g = 0; g < p.groups; ++g) {
    const uint16_t* xg = x + g * kGroup;
    const uint8_t* c[TT];
#pragma GCC unroll 8
    for (int tt = 0; tt < TT; ++tt) c[tt] = p.codes + ((t + tt) * p.groups + g) * p.group_bytes();
    __m512 dot[TT][MT];
#pragma GCC unroll 8
    for (int tt = 0; tt < TT; ++tt)
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) dot[tt][m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kPairs; ++j) {
      __m512bh w[TT];
#pragma GCC unroll 8
      for (int tt = 0; tt < TT; ++tt) w[tt] = (__m512bh)decode_pair_bf16(c[tt], j, p.bits, lut);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(
            *reinterpret_cast<const int32_t*>(xg + m * p.k + 2 * j));
#pragma GCC unroll 8
        for (int tt = 0; tt < TT; ++tt) dot[tt][m] = _mm512_dpbf16_ps(dot[tt][m], w[tt], xv);
      }
    }
#pragma GCC unroll 8
    for (int tt = 0; tt < TT; ++tt) {
      const int64_t tg = (t + tt) * p.groups + g;
      const __m512 d = load16(p, p.scale, tg);
      const __m512 o = load16(p, p.offset, tg);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        acc[tt][m] = _mm512_fmadd_ps(dot[tt][m], d, acc[tt][m]);
        acc[tt][m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[m * p.groups + g]), acc[tt][m]);
      }
    }
  }
  alignas(64) float out[kTile];
  for (int tt = 0; tt < TT; ++tt) {
    for (int m = 0; m < MT; ++m) {
      _mm512_store_ps(out, acc[tt][m]);
      store_row(y + m * ldy + (t + tt) * kTile, out);
    }
  }
}

template <int MT, int TT, typename Out>
inline void rows_bf16(const Problem& p, const uint16_t* x, const float* xsum, Out* y,
                      int64_t ldy, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + TT <= t1; t += TT) tile_bf16<MT, TT>(p, x, xsum, y, ldy, t);
  for (; t < t1; ++t) tile_bf16<MT, 1>(p, x, xsum, y, ldy, t);
}

template <typename Out>
void tiles_bf16(const Problem& p, const uint16_t* x, const float* xsum, Out* y, int64_t ldy,
                int64_t t0, int64_t t1) {
  int64_t m0 = 0;
  for (; m0 + kRowsBf16 <= p.m; m0 += kRowsBf16)
    rows_bf16<kRowsBf16, 1>(p, x + m0 * p.k, xsum + m0 * p.groups, y + m0 * ldy, ldy, t0, t1);
  const uint16_t* xr = x + m0 * p.k;
  const float* sr = xsum + m0 * p.groups;
  Out* yr = y + m0 * ldy;
  switch (p.m - m0) {
    case 1: rows_bf16<1, 4>(p, xr, sr, yr, ldy, t0, t1); break;
    case 2: rows_bf16<2, 4>(p, xr, sr, yr, ldy, t0, t1); break;
    case 3: rows_bf16<3, 2>(p, xr, sr, yr, ldy, t0, t1); break;
    case 4: rows_bf16<4, 2>(p, xr, sr, yr, ldy, t0, t1); break;
    case 5: rows_bf16<5, 2>(p, xr, sr, yr, ldy, t0, t1); break;
    case 6: rows_bf16<6, 1>(p, xr, sr, yr, ldy, t0, t1); break;
    case 7: rows_bf16<7, 1>(p, xr, sr, yr, ldy, t0, t1); break;
    default: break;
  }
}
#endif  // RADIXRT_QGEMV_BF16

int64_t tiles_grain(const Problem& p) {
  const int64_t weights_per_tile = kTile * p.k;
  return std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(1, weights_per_tile));
}

template <typename Fn>
void for_tiles(const Problem& p, const Fn& fn) {
  const int64_t grain = tiles_grain(p);
  if (p.n_tiles <= grain) {
    fn(0, p.n_tiles);  // small: stay on the calling thread
  } else {
    at::parallel_for(0, p.n_tiles, grain, fn);
  }
}

// Greedy picks (qgemv_argmax): each chunk of tiles, right after computing them, picks every
// row's argmax over its own columns (range_pick, argmax.h: still in this core's cache) into a
// slot it claims; the slots are merged after the call (merge_picks: the order is total, so the
// index is torch.argmax's whatever the chunks). More chunks than slots (a parallel_for that
// split finer than its threads) leaves `overflow` set: the caller then picks over whole rows.
struct ChunkPicks {
  int64_t m, slots;
  std::vector<RowPick> picks;  // [slots, m]
  std::atomic<int64_t> claimed{0};
  std::atomic<bool> overflow{false};

  ChunkPicks(int64_t rows, int64_t max_chunks)
      : m(rows), slots(max_chunks), picks(static_cast<size_t>(rows * max_chunks)) {}

  template <typename Out>
  void pick(const Out* y, int64_t ldy, int64_t c0, int64_t c1) {
    const int64_t s = claimed.fetch_add(1, std::memory_order_acq_rel);
    if (s >= slots) {
      overflow.store(true, std::memory_order_relaxed);
      return;
    }
    for (int64_t r = 0; r < m; ++r) picks[s * m + r] = range_pick(y + r * ldy, c0, c1);
  }
};

Tensor qgemv_impl(const Tensor& x, const Tensor& codes, const Tensor& scale,
                  const Tensor& offset, int64_t bits, Tensor* ids) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemv: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2, "qgemv: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "qgemv: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == 64 * bits,
              "qgemv: codes must be uint8 [N/16, K/32, ", 64 * bits, "], got ", codes.sizes(),
              " ", codes.scalar_type());
  const int64_t n_tiles = codes.size(0), groups = codes.size(1);
  const bool half = scale.scalar_type() == at::kHalf;
  for (const Tensor* s : {&scale, &offset}) {
    TORCH_CHECK((s->scalar_type() == at::kFloat || s->scalar_type() == at::kHalf) &&
                    s->scalar_type() == scale.scalar_type() && s->dim() == 3 &&
                    s->size(0) == n_tiles && s->size(1) == groups && s->size(2) == kTile &&
                    s->is_contiguous(),
                "qgemv: scale / offset must be contiguous [", n_tiles, ", ", groups,
                ", 16], both float32 or both float16, got ", s->sizes(), " ", s->scalar_type());
  }
  TORCH_CHECK(codes.is_contiguous(), "qgemv: codes must be contiguous");
  TORCH_CHECK(x.size(1) == groups * kGroup, "qgemv: x has ", x.size(1),
              " input features, the weight ", groups * kGroup);
  const int64_t m = x.size(0), k = x.size(1), n = n_tiles * kTile;
  Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) == k, "qgemv: x must be contiguous");
  Problem p{m, n_tiles, groups, k, bits, codes.data_ptr<uint8_t>(), scale.data_ptr(),
            offset.data_ptr(), half};
  std::optional<ChunkPicks> chunk_picks;
  if (ids != nullptr) {
    const int64_t chunks = (n_tiles + tiles_grain(p) - 1) / tiles_grain(p);
    chunk_picks.emplace(m, std::clamp<int64_t>(at::get_num_threads(), 1, chunks));
  }
  // fn(t0, t1) computes tiles [t0, t1) into yp; then, with picks, picks over their columns.
  auto picked = [&](auto* yp, const auto& fn) {
    return [&, yp](int64_t t0, int64_t t1) {
      fn(t0, t1);
      if (chunk_picks && t0 < t1) chunk_picks->pick(yp, n, t0 * kTile, t1 * kTile);
    };
  };

#if defined(RADIXRT_QGEMV_BF16)
  const Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  // Per row and group: the sum of x (fp32), for the offset term.
  std::vector<float> xsum(m * groups);
  const at::BFloat16* xh = xb.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < m * groups; ++i) {
    float acc = 0.f;
    for (int64_t e = 0; e < kGroup; ++e) acc += static_cast<float>(xh[i * kGroup + e]);
    xsum[i] = acc;
  }
  const float* sp = xsum.data();
  if (x.scalar_type() == at::kBFloat16) {
    auto* yp = y.data_ptr<at::BFloat16>();
    for_tiles(p, picked(yp, [&](int64_t t0, int64_t t1) {
                tiles_bf16(p, xp, sp, yp, n, t0, t1);
              }));
  } else {
    auto* yp = y.data_ptr<float>();
    for_tiles(p, picked(yp, [&](int64_t t0, int64_t t1) {
                tiles_bf16(p, xp, sp, yp, n, t0, t1);
              }));
  }
#else
  const Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
#if defined(RADIXRT_QGEMV_AVX2)
#define RADIXRT_QGEMV_TILES tiles_avx2
#else
#define RADIXRT_QGEMV_TILES tiles_generic
#endif
  if (x.scalar_type() == at::kBFloat16) {
    auto* yp = y.data_ptr<at::BFloat16>();
    for_tiles(p, picked(yp, [&](int64_t t0, int64_t t1) {
                RADIXRT_QGEMV_TILES(p, xp, yp, n, t0, t1);
              }));
  } else {
    auto* yp = y.data_ptr<float>();
    for_tiles(p, picked(yp, [&](int64_t t0, int64_t t1) {
                RADIXRT_QGEMV_TILES(p, xp, yp, n, t0, t1);
              }));
  }
#undef RADIXRT_QGEMV_TILES
#endif
  if (chunk_picks) {
    int64_t* out = ids->data_ptr<int64_t>();
    const int64_t used = std::min(chunk_picks->claimed.load(), chunk_picks->slots);
    for (int64_t r = 0; r < m; ++r) {
      if (chunk_picks->overflow.load()) {  // some columns were not picked: whole rows
        out[r] = y.scalar_type() == at::kFloat
                     ? row_argmax(y.data_ptr<float>() + r * n, n)
                     : row_argmax(y.data_ptr<at::BFloat16>() + r * n, n);
        continue;
      }
      RowPick pk;
      for (int64_t s = 0; s < used; ++s) pk = merge_picks(pk, chunk_picks->picks[s * m + r]);
      TORCH_CHECK(pk.column >= 0, "qgemv_argmax: row ", r, " was not picked");
      out[r] = pk.index();
    }
  }
  return y;
}

Tensor qgemv(const Tensor& x, const Tensor& codes, const Tensor& scale, const Tensor& offset,
             int64_t bits) {
  return qgemv_impl(x, codes, scale, offset, bits, nullptr);
}

// qgemv and each row's argmax over its outputs (int64 [M]; the index torch.argmax(y.float(), -1)
// gives: the first maximum, a row's first NaN), picked by each chunk of tiles over the columns
// it has just written (see `ChunkPicks`), for an LM head's greedy steps.
std::tuple<Tensor, Tensor> qgemv_argmax(const Tensor& x, const Tensor& codes,
                                        const Tensor& scale, const Tensor& offset, int64_t bits) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(0) > 0, "qgemv_argmax: the weight has no outputs");
  TORCH_CHECK(codes.size(0) * kTile < (int64_t{1} << 24),
              "qgemv_argmax: at most 2^24 outputs (argmax_rows' exact index range)");
  TORCH_CHECK(x.dim() == 2, "qgemv_argmax: x must be [M, K], got ", x.sizes());
  Tensor ids = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return {qgemv_impl(x, codes, scale, offset, bits, nullptr), ids};
  TORCH_CHECK(x.size(1) > 0, "qgemv_argmax: x has no features");
  Tensor y = qgemv_impl(x, codes, scale, offset, bits, &ids);
  return {y, ids};
}

std::string qgemv_isa() {
#if defined(RADIXRT_QGEMV_BF16)
  return "avx512bf16";
#elif defined(RADIXRT_QGEMV_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("qgemv(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits) -> Tensor");
  m.def("qgemv_argmax(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits) -> "
        "(Tensor, Tensor)");
  m.def("qgemv_isa() -> str", &radixrt_cpu::qgemv_isa);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("qgemv", &radixrt_cpu::qgemv);
  m.impl("qgemv_argmax", &radixrt_cpu::qgemv_argmax);
}
