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
#include "bf16_blocks.h"
#include "fma_attention.h"
#include "vec_util.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(RADIXRT_BF16_BLOCKS) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
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
// The packed blocks and the softmax to bf16 P (bf16_blocks.h; AMX CPUs have AVX512-BF16).
using bf16_blocks::kBlockPack;
using bf16_blocks::pack_block;
using bf16_blocks::softmax_to_p16;

using radixrt_cpu::amx_usable;

// Head dims the tiles take: whole 32-element chunks of Q·Kᵀ, P·V in slices of at most four
// output tiles (beside P and V: 8 tile registers).
constexpr bool supports_head_dim(int64_t D) { return D == 32 || D == 64 || D == 96 || D == 128; }

using radixrt_cpu::TileConfig;  // every tile 16 rows x 64 bytes

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
