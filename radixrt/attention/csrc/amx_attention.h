// bf16 attention over blocks of 64 keys on AMX tiles (TDPBF16PS): the extend kernel's path for
// bf16 pools on CPUs with AMX-BF16 (extend_attention.cpp), the same work items and state as
// fma_attention::attend.
//
// `attend` continues each query row's online-softmax state (running max m, sum l, unnormalized
// output o, fp32) over keys 0..key_end of one KV head, read in place from the pool rows
// `slot_of(j)`. Per block of 64 keys:
// - K and V are packed once for all of the item's rows into the tiles' VNNI layout (K: pairs
//   of head dims of 16 keys, by transposing 32-bit pairs in registers; V: the rows of keys 2i and
//   2i + 1 interleaved);
// - S = Q Kᵀ per tile of 16 query rows (bf16 queries as given, exact products, fp32 sums), then
//   scaled by `scale` in fp32;
// - the row-wise online softmax of fma_attention (the causal limit applied per row inside the
//   blocks that cross it);
// - O = O alpha + P V with P rounded to bf16 (as the vdpbf16ps path and GPU flash attention do).
// A row's arithmetic depends only on its own query and keys (blocks start at multiples of
// kKeyBlock from key 0; a tile's rows never mix), never on the other rows, the thread or the
// call.
//
// Requires amx_usable() (amx_tiles.h); callers take another path where it is false.

#pragma once

#include "amx_tiles.h"
#include "fma_attention.h"
#include "vec_util.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXRT_AMX_ATTENTION 1
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace amx_attention {

// Per-thread buffers (grown to the largest call): fp32 scores and bf16 P of the rows padded to
// whole tiles, the packed K and V of a block, per-row alpha; attend_copying's queries and
// outputs with slack rows.
// Declared in every build (callers keep one beside their other scratch), used where AMX is.
struct Scratch {
  std::vector<uint16_t> q, p, k;
  std::vector<float> o, s, alpha;
};

#ifdef RADIXRT_AMX_ATTENTION

using fma_attention::kKeyBlock;
using fma_attention::kNegInf;
static_assert(kKeyBlock == 64, "four 16-key score tiles and two 32-key value tiles per block");

using radixrt_cpu::amx_usable;

// Head dims the tiles take: whole 32-element chunks of Q·Kᵀ, P·V in slices of at most four
// output tiles (beside P and V: 8 tile registers).
constexpr bool supports_head_dim(int64_t D) { return D == 32 || D == 64 || D == 96 || D == 128; }

using radixrt_cpu::TileConfig;  // every tile 16 rows x 64 bytes

// K rows of keys j0 .. j0 + 63 (nb real, zeros after) -> B tiles of S = Q Kᵀ: for head-dim chunk
// c (32 dims) and key tile t (16 keys), row i holds dims (2i, 2i + 1) of the tile's 16 keys.
template <int D, typename RowOf>
inline void pack_k(const RowOf& row_of, int64_t nb, uint16_t* out) {
  for (int t = 0; t < 4; ++t) {
    for (int c = 0; c < D / 32; ++c) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t j = t * 16 + i;
        r[i] = j < nb ? _mm512_castsi512_ps(_mm512_loadu_si512(row_of(j) + c * 32))
                      : _mm512_setzero_ps();
      }
      fma_attention::transpose16(r);
      uint16_t* tile = out + (c * 4 + t) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + i * 32, r[i]);
    }
  }
}

// V rows of keys j0 .. j0 + 63 (nb real, zeros after) -> B tiles of O += P V: for key tile u
// (32 keys) and dim tile d (16 dims), row i holds keys (2i, 2i + 1) of each of the 16 dims.
template <int D, typename RowOf>
inline void pack_v(const RowOf& row_of, int64_t nb, uint16_t* out) {
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int u = 0; u < 2; ++u) {
    for (int i = 0; i < 16; ++i) {
      const int64_t j = u * 32 + 2 * i;
      for (int c = 0; c < D / 32; ++c) {
        const __m512i x = j < nb ? _mm512_loadu_si512(row_of(j) + c * 32) : _mm512_setzero_si512();
        const __m512i y =
            j + 1 < nb ? _mm512_loadu_si512(row_of(j + 1) + c * 32) : _mm512_setzero_si512();
        const __m512i a = _mm512_unpacklo_epi16(x, y), b = _mm512_unpackhi_epi16(x, y);
        // dims 32c + 0..15 and 32c + 16..31 of the pair, in order
        _mm512_storeu_si512(out + ((u * (D / 16) + 2 * c) * 16 + i) * 32,
                            _mm512_permutex2var_epi64(a, lo_idx, b));
        _mm512_storeu_si512(out + ((u * (D / 16) + 2 * c + 1) * 16 + i) * 32,
                            _mm512_permutex2var_epi64(a, hi_idx, b));
      }
    }
  }
}

