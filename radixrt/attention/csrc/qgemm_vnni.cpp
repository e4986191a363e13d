// Quantized matmul with int8 activations on AVX512-VNNI or AVX2 (llama.cpp's approach), for every row
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
// xq * sx, accumulated in fp32 in group order:
//   affine layout:     y[m, n] = sum_g  d * (sx * dot_i32(u, xq)) + c * S
//   symmetric layout:  y[m, n] = sum_g  d * (sx * (dot_i32(u, xq) - 2^(bits-1) * sum(xq)))
// (symmetric: c = -2^(bits-1) d, GGUF Q4_0 and Q8_0; the offset is folded into the exact integer
// dot, one fp32 product per group instead of two). The integer dot of one group is exact; the
// same instruction sequence computes each output whatever M, the blocking or the thread count,
// so results are independent of the row count (batch-invariant).
//
// Two terms (`terms` = 2, the `vnni-hilo` kernel): each row is quantized as above (the high
// term), then its residual x - xq * sx, exact to one rounding, is quantized the same way with
// its own scale (the low term, at most sx / 254 per step): x ~= xq * sx + xq' * sx', relative
// error per group <= 1/64516 of its absmax, near fp32 activations. The two terms are two rows
// of the quantized layout (row 2r high, 2r + 1 low: "virtual rows"), passed like any two rows
// of the same weights; a pass stores each pair's sum of fp32 accumulators (high + low) as the
// output row r. Integer work doubles, weight traffic does not.
//
// Layout (made once at load time by radixrt/model/quant_matmul.py `pack_vnni`): output features
// in tiles of 16 (vector lanes), one blob per (tile, group), uint8 [N/16, K/32, B]:
//   4-bit: 4 vectors of 64 bytes; vector v, lane n, byte b: low nibble u[n, 32g + 8v + b],
//          high nibble u[n, 32g + 8v + 4 + b]   (two k-quads per vector)
//   8-bit: 8 vectors of 64 bytes; vector v, lane n, byte b: u[n, 32g + 4v + b]
//   then d[16], c[16] as float16 (when exact: GGUF's d and m are fp16) or float32, or d[16]
//   alone as float16 for a symmetric weight: B = 64 * bits + 64 (fp16), + 128 (fp32) or + 32
//   (symmetric, fp16).
// One blob stream per tile keeps decode (M = 1) a few sequential streams.
//
// Cost model (Zen 4, measured): one vpdpbusd zmm per cycle, and vmulps / vfmadd231ps take the
// same two FMA pipes, while loads, broadcasts, the nibble unpack (and, shift), vcvtdq2ps and
// vcvtph2ps run beside them. Per (row, tile, group) there are 8 vpdpbusd and 3 (affine) or 2
// (symmetric) fp32 multiplies, so 73% / 80% of the vpdpbusd peak is the ceiling.
//
// Prefetch: a pass that reads its tiles' weights from memory (the first row block over them)
// prefetches the next TT tiles' blob at the same group as it goes, one pass ahead (the blobs of
// consecutive tiles are contiguous). Measured on Zen 4 over a decode step's matmuls
// (bench/vnni_ab.py --mode pass, 21 reps, two runs): 1.09-1.10x at 1 row, 1.01-1.02x at 8, the
// same at 64 and 512 rows, over none; at least as fast as a fixed 1-16 KiB ahead.
//
// Blocking: MT rows x TT tiles per pass, MT * TT i32 dot and fp32 accumulators in registers:
// 8 x 1 for full 8-row blocks (each unpacked weight vector serves 8 rows), 1 x 4, 2 x 3, 3 x 2,
// 4 x 2, 5..7 x 1 for fewer rows; one row 1 x 1 where the start-up probe set
// g_single_tile_passes (rows_any). The activations are quantized into blocks of 8 rows (one
// pointer and fixed offsets per group). Work items are (row chunk, tile chunk) pairs, balanced
// across threads; in an item, panels of a few tiles are passed by every row block.
//
// One parallel region per call: its threads quantize the activations (shares of the layout
// claimed from a counter), meet at a barrier, then run their work items; a call too small for
// the region quantizes and multiplies on the calling thread. The quantized activations live in
// a per-thread scratch buffer. qgemm_vnni_silu(gate_up [M, 2K]) quantizes silu(gate) * up
// instead of x, computed as radixrt::silu_mul computes it (silu_mul.h), so its result is bitwise
// qgemm_vnni(silu_mul(gate_up)): the one-call decode step's down projections use it.
// Instruction sets: AVX512-VNNI where the compiler has __AVX512VNNI__ (the builder adds
// -mavx512vnni when /proc/cpuinfo lists avx512_vnni): one tile per zmm, vpdpbusd; else AVX2 +
// FMA + F16C: half tiles per ymm, vpmaddubsw (the AVX2 section says how; bitwise the same
// outputs); elsewhere the op refuses with an error and qgemm_vnni_isa() returns "none".

#include <torch_headers.h>  // first: precompiled by the build
#include <c10/util/BFloat16.h>

#include "argmax.h"
#include "silu_mul.h"
#include "team.h"
#include "vec_util.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define RADIXRT_QGEMM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXRT_QGEMM_AVX2 1
#endif
#if defined(RADIXRT_QGEMM_VNNI) || defined(RADIXRT_QGEMM_AVX2)
#define RADIXRT_QGEMM_INT8 1
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;

constexpr int64_t kTile = 16;
constexpr int64_t kGroup = 32;

#if defined(RADIXRT_QGEMM_INT8)
// Activation rows per block of the quantized layout (and the main pass's MT).
constexpr int64_t kRowBlock = 8;
// Rows per work item at most (a multiple of kRowBlock) and weights per item at least.
constexpr int64_t kRowChunk = 96;
constexpr int64_t kMinWeightsPerTask = 1 << 16;
// Tiles per panel when several row blocks pass over the same tiles (see `item`).
constexpr int64_t kPanelTiles = 4;
// Prefetch the next pass's weights (see the top of the file); RADIXRT_VNNI_PREFETCH=0 turns it
// off for such measurements.
#ifndef RADIXRT_VNNI_PREFETCH
#define RADIXRT_VNNI_PREFETCH 1
#endif
constexpr bool kPrefetchNextPass = RADIXRT_VNNI_PREFETCH;
// One tile per pass for one row on the AVX-512 path (rows_any); set by
// qgemm_vnni_single_tile, which the start-up probe calls (radixrt/model/quant_probe.py).
std::atomic<bool> g_single_tile_passes{false};
// Activation quantization (~10 ns per group of 32 on Zen 4): inside the matmul's parallel
// region, one lane of shares per thread (at most kMaxLanes), shares of at least
// kMinGroupsPerShare groups, at most kSharesPerThread per lane (a late-waking thread leaves its
// shares to the others); a call without a parallel matmul quantizes on the calling thread below
// kParallelQuantElems activations.
constexpr int64_t kMinGroupsPerShare = 32;
constexpr int64_t kSharesPerThread = 8;
constexpr int64_t kMaxLanes = 64;
constexpr int64_t kParallelQuantElems = 1 << 15;
// Barrier: pause-spins before yielding the core (~20 ns each on Zen 4: ~40 us).
constexpr int64_t kSpinsBeforeYield = 2000;
// Per-thread scratch for the quantized activations up to this many bytes (64 rows x K 1536:
// 135 KB); above it a call allocates its own.
constexpr int64_t kMaxScratch = 1 << 20;