// bf16 elements of one 64-key block's packed K and V (pack_block's output).
template <int D>
constexpr int64_t kBlockPack = 2 * kKeyBlock * D;

// Keys j0 .. j0 + 63 of one KV head (nb real, zeros after) packed as pack_k, then pack_v.
template <int D, typename KRow, typename VRow>
inline void pack_block(const KRow& krow, const VRow& vrow, int64_t nb, uint16_t* out) {
  pack_k<D>(krow, nb, out);
  pack_v<D>(vrow, nb, out + kKeyBlock * D);
}

// The tile routines below spell every tile number out: GCC's _tile_* intrinsics are macros that
// paste their literal register number into inline asm, so it cannot come from a template
// argument or a constexpr.

// s[16 rows][64 keys] = q[16 rows] · kpack (fp32, unscaled); q rows of D bf16.
template <int D>
inline void scores_tile(const uint16_t* q, const uint16_t* kpack, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < D / 32; ++c) {
    _tile_loadd(4, q + c * 32, D * 2);
    _tile_loadd(5, kpack + (c * 4 + 0) * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, kpack + (c * 4 + 1) * 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kpack + (c * 4 + 2) * 512, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, kpack + (c * 4 + 3) * 512, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, s + 0, kKeyBlock * 4);
  _tile_stored(1, s + 16, kKeyBlock * 4);
  _tile_stored(2, s + 32, kKeyBlock * 4);
  _tile_stored(3, s + 48, kKeyBlock * 4);
}