// The quantized activations, in row blocks of kRowBlock: for block b, group g, row r of the
// block: xq at ((b * groups + g) * kRowBlock + r) * 32 (32 bytes), so that a pass over rows
// [8b, 8b + MT) reads each group's activations at fixed offsets from one pointer; sx, xs and
// corr of row i (8b + r), group g at i * groups + g, so that the rows a team member quantizes
// are a contiguous range of each (team_quantize_then_work). Rows past M in the last block are
// not written nor read.
struct Acts {
  const int8_t* xq;
  const float* sx;
  const float* xs;      // sx * sum(xq): the offset term's factor (affine weights)
  const int32_t* corr;  // -2^(bits-1) * sum(xq): the code offset's dot (symmetric weights)
};

struct Problem {
  int64_t m, n_tiles, groups, bits, blob;  // m: rows of the quantized layout (virtual rows)
  bool half;  // scales are float16 (else float32)
  const uint8_t* w;  // [n_tiles, groups, blob]
  Acts a;
  // Two terms: layout rows 2r, 2r + 1 are output row r's high and low terms; every pass then
  // starts at an even row and takes an even number of rows (row blocks and chunks are even).
  bool pairs = false;
  int64_t code_bytes() const { return 64 * bits; }
};

#if defined(RADIXRT_QGEMM_VNNI)
// ---- AVX512-VNNI: one tile per zmm, vpdpbusd ------------------------------------------------
inline __m512 load_scale(const uint8_t* p, bool half) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

// 16 fp32 lanes to dst; bfloat16 rounds to nearest even (NaN -> 0x7FC0), as c10::BFloat16.
template <typename Out>
inline void store16(Out* dst, __m512 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
}

// acc + the dot products of w's 16 lanes with the 4 activation bytes at x, broadcast by the
// instruction's memory operand (GCC does not fold _mm512_set1_epi32 into vpdpbusd: a separate
// vpbroadcastd per product, measured 1-3% slower).
inline __m512i dpbusd_x(__m512i acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// One pass: rows [m0, m0 + MT) (m0 a multiple of kRowBlock, MT <= kRowBlock), tiles
// [t, t + TT), all groups. Per (row, tile, group): 8 vpdpbusd, then cvt, mul, 2 fma (on Zen 4
// vpdpbusd, vmulps and vfmadd share the two FMA pipes; loads, broadcasts, the nibble unpack and
// the conversions run beside them). `prefetch`: fetch tiles [t + TT, t + 2 TT) group by group.
template <int MT, int TT, int BITS, bool AFFINE, typename Out>
inline void block(const Problem& p, int64_t m0, int64_t t, Out* y, int64_t ldy, bool prefetch) {
  static_assert(MT <= kRowBlock);
  __m512 acc[MT][TT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) acc[m][tt] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t b0 = m0 / kRowBlock * p.groups;
  const int8_t* xg = p.a.xq + b0 * kRowBlock * kGroup;
  const int64_t ls = p.groups;  // row m's group g: sxg[m * ls] once sxg has moved g groups on
  const float* sxg = p.a.sx + m0 * ls;
  const float* xsg = p.a.xs + m0 * ls;
  const int32_t* corrg = p.a.corr + m0 * ls;
  const uint8_t* wb[TT];
#pragma GCC unroll 4
  for (int tt = 0; tt < TT; ++tt) wb[tt] = p.w + (t + tt) * p.groups * p.blob;
  const int64_t sbytes = p.half ? 2 : 4;
  const int64_t ahead = TT * p.groups * p.blob;  // bytes from a tile's group to the next pass's
  prefetch = prefetch && kPrefetchNextPass;
  for (int64_t g = 0; g < p.groups; ++g) {
    if (prefetch) {
#pragma GCC unroll 4
      for (int tt = 0; tt < TT; ++tt)
        for (int64_t o = 0; o < p.blob; o += 64) __builtin_prefetch(wb[tt] + ahead + o, 0, 1);
    }
    __m512i dot[MT][TT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int tt = 0; tt < TT; ++tt)
        dot[m][tt] = AFFINE ? _mm512_setzero_si512() : _mm512_set1_epi32(corrg[m * ls]);
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
        for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
          for (int tt = 0; tt < TT; ++tt) {
            dot[m][tt] = dpbusd_x(dot[m][tt], lo[tt], xg + m * kGroup + 8 * v);
            dot[m][tt] = dpbusd_x(dot[m][tt], hi[tt], xg + m * kGroup + 8 * v + 4);
          }
      }
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        __m512i u[TT];
#pragma GCC unroll 4
        for (int tt = 0; tt < TT; ++tt) u[tt] = _mm512_loadu_si512(wb[tt] + 64 * v);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
          for (int tt = 0; tt < TT; ++tt)
            dot[m][tt] = dpbusd_x(dot[m][tt], u[tt], xg + m * kGroup + 4 * v);
      }
    }
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) {
      const uint8_t* sc = wb[tt] + p.code_bytes();
      const __m512 d = load_scale(sc, p.half);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][tt]), _mm512_set1_ps(sxg[m * ls]));
        acc[m][tt] = _mm512_fmadd_ps(f, d, acc[m][tt]);
      }
      if constexpr (AFFINE) {
        const __m512 c = load_scale(sc + kTile * sbytes, p.half);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m)
          acc[m][tt] = _mm512_fmadd_ps(c, _mm512_set1_ps(xsg[m * ls]), acc[m][tt]);
      }
    }
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) wb[tt] += p.blob;
    xg += kRowBlock * kGroup;
    ++sxg;
    ++xsg;
    ++corrg;
  }
  if constexpr (MT % 2 == 0) {
    if (p.pairs) {  // rows m0 + m, m0 + m + 1: output row (m0 + m) / 2's high and low terms
#pragma GCC unroll 4
      for (int m = 0; m < MT; m += 2)
#pragma GCC unroll 4
        for (int tt = 0; tt < TT; ++tt)
          store16(y + (m0 + m) / 2 * ldy + (t + tt) * kTile,
                  _mm512_add_ps(acc[m][tt], acc[m + 1][tt]));
      return;
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; ++tt) store16(y + (m0 + m) * ldy + (t + tt) * kTile, acc[m][tt]);
}

// Tiles [t0, t1) for MT rows at m0: TT tiles per pass, the rest one by one.
template <int MT, int TT, int BITS, bool AFFINE, typename Out>
inline void rows_pass(const Problem& p, int64_t m0, int64_t t0, int64_t t1, Out* y, int64_t ldy,
                      bool prefetch) {
  int64_t t = t0;
  for (; t + TT <= t1; t += TT) block<MT, TT, BITS, AFFINE>(p, m0, t, y, ldy, prefetch);
  for (; t < t1; ++t) block<MT, 1, BITS, AFFINE>(p, m0, t, y, ldy, prefetch);
}

// `rows` (1 .. kRowBlock) rows at m over tiles [t0, t1): few rows take several tiles per pass
// (each activation broadcast serves them all, more independent dot chains), more rows one tile.
// With g_single_tile_passes one row takes one tile per pass too: each thread then reads its
// weights as one sequential stream instead of 4 interleaved ones (Zen 4, a decode step's
// matmuls from memory: 1.08-1.18x at one row, bench/vnni_ab.py; at 2-4 rows the LM head lost
// its extra dot chains and the whole steps did not gain). Each tile's groups accumulate in the
// same order either way: the outputs are bitwise the same.
template <int BITS, bool AFFINE, typename Out>
inline void rows_any(const Problem& p, int64_t rows, int64_t m, int64_t t0, int64_t t1, Out* y,
                     int64_t ldy, bool prefetch) {
  if (rows == 1 && g_single_tile_passes.load(std::memory_order_relaxed)) {
    return rows_pass<1, 1, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
  }
  switch (rows) {
    case 1: return rows_pass<1, 4, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 2: return rows_pass<2, 3, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 3: return rows_pass<3, 2, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 4: return rows_pass<4, 2, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 5: return rows_pass<5, 1, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 6: return rows_pass<6, 1, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 7: return rows_pass<7, 1, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    case 8: return rows_pass<8, 1, BITS, AFFINE>(p, m, t0, t1, y, ldy, prefetch);
    default: break;
  }
}

// Activations of one group of 32 (float32 or bfloat16) as two fp32 vectors.
template <typename In>
inline void load_group(const In* src, __m512& a, __m512& b) {
  if constexpr (std::is_same_v<In, float>) {
    a = _mm512_loadu_ps(src);
    b = _mm512_loadu_ps(src + 16);
  } else {  // bfloat16: the high half of an fp32 (exact)
    const __m512i raw = _mm512_loadu_si512(src);
    a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
  }
}

static_assert(kVec == kTile, "the AVX512 build's at::vec::Vectorized<float> holds 16 lanes");

// One group (lo, hi: its 32 activations) quantized into `a`: its codes at entry q of xq, its
// scales at entry i of sx, xs and corr (see `Acts`).
inline void quantize_group(__m512 lo, __m512 hi, int64_t q, int64_t i, int32_t code_offset,
                           const Acts& a) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float s = amax / 127.f;
  int8_t* dst = const_cast<int8_t*>(a.xq) + q * kGroup;
  float* sx = const_cast<float*>(a.sx);
  float* xs = const_cast<float*>(a.xs);
  int32_t* corr = const_cast<int32_t*>(a.corr);
  if (s == 0.f) {  // all-zero group (or one too small for a normal scale: rounds to 0)
    std::fill(dst, dst + kGroup, 0);
    sx[i] = 0.f;
    xs[i] = 0.f;
    corr[i] = 0;
    return;
  }
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_div_ps(lo, vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_div_ps(hi, vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  sx[i] = s;
  xs[i] = s * static_cast<float>(sum);
  corr[i] = -code_offset * sum;
}

// What quantize_group leaves of a group (lo, hi), in place: x - round(x / s) * s with its
// scale s and rounding, one rounding (FMA); zero for an all-zero group. The low term's input.
inline void residual_group(__m512& lo, __m512& hi) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float s = amax / 127.f;
  if (s == 0.f) {
    lo = hi = _mm512_setzero_ps();
    return;
  }
  const __m512 vs = _mm512_set1_ps(s);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  lo = _mm512_fnmadd_ps(_mm512_roundscale_ps(_mm512_div_ps(lo, vs), kNearest), vs, lo);
  hi = _mm512_fnmadd_ps(_mm512_roundscale_ps(_mm512_div_ps(hi, vs), kNearest), vs, hi);
}

// quantize_group on the 32 activations at src (`low`: on their residual, residual_group).
template <typename In>
inline void quantize_group_from(const In* src, int64_t q, int64_t i, int32_t code_offset,
                                const Acts& a, bool low) {
  __m512 lo, hi;
  load_group(src, lo, hi);
  if (low) residual_group(lo, hi);
  quantize_group(lo, hi, q, i, code_offset, a);
}

// One row's 16 lanes (argmax.h).
using LanePick = LanePick16;

#endif  // RADIXRT_QGEMM_VNNI

#if defined(RADIXRT_QGEMM_AVX2)
// ---- AVX2 (no VNNI): vpmaddubsw + vpmaddwd in place of vpdpbusd ------------------------------
// Half tiles: a ymm holds 8 of a tile's 16 lanes, so a pass covers half tile h = 2t + s: lanes
// 8s..8s+7 of tile t, i.e. bytes 32s..32s+31 of each 64-byte code vector and scales 8s..8s+7.
// Passes of MT <= 4 rows x HT <= 2 half tiles; at 4 x 2 the integer accumulators fill the 16 ymm registers
// and the fp32 ones spill (touched once a group).
// - 4-bit: vpmaddubsw(u, x) sums two products u * x per int16 lane, at most 2 * 15 * 127 = 3810;
//   a group's 8 such vectors per row add up in int16 (16 products, at most 30480 < 2^15) and are
//   widened once per group (vpmaddwd by ones).
// - 8-bit: u = q + 128 times x could exceed int16 in vpmaddubsw's pair sums, so the signed code
//   q = u ^ 0x80 is used as |q| (unsigned) times sign(x, q): at most 2 * 128 * 127 = 32512, each
//   vector widened at once. That is dot(q, xq) = dot(u, xq) - 128 sum(xq) = dot(u, xq) + corr:
//   the symmetric layout's dot with its correction already in; the affine one adds -corr.
// Every integer dot is exact and the fp32 steps are the VNNI path's, in its order, so both
// builds give bitwise the same outputs.
// Cost (Zen 1, whose 256-bit ops are two 128-bit halves): vpmaddubsw issues on one pipe, so a
// 4-bit group costs 16 vpmaddubsw halves per row and half tile (1 row: ~16 weights a cycle, more
// than one core's share of memory bandwidth delivers).
constexpr int64_t kHalf = 8;
// Keeps an integer accumulator's running sum in the order written. Integer adds are associative,
// so GCC (-O3) otherwise rebuilt each group's chains of vpaddw / vpaddd into trees whose leaves,
// every vpmaddubsw product of the group, were all computed first and spilled to the stack: ~190
// stack accesses per pass, a store per product. Through this empty asm the product is added as
// it is made (same results, bitwise: integer sums are exact). Zen 3, 2 threads, each shape hot,
// interleaved against the old build (bench/vnni_ab.py --mode shapes, two runs): the 4-bit shapes
// 1.19-1.61x at 8, 64 and 512 rows, the 8-bit LM head unchanged; SmolLM2's prefill of 8 x 512
// tokens 741-921 -> 854-1166 tok/s.
#define RADIXRT_KEEP_ORDER(v) __asm__("" : "+x"(v))

inline __m256 load_scale8(const uint8_t* p, bool half) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// 8 fp32 lanes to dst; bfloat16 rounds to nearest even (NaN -> 0x7FC0), as store16.
template <typename Out>
inline void store8(Out* dst, __m256 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm256_storeu_ps(dst, v);
  } else {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
}

// The 4 activation bytes at x in every 32-bit lane.
inline __m256i bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm256_set1_epi32(v);
}