// o[16 rows][dims 16 d0 .. 16 (d0 + kTiles))] += p[16 rows][64 keys] · vpack (fp32 o, row
// stride D; bf16 p): kTiles (2 or 4) output tiles, tiles 2 and 3 only for 4.
template <int D, int kTiles>
inline void accumulate_slice(const uint16_t* p, const uint16_t* vpack, float* o, int d0) {
  static_assert(kTiles == 2 || kTiles == 4, "two or four output tiles beside P and V");
  constexpr bool kWide = kTiles == 4;
  o += d0 * 16;
  _tile_loadd(0, o + 0, D * 4);
  _tile_loadd(1, o + 16, D * 4);
  if constexpr (kWide) {
    _tile_loadd(2, o + 32, D * 4);
    _tile_loadd(3, o + 48, D * 4);
  }
  for (int u = 0; u < 2; ++u) {
    const uint16_t* b = vpack + (u * (D / 16) + d0) * 512;
    _tile_loadd(4, p + u * 32, kKeyBlock * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (kWide) {
      _tile_loadd(5, b + 2 * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b + 3 * 512, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, o + 0, D * 4);
  _tile_stored(1, o + 16, D * 4);
  if constexpr (kWide) {
    _tile_stored(2, o + 32, D * 4);
    _tile_stored(3, o + 48, D * 4);
  }
}

// o[16 rows][D] += p[16 rows][64 keys] · vpack: slices of 64 dims (four output tiles; D = 32
// and the last 32 dims of D = 96 take two), each loading P again.
template <int D>
inline void accumulate_tile(const uint16_t* p, const uint16_t* vpack, float* o) {
  static_assert(supports_head_dim(D));
  for (int d0 = 0; d0 + 4 <= D / 16; d0 += 4) accumulate_slice<D, 4>(p, vpack, o, d0);
  if constexpr (D % 64 == 32) accumulate_slice<D, 2>(p, vpack, o, D / 16 - 2);
}

// The first k lanes of a vector (all for k >= 16, none for k <= 0).
inline __mmask16 first_lanes(int64_t k) {
  return k >= 16 ? 0xFFFF : k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1u);
}

// How far a block's maximum may exceed a row's running max m before m moves to it (natural-log
// units): below it m stays, p = exp(s scale - m) reaches up to e^8 (fp32 sums and bf16 P hold
// that at the same relative precision) and the row's O needs no rescaling (alpha = 1). A row's
// max settles after its first blocks, so most tiles skip the rescale pass over O (it had taken
// ~20% of a 512-token prefill's attention). Whether m moves depends only on the row's own
// scores: results stay batch-invariant.
constexpr float kMaxSlack = 8.f;

// The online softmax of one row tile (n <= 16 rows of unscaled fp32 scores s, stride
// kKeyBlock; row i's first visible[i] >= 1 entries real) in two passes, straight to bf16 P
// (rows past n: zeros): the rows' raw maxima, m_new = raw max * scale where it exceeds m by more
// than kMaxSlack (or m is -inf), else m (a positive scale keeps the order, so the same bits as
// the maximum of the scaled scores), alpha = exp(m - m_new), then p = exp(s * scale - m_new)
// (one rounding, fused) on the visible entries, summed into l and stored rounded to bf16.
// Returns whether any row's m moved (else every alpha is 1).
inline bool softmax_to_p16(const float* s, int n, const int64_t* visible, float scale, float* m,
                           float* l, float* alpha, uint16_t* p) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 part[16];
  for (int i = 0; i < 16; ++i) {
    part[i] = neg_inf;
    if (i >= n) continue;
    for (int c = 0; c < 4; ++c) {
      part[i] = _mm512_mask_max_ps(part[i], first_lanes(visible[i] - 16 * c), part[i],
                                   _mm512_loadu_ps(s + i * kKeyBlock + 16 * c));
    }
  }
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1u);
  const __m512 raw_max = fma_attention::transpose_reduce16(part, [](__m512 a, __m512 b) {
    return _mm512_max_ps(a, b);
  });
  alignas(64) float m_new[16];
  const __m512 m_old = _mm512_mask_loadu_ps(neg_inf, rows, m);
  const __m512 block_max = _mm512_mul_ps(raw_max, _mm512_set1_ps(scale));
  // -inf + slack is -inf: a row's first block always moves m
  const __mmask16 moved = _mm512_mask_cmp_ps_mask(
      rows, block_max, _mm512_add_ps(m_old, _mm512_set1_ps(kMaxSlack)), _CMP_GT_OQ);
  _mm512_store_ps(m_new, _mm512_mask_blend_ps(moved, m_old, block_max));
  for (int i = 0; i < n; ++i) {
    alpha[i] = (moved >> i) & 1 ? std::exp(m[i] - m_new[i]) : 1.f;  // 0 while m is -inf
    m[i] = m_new[i];
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int i = 0; i < 16; ++i) {
    uint16_t* prow = p + i * kKeyBlock;
    if (i >= n) {
      part[i] = _mm512_setzero_ps();
      _mm512_storeu_si512(prow, _mm512_setzero_si512());
      _mm512_storeu_si512(prow + 32, _mm512_setzero_si512());
      continue;
    }
    const __m512 vm = _mm512_set1_ps(m_new[i]);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; c += 2) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const __mmask16 real = first_lanes(visible[i] - 16 * (c + h));
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + i * kKeyBlock + 16 * (c + h)),
                                         vscale, vm);
        e[h] = _mm512_maskz_mov_ps(real, at::vec::Vectorized<float>(x).exp_u20());
        sum = _mm512_add_ps(sum, e[h]);
      }
      _mm512_storeu_si512(prow + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    part[i] = sum;
  }
  const __m512 sums = fma_attention::transpose_reduce16(part, [](__m512 a, __m512 b) {
    return _mm512_add_ps(a, b);
  });
  alignas(64) float lsum[16];
  _mm512_store_ps(lsum, sums);
  for (int i = 0; i < n; ++i) l[i] = l[i] * alpha[i] + lsum[i];
  return moved != 0;
}

// Rows a caller's q and o must have past the nq real ones for `attend` (a tile may start at
// any row below nq). Their contents never matter: a tile's rows never mix, and rows >= nq are
// neither softmaxed nor read back.
constexpr int64_t kSlackRows = 16;