// One pass: rows [m0, m0 + MT) (MT <= 4, inside one row block), half tiles [h0, h0 + HT), all
// groups. `prefetch` (h0 even): fetch the next tile's blob group by group.
template <int MT, int HT, int BITS, bool AFFINE, typename Out>
inline void block_avx2(const Problem& p, int64_t m0, int64_t h0, Out* y, int64_t ldy,
                       bool prefetch) {
  static_assert(MT <= 4 && HT <= 2);
  __m256 acc[MT][HT];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
    for (int ht = 0; ht < HT; ++ht) acc[m][ht] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xg = p.a.xq + ((m0 / kRowBlock) * p.groups * kRowBlock + m0 % kRowBlock) * kGroup;
  const int64_t ls = p.groups;
  const float* sxg = p.a.sx + m0 * ls;
  const float* xsg = p.a.xs + m0 * ls;
  const int32_t* corrg = p.a.corr + m0 * ls;
  const int64_t sbytes = p.half ? 2 : 4;
  const uint8_t* wb[HT];
  int64_t side[HT];
#pragma GCC unroll 2
  for (int ht = 0; ht < HT; ++ht) {
    wb[ht] = p.w + ((h0 + ht) / 2) * p.groups * p.blob;
    side[ht] = (h0 + ht) % 2;
  }
  prefetch = prefetch && kPrefetchNextPass && h0 % 2 == 0;
  const int64_t ahead = p.groups * p.blob;  // a tile's group to the next tile's
  for (int64_t g = 0; g < p.groups; ++g) {
    if (prefetch)
      for (int64_t o = 0; o < p.blob; o += 64) __builtin_prefetch(wb[0] + ahead + o, 0, 1);
    __m256i dot[MT][HT];
    if constexpr (BITS == 4) {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
        for (int ht = 0; ht < HT; ++ht) dot[m][ht] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m256i lo[HT], hi[HT];
#pragma GCC unroll 2
        for (int ht = 0; ht < HT; ++ht) {
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(wb[ht] + 64 * v + 32 * side[ht]));
          lo[ht] = _mm256_and_si256(raw, low4);
          hi[ht] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) {
          const __m256i xl = bcast4(xg + m * kGroup + 8 * v);
          const __m256i xh = bcast4(xg + m * kGroup + 8 * v + 4);
#pragma GCC unroll 2
          for (int ht = 0; ht < HT; ++ht) {
            dot[m][ht] = _mm256_add_epi16(dot[m][ht], _mm256_maddubs_epi16(lo[ht], xl));
            RADIXRT_KEEP_ORDER(dot[m][ht]);
            dot[m][ht] = _mm256_add_epi16(dot[m][ht], _mm256_maddubs_epi16(hi[ht], xh));
            RADIXRT_KEEP_ORDER(dot[m][ht]);
          }
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const __m256i base = AFFINE ? _mm256_setzero_si256() : _mm256_set1_epi32(corrg[m * ls]);
#pragma GCC unroll 2
        for (int ht = 0; ht < HT; ++ht)
          dot[m][ht] = _mm256_add_epi32(base, _mm256_madd_epi16(dot[m][ht], ones));
      }
    } else {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
        for (int ht = 0; ht < HT; ++ht)
          dot[m][ht] = AFFINE ? _mm256_set1_epi32(-corrg[m * ls]) : _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        __m256i q[HT], aq[HT];
#pragma GCC unroll 2
        for (int ht = 0; ht < HT; ++ht) {
          q[ht] = _mm256_xor_si256(
              _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(wb[ht] + 64 * v + 32 * side[ht])),
              flip);
          aq[ht] = _mm256_abs_epi8(q[ht]);
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) {
          const __m256i xb = bcast4(xg + m * kGroup + 4 * v);
#pragma GCC unroll 2
          for (int ht = 0; ht < HT; ++ht) {
            const __m256i pr = _mm256_maddubs_epi16(aq[ht], _mm256_sign_epi8(xb, q[ht]));
            dot[m][ht] = _mm256_add_epi32(dot[m][ht], _mm256_madd_epi16(pr, ones));
            RADIXRT_KEEP_ORDER(dot[m][ht]);
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int ht = 0; ht < HT; ++ht) {
      const uint8_t* sc = wb[ht] + p.code_bytes() + side[ht] * kHalf * sbytes;
      const __m256 d = load_scale8(sc, p.half);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const __m256 f =
            _mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][ht]), _mm256_set1_ps(sxg[m * ls]));
        acc[m][ht] = _mm256_fmadd_ps(f, d, acc[m][ht]);
      }
      if constexpr (AFFINE) {
        const __m256 c = load_scale8(sc + kTile * sbytes, p.half);
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m)
          acc[m][ht] = _mm256_fmadd_ps(c, _mm256_set1_ps(xsg[m * ls]), acc[m][ht]);
      }
    }
#pragma GCC unroll 2
    for (int ht = 0; ht < HT; ++ht) wb[ht] += p.blob;
    xg += kRowBlock * kGroup;
    ++sxg;
    ++xsg;
    ++corrg;
  }
  if constexpr (MT % 2 == 0) {
    // As block's (VNNI). One store helper for both instruction sets, taking the accumulators
    // by reference, ran the one-term passes at 0.83-0.88x (bench/vnni_ab.py, Zen 3, stop 84):
    // the accumulators left the registers. So each section keeps its own.
    if (p.pairs) {
#pragma GCC unroll 2
      for (int m = 0; m < MT; m += 2)
#pragma GCC unroll 2
        for (int ht = 0; ht < HT; ++ht)
          store8(y + (m0 + m) / 2 * ldy + (h0 + ht) * kHalf,
                 _mm256_add_ps(acc[m][ht], acc[m + 1][ht]));
      return;
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
    for (int ht = 0; ht < HT; ++ht) store8(y + (m0 + m) * ldy + (h0 + ht) * kHalf, acc[m][ht]);
}

// Passes of up to 4 rows at m (of `rows`) over HT half tiles from h; the first prefetches.
template <int HT, int BITS, bool AFFINE, typename Out>
inline void passes(const Problem& p, int64_t rows, int64_t m, int64_t h, Out* y, int64_t ldy,
                   bool prefetch) {
  for (int64_t r = 0; r < rows; r += 4) {
    const bool pf = prefetch && r == 0;
    switch (std::min<int64_t>(4, rows - r)) {
      case 1: block_avx2<1, HT, BITS, AFFINE>(p, m + r, h, y, ldy, pf); break;
      case 2: block_avx2<2, HT, BITS, AFFINE>(p, m + r, h, y, ldy, pf); break;
      case 3: block_avx2<3, HT, BITS, AFFINE>(p, m + r, h, y, ldy, pf); break;
      default: block_avx2<4, HT, BITS, AFFINE>(p, m + r, h, y, ldy, pf); break;
    }
  }
}

// `rows` (1 .. kRowBlock) rows at m over tiles [t0, t1): a whole tile (two half tiles) per pass,
// in passes of up to 4 rows that find the tile's weights in L1 after the first. Each activation
// broadcast then serves both halves; the fp32 accumulators of 4 rows spill to the stack (read
// once a group). Measured on Zen 1 (one thread, weights in L2, interleaved in one process):
// 1.07x over half-tile passes of 4 rows at K 576 and 1536.
// 8-bit codes keep half-tile passes for more than one row (their unpacking holds two registers
// a half tile: 0.98x at 64-256 rows as whole tiles).
template <int BITS, bool AFFINE, typename Out>
inline void rows_any(const Problem& p, int64_t rows, int64_t m, int64_t t0, int64_t t1, Out* y,
                     int64_t ldy, bool prefetch) {
  if (BITS == 8 && rows > 1) {
    for (int64_t h = 2 * t0; h < 2 * t1; ++h)
      passes<1, BITS, AFFINE>(p, rows, m, h, y, ldy, prefetch);
    return;
  }
  for (int64_t t = t0; t < t1; ++t) passes<2, BITS, AFFINE>(p, rows, m, 2 * t, y, ldy, prefetch);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The 32 activations at src (float32 or bfloat16) quantized into `a`: codes at entry q of xq,
// scales at entry i of sx, xs and corr; the VNNI path's arithmetic (see quantize_group and, for
// `low`, the residual of the group's own quantization, residual_group there).
template <typename In>
inline void quantize_group_from(const In* src, int64_t q, int64_t i, int32_t code_offset,
                                const Acts& a, bool low) {
  __m256 v[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<In, float>) {
      v[j] = _mm256_loadu_ps(src + 8 * j);
    } else {  // bfloat16: the high half of an fp32 (exact)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * j));
      v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  auto scale = [&] {
    const __m256 mx = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
        _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    return hmax8(mx) / 127.f;
  };
  if (low) {  // the residual of the group's own quantization, as residual_group (VNNI)
    const float s0 = scale();
    const __m256 vs0 = _mm256_set1_ps(s0);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      v[j] = s0 == 0.f ? _mm256_setzero_ps()
                       : _mm256_fnmadd_ps(_mm256_round_ps(_mm256_div_ps(v[j], vs0),
                                                          _MM_FROUND_TO_NEAREST_INT |
                                                              _MM_FROUND_NO_EXC),
                                          vs0, v[j]);
    }
  }
  const float s = scale();
  int8_t* dst = const_cast<int8_t*>(a.xq) + q * kGroup;
  float* sx = const_cast<float*>(a.sx);
  float* xs = const_cast<float*>(a.xs);
  int32_t* corr = const_cast<int32_t*>(a.corr);
  if (s == 0.f) {
    std::fill(dst, dst + kGroup, 0);
    sx[i] = 0.f;
    xs[i] = 0.f;
    corr[i] = 0;
    return;
  }
  const __m256 vs = _mm256_set1_ps(s);
  __m256i qi[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_div_ps(v[j], vs));  // to even
  // Saturating packs interleave per 128-bit lane; the permute restores element order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                            _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const int32_t sum =
      hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
  sx[i] = s;
  xs[i] = s * static_cast<float>(sum);
  corr[i] = -code_offset * sum;
}

// One row's 8 lanes over the columns a run has visited (as argmax.h's 16-lane LanePick16).
struct LanePick {
  __m256 vmax;
  __m256i vidx;
  int64_t first_nan = -1;
  bool started = false;

  void visit8(const float* y, int32_t column) {
    const __m256 v = _mm256_loadu_ps(y);
    const __m256i idx =
        _mm256_add_epi32(_mm256_set1_epi32(column), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (nan != 0 && first_nan < 0) first_nan = column + __builtin_ctz(nan);
    if (!started) {
      vmax = v;
      vidx = idx;
      started = true;
      return;
    }
    const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
    vmax = _mm256_blendv_ps(vmax, v, gt);
    vidx = _mm256_blendv_epi8(vidx, idx, _mm256_castps_si256(gt));
  }

  // A tile's 16 columns from `column`.
  void visit(const float* y, int32_t column) {
    visit8(y, column);
    visit8(y + kHalf, column + static_cast<int32_t>(kHalf));
  }

  RowPick reduce() const {
    if (!started) return RowPick{};
    alignas(32) float m[kHalf];
    alignas(32) int32_t ix[kHalf];
    _mm256_store_ps(m, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ix), vidx);
    return reduce_lanes(m, ix, kHalf, first_nan);
  }
};
#endif  // RADIXRT_QGEMM_AVX2

// Rows [r0, r1) x tiles [t0, t1) (r0 a multiple of kRowBlock): panels of kPanelTiles tiles, row
// blocks inner (a panel's weights come from memory once, from cache for the other blocks; an
// 8-row block's activations stay in L1 across the panel: 1.05x over 1-tile panels at 64 rows).
// Only a panel's first row block prefetches (the others find the weights in cache).
template <int BITS, bool AFFINE, typename Out>
void item(const Problem& p, int64_t r0, int64_t r1, int64_t t0, int64_t t1, Out* y, int64_t ldy) {
  if (r1 - r0 <= kRowBlock) return rows_any<BITS, AFFINE>(p, r1 - r0, r0, t0, t1, y, ldy, true);
  for (int64_t ts = t0; ts < t1; ts += kPanelTiles) {
    const int64_t te = std::min(t1, ts + kPanelTiles);
    for (int64_t m = r0; m < r1; m += kRowBlock)
      rows_any<BITS, AFFINE>(p, std::min(kRowBlock, r1 - m), m, ts, te, y, ldy, m == r0);
  }
}

// The activation rows a call quantizes: x [M, K] itself (SILU false), or silu(gate) * up of
// gate_up [M, 2K] = [gate | up] (SILU true) rounded to In, element for element what
// radixrt::silu_mul stores (silu_mul.h), so that the quantized activations, and the result, are
// bitwise those of qgemm_vnni(silu_mul(gate_up)).
template <typename In, bool SILU>
struct ActRows {
  static constexpr bool kSilu = SILU;
  const In* x;
  int64_t ld;        // elements from one row to the next
  int64_t k;         // activation features per row
  int64_t vec_end;   // SILU: features [0, vec_end) take silu_mul's vector path

  // SILU: groups [g0, g1) of row r as fp32 into buf, 2 * kVec elements at a time (vec_end is a
  // multiple of that). One tight loop, as silu_mul's (measured: 1.3x the SiLU speed
  // of computing it group by group between the quantization steps).
  void silu_groups(int64_t r, int64_t g0, int64_t g1, float* buf) const {
    const In* row = x + r * ld;
    for (int64_t i = g0 * kGroup; i < g1 * kGroup; i += 2 * kVec, buf += 2 * kVec) {
      if (i < vec_end) {
        Vec lo, hi;
        silu_times_up<In>(row + i, row + k + i, lo, hi);
        round_pair<In>(lo, hi);
        lo.store(buf);
        hi.store(buf + kVec);
      } else {
        for (int64_t j = 0; j < 2 * kVec; ++j)
          buf[j] = round_to<In>(silu_times_up_scalar<In>(row[i + j], row[k + i + j]));
      }
    }
  }
};

// Groups of one row quantized per run of this many (SILU: the run's products buffered first).
constexpr int64_t kRunGroups = 16;

// Bytes of the quantized activations of m rows of `groups` groups (see `Acts`, `acts_at`).
inline int64_t acts_bytes(int64_t m, int64_t groups) {
  return (m + kRowBlock - 1) / kRowBlock * groups * kRowBlock * (kGroup + 3 * 4);
}

// `Acts` over a buffer of acts_bytes(m, groups): xq int8 [B, G, 8, 32], then sx, S float32 and
// corr int32 [B * 8, G] each; B = ceil(M / 8).
inline Acts acts_at(uint8_t* base, int64_t m, int64_t groups) {
  const int64_t n = (m + kRowBlock - 1) / kRowBlock * groups * kRowBlock;
  const float* sx = reinterpret_cast<const float*>(base + n * kGroup);
  return {reinterpret_cast<const int8_t*>(base), sx, sx + n,
          reinterpret_cast<const int32_t*>(sx + 2 * n)};
}

// Units [u0, u1) of the quantized layout quantized into `a`, unit u = (row block u / groups,
// group u % groups): that group of the block's rows in [r0, r1) (rows past m are not written).
// Within a block, rows outer (each row's groups are read in order: measured 1.3x faster on 2
// threads than groups outer). `code_offset` is 2^(bits-1), the symmetric weights' code offset.
// Each (row, group) depends on its own 32 values only: any split gives the same bytes.
// Rows here are the layout's: with `terms` 2, row r is input row r / 2's high (even) or low
// (odd) term.
template <typename Src>
void quantize_units(const Src& src, int64_t u0, int64_t u1, int64_t r0, int64_t r1,
                    int64_t groups, int32_t code_offset, int64_t terms, const Acts& a) {
  alignas(64) float buf[kRunGroups * kGroup];
  for (int64_t b = u0 / groups; b * groups < u1; ++b) {
    const int64_t g0 = std::max<int64_t>(u0 - b * groups, 0);
    const int64_t g1 = std::min<int64_t>(u1 - b * groups, groups);
    const int64_t rows = std::min(kRowBlock, r1 - b * kRowBlock);
    for (int64_t rr = std::max<int64_t>(0, r0 - b * kRowBlock); rr < rows; ++rr) {
      const int64_t r = b * kRowBlock + rr, xr = r / terms;
      const bool low = r % terms == 1;
      for (int64_t gs = g0; gs < g1; gs += kRunGroups) {
        const int64_t ge = std::min(g1, gs + kRunGroups);
        if constexpr (Src::kSilu) src.silu_groups(xr, gs, ge, buf);
        for (int64_t g = gs; g < ge; ++g) {
          const int64_t q = (b * groups + g) * kRowBlock + rr, i = r * groups + g;
          if constexpr (Src::kSilu) {
            quantize_group_from(buf + (g - gs) * kGroup, q, i, code_offset, a, low);
          } else {
            quantize_group_from(src.x + xr * src.ld + g * kGroup, q, i, code_offset, a, low);
          }
        }
      }
    }
  }
}

// The activation input of one call: x [M, K] or gate_up [M, 2K] (`silu`), contiguous, float32
// or bfloat16; quantize(u0, u1) quantizes units [u0, u1) of the layout (see quantize_units),
// quantize_rows(r0, r1) rows [r0, r1).
struct ActInput {
  const Tensor& x;
  bool silu;
  int64_t m, k, groups;  // m: the layout's rows, x's rows times `terms`
  int32_t code_offset;
  Acts acts;
  int64_t terms = 1;  // 1, or 2: high and low terms per input row (see the top of the file)

  int64_t units() const { return (m + kRowBlock - 1) / kRowBlock * groups; }

  void quantize(int64_t u0, int64_t u1) const { quantize_units_rows(u0, u1, 0, m); }

  void quantize_rows(int64_t r0, int64_t r1) const {
    quantize_units_rows(r0 / kRowBlock * groups, (r1 + kRowBlock - 1) / kRowBlock * groups, r0,
                        r1);
  }

  void quantize_units_rows(int64_t u0, int64_t u1, int64_t r0, int64_t r1) const {
    auto run = [&](auto* xp, auto silu_tag) {
      using In = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      constexpr bool kSilu = decltype(silu_tag)::value;
      const ActRows<In, kSilu> src{xp, x.size(1), k, kSilu ? silu_mul_vec_end<In>(k) : 0};
      quantize_units(src, u0, u1, r0, r1, groups, code_offset, terms, acts);
    };
    if (x.scalar_type() == at::kFloat) {
      silu ? run(x.data_ptr<float>(), std::true_type{})
           : run(x.data_ptr<float>(), std::false_type{});
    } else {
      silu ? run(x.data_ptr<at::BFloat16>(), std::true_type{})
           : run(x.data_ptr<at::BFloat16>(), std::false_type{});
    }
  }

  // Every unit, on the calling thread, or split over the threads above kParallelQuantElems.
  void quantize_all() const {
    if (m * k < kParallelQuantElems) return quantize(0, units());
    at::parallel_for(0, units(), std::max<int64_t>(1, kMinGroupsPerShare / kRowBlock),
                     [&](int64_t u0, int64_t u1) { quantize(u0, u1); });
  }
};

// Scratch for the quantized activations of the calling thread's calls, grown to the largest one
// up to kMaxScratch bytes and reused (a call's workers read it only inside that call's parallel
// region); a larger (prefill-sized) call allocates a tensor of its own, held in `owned`.
// In a team the buffer is the team's (its members share it), or the member's own (`own`: a
// member that quantizes every row itself).
uint8_t* acts_buffer(int64_t bytes, Tensor& owned, bool own) {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint8_t, Free> buf;
  thread_local int64_t capacity = 0;
  if (TeamMember* m = team_member()) {
    owned = m->empty({bytes}, at::TensorOptions().dtype(at::kByte), own);
    return owned.data_ptr<uint8_t>();
  }
  if (bytes > kMaxScratch) {
    owned = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    return owned.data_ptr<uint8_t>();
  }
  if (bytes > capacity) {
    const int64_t cap = (std::max<int64_t>(bytes, 64 << 10) + 63) & ~int64_t{63};
    buf.reset(static_cast<uint8_t*>(std::aligned_alloc(64, cap)));
    capacity = buf ? cap : 0;
    TORCH_CHECK(buf, "qgemm_vnni: cannot allocate ", cap, " bytes of scratch");
  }
  return buf.get();
}

// Waits until `done` reaches `target`: spins (pause) a while, then yields the core, so that a
// peer preempted by another process does not cost a whole time slice of spinning.
inline void wait_for(const std::atomic<int64_t>& done, int64_t target) {
  for (int64_t spins = 0; done.load(std::memory_order_acquire) < target; ++spins) {
    if (spins < kSpinsBeforeYield) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// A share counter on its own cache line.
struct alignas(64) ShareCounter {
  std::atomic<int64_t> next;
};

// Greedy picks fused into a float32 call (qgemm_vnni_f32_argmax: an LM head and the argmax of
// its logits): each run of work items (one per thread) keeps, for every row it computes, the
// largest value of each of 16 lanes and the first column reaching it (only a strictly greater
// value replaces, and a run visits a row's columns in increasing order), plus the row's first
// NaN, reading each item's outputs right after the item wrote them (still in L1). The runs'
// (value, column) pairs are reduced after the call by the largest value, then the lowest
// column; a row holding a NaN gives its first NaN. That is a total order, so the pick is the
// same whatever the runs: torch.argmax's (and radixrt::argmax_rows's) index (`RowPick`,
// `merge_picks`: argmax.h).

// quantize_then_work on a decode team (team.h): each member quantizes its equal share of the
// rows (m.rows, the row split of the team's row ops), the team meets, each member runs its
// equal run of the items, then takes the others' last ones (TeamMember::run_items;
// `first_only`: the first member runs them all), and the team meets again. No counter shared
// by every member hands out the items: two cores without a common cache would pass its line
// back and forth once per item. A member reads only its own rows of the input, so a row op
// before (an RMSNorm) need not meet the team first (TeamMember::rows_stay). `whole` (TeamMember::quantize_whole): each member
// quantizes every row into its own buffer instead, and the first meeting goes.
template <typename W>
void team_quantize_then_work(TeamMember& m, const ActInput& in, int64_t items, bool first_only,
                             bool whole, const W& work) {
  if (whole) {
    if (!first_only || m.id == 0) in.quantize(0, in.units());  // only who runs items reads it
  } else {  // the member's input rows (as its row ops split them), each row's terms
    const auto [r0, r1] = m.rows(in.m / in.terms);
    if (r0 < r1) in.quantize_rows(r0 * in.terms, r1 * in.terms);
    m.barrier();
  }
  if (first_only) {
    if (m.id == 0) work(0, items);
  } else {  // an item reads the quantized rows, complete at the meeting above (or its own)
    const auto [i0, i1] = m.rows(items);
    m.run_items(i0, i1, [&](int64_t i) { work(i, i + 1); });
  }
  m.barrier();
}

// One parallel region for a call: the activation quantization, a barrier (every share done),
// then work(i0, i1) on this thread's equal run of the `items` work items (`slots` runs).
// The layout's units are split into `lanes` contiguous ranges (one per slot, at most
// kMaxLanes), each into shares claimed from the lane's counter: a thread takes its own lane's
// shares first (the rows its own work items read, so they stay in its cache), then helps the
// others. A thread waits only for shares another thread has claimed and is quantizing, so the
// barrier holds however torch runs the region: one thread per slot, fewer threads than slots
// (a nested region runs the whole range on the caller: it claims every share and waits for
// nothing), or one.
template <typename W>
void quantize_then_work(const ActInput& in, int64_t items, int64_t slots, const W& work) {
  const int64_t units = in.units(), groups = in.m * in.groups;
  const int64_t lanes =
      std::clamp<int64_t>(groups / kMinGroupsPerShare, 1, std::min(slots, kMaxLanes));
  const int64_t per_lane =
      std::clamp<int64_t>(groups / kMinGroupsPerShare / lanes, 1, kSharesPerThread);
  const int64_t shares = lanes * per_lane;
  ShareCounter lane_next[kMaxLanes];
  for (int64_t l = 0; l < lanes; ++l) lane_next[l].next.store(0, std::memory_order_relaxed);
  std::atomic<int64_t> done{0};
  at::parallel_for(0, slots, 1, [&](int64_t s0, int64_t s1) {
    const int64_t own = s0 * lanes / slots;
    for (int64_t o = 0; o < lanes; ++o) {
      const int64_t lane = (own + o) % lanes, base = lane * per_lane;
      std::atomic<int64_t>& next = lane_next[lane].next;
      for (int64_t j = next.fetch_add(1, std::memory_order_relaxed); j < per_lane;
           j = next.fetch_add(1, std::memory_order_relaxed)) {
        in.quantize((base + j) * units / shares, (base + j + 1) * units / shares);
        done.fetch_add(1, std::memory_order_release);
      }
    }
    wait_for(done, shares);
    work(s0 * items / slots, s1 * items / slots);
  });
}
#endif  // RADIXRT_QGEMM_INT8

const Tensor checked_x(const Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == 2, op, ": ", name, " must be 2-D [M, features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, op, ": ", name, "'s features (", x.size(1),
              ") must be a multiple of ", kGroup);
  return x.contiguous();
}

// (xq int8 [M, K], sx float32 [M, K/32], S = sx * sum(xq) float32 [M, K/32]): the activation
// quantization qgemm_vnni applies (exposed for tests and references).
// `terms`, checked: 1 or 2 int8 terms per activation.
int64_t checked_terms(int64_t terms, const char* op) {
  TORCH_CHECK(terms == 1 || terms == 2, op, ": terms must be 1 or 2, got ", terms);
  return terms;
}

// With `terms` 2, [2M, ...]: row 2r input row r's high term, 2r + 1 its low term.
std::tuple<Tensor, Tensor, Tensor> qgemm_vnni_quantize(const Tensor& x, int64_t terms) {
  const Tensor xc = checked_x(x, "qgemm_vnni", "x");
  checked_terms(terms, "qgemm_vnni_quantize");
#if defined(RADIXRT_QGEMM_INT8)
  const int64_t m = xc.size(0) * terms, k = xc.size(1), groups = k / kGroup;
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  const Tensor buf = at::empty({acts_bytes(m, groups)}, xc.options().dtype(at::kByte));
  const ActInput in{xc, false, m, k, groups, 1 << 3, acts_at(buf.data_ptr<uint8_t>(), m, groups),
                    terms};
  in.quantize_all();
  const int64_t rows = blocks * kRowBlock, n = blocks * groups * kRowBlock;
  const Tensor xq = buf.narrow(0, 0, n * kGroup).view(at::kChar);
  const Tensor sxs = buf.narrow(0, n * kGroup, 2 * n * 4).view(at::kFloat);
  auto rows_first = [&](const Tensor& t) {  // [B * 8, G] -> [M, G]
    return t.view({rows, groups}).narrow(0, 0, m).contiguous();
  };
  return {xq.view({blocks, groups, kRowBlock, kGroup}).permute({0, 2, 1, 3})
              .reshape({rows, k}).narrow(0, 0, m).contiguous(),
          rows_first(sxs.narrow(0, 0, n)), rows_first(sxs.narrow(0, n, n))};
#else
  TORCH_CHECK(false, "qgemm_vnni: this kernel library was built without AVX2 or AVX512-VNNI");
#endif
}

// packed's blob bytes, checked against `bits` (see the layout in the header).
int64_t checked_blob(const Tensor& packed, int64_t bits, const char* op) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              op, ": packed must be contiguous uint8 [N/16, K/32, bytes], got ", packed.sizes(),
              " ", packed.scalar_type());
  const int64_t code_bytes = 64 * bits, blob = packed.size(2);
  TORCH_CHECK(blob == code_bytes + 32 || blob == code_bytes + 64 || blob == code_bytes + 128,
              op, ": packed's last dim must be ", code_bytes + 32, " (symmetric, fp16 "
              "scales), ", code_bytes + 64, " (fp16 scales and offsets) or ", code_bytes + 128,
              " (fp32) for ", bits, "-bit codes, got ", blob);
  return blob;
}

// y [M, N] = a @ W^T for the activations `a` of xc: xc itself (K = xc.size(1)) or, `silu`,
// silu(gate) * up of xc = [gate | up] (K = xc.size(1) / 2); shapes and dtypes checked.
// `f32_out`: y in float32 whatever x's dtype (the fp32 accumulators as they are; otherwise they
// are rounded to x's dtype on store, so a bf16 call's result is this one's rounded to bf16).
// `picks` (f32_out only): each row's argmax over y into it (int64 [m], see `Picks`).
// `terms`: 1, or 2 (high and low int8 terms per activation, see the top of the file).
Tensor qgemm_vnni_impl(const Tensor& xc, bool silu, const Tensor& packed, int64_t bits,
                       int64_t blob, int64_t terms, bool f32_out = false,
                       int64_t* picks = nullptr) {
#if defined(RADIXRT_QGEMM_INT8)
  const int64_t code_bytes = 64 * bits;
  const int64_t rows = xc.size(0), k = packed.size(1) * kGroup, n_tiles = packed.size(0);
  const int64_t n = n_tiles * kTile;
  const int64_t m = rows * terms;  // the quantized layout's rows, which the work items split
  TeamMember* member = team_member();
  const bool whole = member != nullptr && member->quantize_whole;
  if (member != nullptr) member->quantize_whole = false;
  Tensor y = team_empty({rows, n}, f32_out ? xc.options().dtype(at::kFloat) : xc.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  Tensor owned;  // the quantized activations' buffer when not the thread's scratch
  const ActInput in{xc, silu, m, k, k / kGroup, int32_t{1} << (bits - 1),
                    acts_at(acts_buffer(acts_bytes(m, k / kGroup), owned, whole), m, k / kGroup),
                    terms};
  const bool affine = blob != code_bytes + 32;
  const Problem p{m, n_tiles, k / kGroup, bits, blob, blob != code_bytes + 128,
                  packed.data_ptr<uint8_t>(), in.acts, terms == 2};
  // Work items: row chunks x tile chunks, row-chunk-major (a thread's consecutive items share
  // activations). Row chunks: equal shares of at most kRowChunk rows, in whole row blocks. Tile
  // chunks: at least kMinWeightsPerTask weight-rows of work each, sizes within one tile of each
  // other, and as many as a multiple of the thread count when the row chunks are not (each
  // thread takes an equal contiguous run of items).
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk;
  const int64_t row_chunk =
      ((m + row_chunks - 1) / row_chunks + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t threads = member ? member->size : std::max<int64_t>(1, at::get_num_threads());
  const int64_t tiles_per_item = std::clamp<int64_t>(
      kMinWeightsPerTask / std::max<int64_t>(1, kTile * k * std::min(m, row_chunk)), 4, 64);
  int64_t tile_chunks = (n_tiles + tiles_per_item - 1) / tiles_per_item;
  if (row_chunks % threads) tile_chunks = (tile_chunks + threads - 1) / threads * threads;
  tile_chunks = std::min(tile_chunks, n_tiles);
  const int64_t items = row_chunks * tile_chunks;
  // In a team: team_quantize_then_work (a serial call's items all on the first member). Else
  // one thread quantizes, then runs every item, or one parallel region quantizes (split over
  // its threads), waits for all of it, and runs the items.
  const bool serial = items == 1 || threads == 1 || m * n * k < 2 * kMinWeightsPerTask;
  // One run per thread at most (quantize_then_work's slots, or one; never in a team).
  std::optional<Picks> pick_runs;
  if (picks != nullptr) {
    pick_runs.emplace(rows, std::min(threads, items), "qgemm_vnni_f32_argmax");
  }
  auto run = [&](auto* yp) {
    using Out = std::remove_pointer_t<decltype(yp)>;
    auto work = [&](int64_t i0, int64_t i1) {
      std::vector<LanePick> lanes;
      if constexpr (std::is_same_v<Out, float>) {
        if (pick_runs && i0 < i1) lanes.resize(static_cast<size_t>(rows));
      }
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t rc = i / tile_chunks, tc = i % tile_chunks;
        const int64_t r0 = rc * row_chunk, r1 = std::min(m, r0 + row_chunk);
        const int64_t t0 = tc * n_tiles / tile_chunks, t1 = (tc + 1) * n_tiles / tile_chunks;
        if (r0 >= r1) continue;
        if (bits == 4) {
          affine ? item<4, true>(p, r0, r1, t0, t1, yp, n) : item<4, false>(p, r0, r1, t0, t1, yp, n);
        } else {
          affine ? item<8, true>(p, r0, r1, t0, t1, yp, n) : item<8, false>(p, r0, r1, t0, t1, yp, n);
        }
        if constexpr (std::is_same_v<Out, float>) {
          if (!lanes.empty()) {  // the output rows of layout rows [r0, r1)
            for (int64_t r = r0 / terms; r < r1 / terms; ++r)
              for (int64_t t = t0; t < t1; ++t)
                lanes[r].visit(yp + r * n + t * kTile, static_cast<int32_t>(t * kTile));
          }
        }
      }
      if (!lanes.empty()) {
        const int64_t slot = pick_runs->claim();
        for (int64_t r = 0; r < rows; ++r) pick_runs->runs[slot * rows + r] = lanes[r].reduce();
      }
    };
    if (member != nullptr) {
      team_quantize_then_work(*member, in, items, serial, whole, work);
    } else if (serial) {
      in.quantize_all();
      work(0, items);
    } else {
      quantize_then_work(in, items, std::min(threads, items), work);
    }
  };
  if (y.scalar_type() == at::kBFloat16) {
    run(y.data_ptr<at::BFloat16>());
  } else {
    run(y.data_ptr<float>());
  }
  if (pick_runs) pick_runs->finish(picks);
  return y;
#else
  TORCH_CHECK(false, "qgemm_vnni: this kernel library was built without AVX2 or AVX512-VNNI");
#endif
}

// x [M, K] @ W^T, checked and named `op` in errors; `f32_out` as in qgemm_vnni_impl.
Tensor qgemm_vnni_x(const Tensor& x, const Tensor& packed, int64_t bits, const char* op,
                    bool f32_out, int64_t terms) {
  const int64_t blob = checked_blob(packed, bits, op);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * kGroup, op, ": x must be [M, ",
              packed.size(1) * kGroup, "] for this weight, got ", x.sizes());
  return qgemm_vnni_impl(checked_x(x, op, "x"), false, packed, bits, blob,
                         checked_terms(terms, op), f32_out);
}

Tensor qgemm_vnni(const Tensor& x, const Tensor& packed, int64_t bits, int64_t terms) {
  return qgemm_vnni_x(x, packed, bits, "qgemm_vnni", false, terms);
}

// qgemm_vnni with float32 output (LM heads: logits without a rounding to the model dtype).
Tensor qgemm_vnni_f32(const Tensor& x, const Tensor& packed, int64_t bits, int64_t terms) {
  return qgemm_vnni_x(x, packed, bits, "qgemm_vnni_f32", true, terms);
}

// qgemm_vnni_f32 and each row's argmax over its outputs (int64 [M]): torch.argmax(y, -1)'s
// index (the first maximum; a row holding a NaN gives its first NaN), for greedy steps. Each
// thread reads back the outputs it has just written (see `Picks`), so the logits are not read
// again from another core's cache.
std::tuple<Tensor, Tensor> qgemm_vnni_f32_argmax(const Tensor& x, const Tensor& packed,
                                                 int64_t bits, int64_t terms) {
  const char* op = "qgemm_vnni_f32_argmax";
  checked_terms(terms, op);
  // A team's members each run the op with picks of their own: they would not be merged.
  TORCH_CHECK(team_member() == nullptr, op, ": not inside a decode team");
  const int64_t blob = checked_blob(packed, bits, op);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * kGroup, op, ": x must be [M, ",
              packed.size(1) * kGroup, "] for this weight, got ", x.sizes());
  TORCH_CHECK(packed.size(0) > 0, op, ": the weight has no output features");
  TORCH_CHECK(packed.size(0) * kTile < (int64_t{1} << 31), op, ": at most 2^31 outputs");
  const Tensor xc = checked_x(x, op, "x");
  Tensor ids = at::empty({xc.size(0)}, xc.options().dtype(at::kLong));
  if (xc.size(0) == 0) {
    return {qgemm_vnni_impl(xc, false, packed, bits, blob, terms, true), ids};
  }
  TORCH_CHECK(xc.size(1) > 0, op, ": x has no features");
  Tensor y =
      qgemm_vnni_impl(xc, false, packed, bits, blob, terms, true, ids.data_ptr<int64_t>());
  return {y, ids};
}