// Continues the state (m[r], l[r], o[r, :]) of the nq bf16 queries q[r, :] (unscaled: the
// fp32 scores are multiplied by `scale`) over keys 0..key_end of one KV head, in place: q and o
// have kSlackRows rows of room past nq (o's may be overwritten). Key j is the pool row at
// kbase / vbase + slot_of(j) * slot_stride (a valid slot). Block j0's rows below row_lo(j0) see
// none of its keys and are skipped; visible_keys(r, j0, nb) >= 1 is how many of its nb keys row
// r >= row_lo(j0) sees. `packed`: null, or the keys' blocks already packed (block j0 / 64 at
// packed + (j0 / 64) * kBlockPack<D>, by pack_block over at least key_end keys: keys a row does
// not see are masked out of P, so a block packed with more real keys gives the same bits).
// Requires amx_usable() and supports_head_dim(D).
template <int D, typename SlotOf, typename RowLo, typename VisibleKeys>
void attend(const at::BFloat16* q, int64_t nq, float scale, int64_t key_end,
            const SlotOf& slot_of, const RowLo& row_lo, const VisibleKeys& visible_keys,
            const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t slot_stride, float* m,
            float* l, float* o, Scratch& sc, const uint16_t* packed = nullptr) {
  static_assert(supports_head_dim(D), "AMX attention: head_dim 32, 64, 96 or 128");
  const int64_t padded = nq + kSlackRows;
  sc.s.resize(padded * kKeyBlock);
  sc.p.resize(padded * kKeyBlock);
  sc.k.resize(kBlockPack<D>);  // one block's K, then its V
  sc.alpha.resize(padded);
  const uint16_t* qh = reinterpret_cast<const uint16_t*>(q);
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - j0);
    const int64_t r_lo = row_lo(j0);
    if (r_lo >= nq) continue;
    auto krow = [&](int64_t jj) {
      return reinterpret_cast<const uint16_t*>(kbase + slot_of(j0 + jj) * slot_stride);
    };
    auto vrow = [&](int64_t jj) {
      return reinterpret_cast<const uint16_t*>(vbase + slot_of(j0 + jj) * slot_stride);
    };
    const uint16_t* kp = sc.k.data();
    if (packed) {
      kp = packed + j0 / kKeyBlock * kBlockPack<D>;
    } else {
      pack_block<D>(krow, vrow, nb, sc.k.data());
    }
    const uint16_t* vp = kp + kKeyBlock * D;
    for (int64_t r0 = r_lo; r0 < nq; r0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, nq - r0));
      float* s = sc.s.data() + r0 * kKeyBlock;
      scores_tile<D>(qh + r0 * D, kp, s);
      int64_t visible[16];
      for (int i = 0; i < n; ++i) visible[i] = visible_keys(r0 + i, j0, nb);
      uint16_t* p = sc.p.data() + r0 * kKeyBlock;
      const bool moved =
          softmax_to_p16(s, n, visible, scale, m + r0, l + r0, sc.alpha.data() + r0, p);
      // O rows rescaled by alpha where any row's m moved (then every row: skipping those whose
      // alpha is 1 measured 5-7% slower, the branch mispredicted).
      float* orow = o + r0 * D;
      for (int i = 0; moved && i < n; ++i) {
        const __m512 a = _mm512_set1_ps(sc.alpha[r0 + i]);
        for (int c = 0; c < D; c += 16) {
          _mm512_storeu_ps(orow + i * D + c, _mm512_mul_ps(_mm512_loadu_ps(orow + i * D + c), a));
        }
      }
      accumulate_tile<D>(p, vp, orow);
    }
  }
  _tile_release();
}

// `attend` for callers whose q and o have no slack rows: copied into scratch that has them,
// and o back.
template <int D, typename SlotOf, typename RowLo, typename VisibleKeys>
void attend_copying(const at::BFloat16* q, int64_t nq, float scale, int64_t key_end,
                    const SlotOf& slot_of, const RowLo& row_lo, const VisibleKeys& visible_keys,
                    const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t slot_stride,
                    float* m, float* l, float* o, Scratch& sc) {
  sc.q.resize((nq + kSlackRows) * D);
  std::memcpy(sc.q.data(), q, nq * D * sizeof(uint16_t));
  sc.o.resize((nq + kSlackRows) * D);
  std::memcpy(sc.o.data(), o, nq * D * sizeof(float));
  attend<D>(reinterpret_cast<const at::BFloat16*>(sc.q.data()), nq, scale, key_end, slot_of,
            row_lo, visible_keys, kbase, vbase, slot_stride, m, l, sc.o.data(), sc);
  std::memcpy(o, sc.o.data(), nq * D * sizeof(float));
}

#else

using radixrt_cpu::amx_usable;
constexpr bool supports_head_dim(int64_t) { return false; }

#endif

}  // namespace amx_attention
}  // namespace radixrt_cpu