// qgemm_vnni(silu_mul(gate_up), packed, bits), bitwise, without the intermediate: the SiLU-mul
// is computed as the activations are quantized (see ActRows).
Tensor qgemm_vnni_silu(const Tensor& gate_up, const Tensor& packed, int64_t bits,
                       int64_t terms) {
  const int64_t blob = checked_blob(packed, bits, "qgemm_vnni_silu");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == 2 * packed.size(1) * kGroup,
              "qgemm_vnni_silu: gate_up must be [M, ", 2 * packed.size(1) * kGroup,
              "] (gate, then up) for this weight, got ", gate_up.sizes());
  return qgemm_vnni_impl(checked_x(gate_up, "qgemm_vnni_silu", "gate_up"), true, packed, bits,
                         blob, checked_terms(terms, "qgemm_vnni_silu"));
}

// Sets whether one row takes one tile per pass (AVX-512 path only: the AVX2 path's passes are
// its own); returns the previous setting. The outputs are bitwise the same either way.
bool qgemm_vnni_single_tile(bool enable) {
#if defined(RADIXRT_QGEMM_INT8)
  return g_single_tile_passes.exchange(enable);
#else
  (void)enable;  // a generic build's op refuses every call anyway
  return false;
#endif
}

std::string qgemm_vnni_isa() {
#if defined(RADIXRT_QGEMM_VNNI)
  return "avx512vnni";
#elif defined(RADIXRT_QGEMM_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("qgemm_vnni(Tensor x, Tensor packed, int bits, int terms=1) -> Tensor");
  m.def("qgemm_vnni_f32(Tensor x, Tensor packed, int bits, int terms=1) -> Tensor");
  m.def("qgemm_vnni_f32_argmax(Tensor x, Tensor packed, int bits, int terms=1) -> "
        "(Tensor, Tensor)");
  m.def("qgemm_vnni_silu(Tensor gate_up, Tensor packed, int bits, int terms=1) -> Tensor");
  m.def("qgemm_vnni_quantize(Tensor x, int terms=1) -> (Tensor, Tensor, Tensor)");
  m.def("qgemm_vnni_isa() -> str", &radixrt_cpu::qgemm_vnni_isa);
  m.def("qgemm_vnni_single_tile(bool enable) -> bool", &radixrt_cpu::qgemm_vnni_single_tile);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("qgemm_vnni", &radixrt_cpu::qgemm_vnni);
  m.impl("qgemm_vnni_f32", &radixrt_cpu::qgemm_vnni_f32);
  m.impl("qgemm_vnni_f32_argmax", &radixrt_cpu::qgemm_vnni_f32_argmax);
  m.impl("qgemm_vnni_silu", &radixrt_cpu::qgemm_vnni_silu);
  m.impl("qgemm_vnni_quantize", &radixrt_cpu::qgemm_vnni_quantize);
}
