// Paged decode attention on CPU, read in place from radixrt's KV pool.
//
// One new query token per request row. Row b attends, per KV head, over the keys
//   [shared prefix of its group, if any]  ++  kv_indices[row_start[b] : row_start[b] + row_len[b]]
// where every key is a slot of the pool buffers k_buffer / v_buffer [slots, kv_heads, head_dim].
// Nothing is gathered: each key row is read straight from the pool. The buffers may have any
// slot and head strides (head_dim contiguous, K and V alike): radixrt's CPU pool is head-major
// (slot stride head_dim), so the keys of one KV head over a row's run of slots are one
// contiguous stream (0.75-0.82x the time from memory of the slot-major layout).
//
// Numerics: scores, the online softmax (running max m, sum l) and the V accumulation are fp32
// whatever the pool's dtype. Outputs: the attention output in q's dtype and the natural-log
// log-sum-exp of the scaled scores (m + log l) in fp32, so callers can merge partial results by
// log-sum-exp. A row with no key at all gets output 0 and LSE -inf. Every query's arithmetic is
// the same whatever else is in the batch (batch-invariant, bitwise), given its plan: whether it
// is in a cascade group and whether that group has the rows for the block passes below
// (kBlockGroupRows without a dot-product instruction, kLaneGroupRows with AVX512-BF16).
//
// Cascade: a group's shared prefix keys are read once per (group chunk, KV head) for all of the
// chunk's query rows; each row then continues the same online softmax over its own keys. Large
// groups on pools without a dot-product instruction pass over the prefix in register-tiled key
// blocks (fma_attention.h) instead of the scan; on bf16 pools where AMX tiles are usable every
// group does, on tiles (amx_attention.h: P rounded to bf16, as the vdpbf16ps scan does); on
// bf16 pools with AVX512-BF16 but no AMX, groups of kLaneGroupRows rows or more pass with their
// query rows in vector lanes (lane_attention.h, extend's vdpbf16ps pass).
// GQA: query head h uses KV head h / (heads / kv_heads); K/V are never expanded.
//
// Two scans (KeyScan), chosen by the instruction set this file is compiled for (by the builder,
// radixrt/attention/cpu_kernels.py, from the machine's CPU flags):
// - AVX-512: keys in blocks of 16, one score lane per key. q · k is accumulated per key into a
//   16-lane partial vector and a transpose-reduce turns a block's 16 partials into the block's
//   score vector (no horizontal sum per key); the running max is updated once per block and the
//   state rescaled only when it grows; a query tile's state stays in registers over all keys.
//   bf16 pools on CPUs with AVX512-BF16 (__AVX512BF16__): Q K^T with vdpbf16ps on q and k as
//   stored (exact products, fp32 sums, scale applied to the fp32 scores) and P V with vdpbf16ps
//   over pairs of keys, p rounded to bf16 (as GPU flash attention does: outputs differ from
//   fp32 P V by about 2^-9 relative). Other pools: fp32 FMA on rows converted to fp32 once per
//   query tile, q scaled after the dot product.
// - AVX2: q scaled to fp32; tiles of up to three queries (a KV head's query heads under GQA)
//   hold their partial score vectors and their outputs in the 16 ymm registers, so every K/V
//   row is loaded, and a 16-bit pool's converted, once per tile in registers (no fp32 copy of
//   the block); four keys' partial vectors per query reduced together by horizontal adds; fp32
//   P V; the rows of the block `ahead` blocks on prefetched a few per group of four keys.
//   Zen 3 (stop 73), the op alone over 30 layers from memory, 64 / 8 rows x 544 keys: float16
//   pool 58.3 / 7.7 -> 45-46 / 6.7-7.2 ms against the scan it replaced (one query per tile over
//   a block converted to fp32 in memory, the next block prefetched in one burst), hot 1.32x /
//   1.47x; fp32 pools within 5%. The burst prefetch was slower than none there (1.04-1.18x),
//   prefetches spread over the block 1.17-1.19x faster than none at 64 rows (1.02x at 8), with
//   0-4 blocks ahead within 3% of each other.
// - generic (at::vec::Vectorized<float>): q scaled to fp32, one horizontal sum per key and
//   query, fp32 P V.

#include <torch_headers.h>  // first: precompiled by the build

#include "amx_attention.h"
#include "amx_decode.h"
#include "fma_attention.h"
#include "kv_pool_layout.h"
#include "lane_attention.h"
#include "team.h"
#include "vec_util.h"
#include "work_queue.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;
// Keys per online-softmax step (generic scan): scores of a block are computed, then the running
// max is updated once per block (not once per key).
constexpr int64_t kBlock = 32;
static_assert(kBlock % kVec == 0, "key block must be a whole number of vectors");
// AVX-512 scan: keys per block (one score lane each), how many blocks ahead rows are
// prefetched, and whether P V uses bf16 pairs (vdpbf16ps) on bf16 pools with AVX512-BF16.
constexpr int64_t kBlock16 = 16;
// Measured on Zen 4 (bench/results/2026-11-24-paged-decode-v2.md): no prefetch is 1.6-1.8x
// slower from memory; fp32 P V 1.2x slower than bf16 pairs with K/V in the caches, the same
// from memory. A call that runs on one thread (a micro-batch of radixrt::decode_layers, or a
// one-thread process) needs more misses in flight to draw the bandwidth two share: Zen 5,
// 2-core decode steps of two 32-row micro-batches, 2 blocks ahead 1.03-1.05x over 1, 3 no
// better than 2; Zen 4 at stop 59, one thread, 8-32 rows x 512 keys: 2 ahead 1.02x over 3,
// 1.08x over 4. A call sharing its items among threads took 1 block ahead until stop 59, when
// on Zen 4 (op alone, 30 layers from memory, 2 threads, bench/attention_kernel.py prefetch)
// 2 ahead read bf16 pools 1.05-1.12x faster than 1 at 8 and 64 rows x 512 keys in two sweeps
// (3: 1.11-1.17x, but 0.95-0.97x over a 400-key shared prefix, where 2 is 1.01-1.02x) and fp32
// pools 1.02-1.07x; whole team decode steps 1.03x at 8 and 64 rows. Both are 2 now. RADIXRT_PD_* set the defaults,
// torch.ops.radixrt.paged_decode_prefetch the process's distances (for such measurements).
#ifndef RADIXRT_PD_PREFETCH_BLOCKS
#define RADIXRT_PD_PREFETCH_BLOCKS 2
#endif
#ifndef RADIXRT_PD_PREFETCH_BLOCKS_ALONE
#define RADIXRT_PD_PREFETCH_BLOCKS_ALONE 2
#endif
#ifndef RADIXRT_PD_PV_BF16
#define RADIXRT_PD_PV_BF16 1
#endif
constexpr int64_t kPrefetchBlocks = RADIXRT_PD_PREFETCH_BLOCKS;
constexpr int64_t kPrefetchBlocksAlone = RADIXRT_PD_PREFETCH_BLOCKS_ALONE;
constexpr bool kPvBf16 = RADIXRT_PD_PV_BF16;
// Cascade groups of at least this many rows pass over their shared prefix in register-tiled
// key blocks where the scan has no dot-product instruction (KeyScan::run_group). A row's result
// then depends on whether its group is that large (never on the threads or the chunking): from
// 16 rows the blocks were 1.37-1.39x the scan on one thread (8 rows 1.14x, 4 rows 0.99x, 2
// rows 0.78x: the block conversion is amortized over the chunk's queries), and a 16-row group's
// chunks on two threads hold 8 rows each (Xeon without AVX512-BF16, bench/results/
// 2026-12-01-s38-*). Zen 3 (stop 81, fp32 queries over a float16 pool, one group over a 570 / 1024
// key prefix, `bench/attention_kernel.py group-pass`): the scan 1.04-1.29x faster at 4-12 rows,
// the blocks 1.05-1.19x faster at 16-64. RADIXRT_PD_BLOCK_GROUP_ROWS sets it (such A/Bs).
#ifndef RADIXRT_PD_BLOCK_GROUP_ROWS
#define RADIXRT_PD_BLOCK_GROUP_ROWS 16
#endif
constexpr int64_t kBlockGroupRows = RADIXRT_PD_BLOCK_GROUP_ROWS;
// Most query rows per cascade work item (rows of one group are split into chunks so that
// there are enough items for every thread).
constexpr int64_t kMaxChunkRows = 32;
// Fewest rows per cascade work item. A group of 3-7 rows on 2 threads and 3 KV heads made 3
// items of 4+ rows (one thread ran two, the other one); in 2-row chunks it makes 6. Rows never
// mix in a scan or a packed-block pass, so the chunks change no bit. The op alone over a
// 4096-key prefix (Zen 4, from memory, against 4-row chunks): 3 rows 1.16x, 4 rows 1.21x,
// 6 rows 1.06x, others within 1% (1024 keys: 1.11x / 1.16x / 1.08x).
constexpr int64_t kMinChunkRows = 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Whether cascade groups of bf16 pools pass over their prefix on AMX tiles where this process
// may use them (amx_attention.h): every group, whatever its size, so that a row's bits depend
// only on whether it is in a group. Xeon with AMX-BF16, 512-key prefix, 30 layers: 2 rows
// 1.39 -> 1.23-1.26 ms, 4 rows 2.46 -> 1.62, 8 rows 3.47 -> 2.19, 16 rows 6.99 -> 3.9-4.1.
// Benchmarks and tests switch it.
std::atomic<bool> g_amx{true};
// Own keys from which a row takes the tiles: below, the per-call cost (tile configuration, the
// queries' Qᵀ, the state's layout) outweighs the arithmetic saved. A row's path then depends on
// its own key count, never on the batch. The op alone, 64 rows, 30 layers from memory (and one
// layer 30 times), tiles against the scan: 16 keys 0.68x (0.68x), 32 0.96x (1.07x), 64 1.04x
// (1.00x), 128 0.98x (1.04x), 256 1.02x (1.07x), 544 1.05-1.07x (1.12x); in the server at 64
// concurrent with every row on the tiles, gsp (cascade rows, few own keys) read 0.98x.
constexpr int64_t kAmxRowsMinKeys = 256;
// Whether a row's own keys (every item outside a cascade group's prefix) pass on AMX tiles
// where this process may use them (amx_decode.h), instead of the vdpbf16ps scan: yes unless
// RADIXRT_PD_AMX_ROWS=0 is in the environment (a server A/B); benchmarks and tests switch it
// (paged_decode_amx_rows).
std::atomic<bool> g_amx_rows{[] {
  const char* env = std::getenv("RADIXRT_PD_AMX_ROWS");
  return env == nullptr || std::strcmp(env, "0") != 0;
}()};
// Cascade groups of at least this many rows over a bf16 pool, on CPUs with AVX512-BF16 where
// AMX tiles are not used, pass over their prefix with the chunk's query rows in vector lanes
// (lane_attention::attend_all: K read in place, a vertical softmax, V packed in key pairs once
// per 64-key block for all of the chunk's rows) instead of the scan. A row's bits then depend
// on whether its group is that large (never on the threads or the chunking). Zen 4, 2 threads,
// the op alone over 30 layers from memory, each row with 100 keys of its own, against the scan
// below 16 rows and the packed-block pass this replaced (keys in lanes, K transposed per block,
// a per-row softmax) from 16: 8 rows over a 1024-4096-key prefix 1.04-1.12x, 12 rows
// 1.01-1.05x, 16 rows 1.06-1.07x, 32 rows 1.17-1.18x, 64 rows 1.15-1.17x; 6 rows 0.89-0.92x
// (chunks of 3 rows: 9 of a vector's 16 lanes, V packed per 9 queries).
constexpr int64_t kLaneGroupRows = 8;
#ifdef RADIXRT_LANE_ATTENTION
// kLaneGroupRows as set for this process (0: never); benchmarks and tests set it
// (paged_decode_lane_groups).
std::atomic<int64_t> g_lane_group_rows{kLaneGroupRows};
#endif

// Whether this call runs on the calling thread alone: inside another parallel region (a nested
// one runs on its caller) or with one intra-op thread; in a decode team (team.h), when the team
// has one member.
inline bool runs_alone() {
  if (const TeamMember* m = team_member()) return m->size == 1;
  return at::in_parallel_region() || at::get_num_threads() == 1;
}

// Threads sharing this call's work items.
inline int64_t call_threads() {
  if (const TeamMember* m = team_member()) return m->size;
  return runs_alone() ? 1 : at::get_num_threads();
}

// The distances this process uses (paged_decode_prefetch: benchmarks tune them per machine).
// They move only loads, never a result.
std::atomic<int64_t> g_prefetch_blocks{kPrefetchBlocks};
std::atomic<int64_t> g_prefetch_blocks_alone{kPrefetchBlocksAlone};

// Whether the AVX-512 bf16 / fp32 scan prefetches its rows into L1 (prefetcht0) instead of L2
// (prefetcht2). Measured per CPU: on the AMX Xeon (stop 67, spread prefetches) L1 read bf16 pools
// 1.03-1.08x faster from memory (fp32 1.00-1.02x); on Zen 5 (stop 22) 1.01-1.02x; on Zen 4
// (stop 19, burst prefetches) 1.4-1.6x slower. Default: L1 on Intel CPUs, else L2;
// RADIXRT_PD_PREFETCH_L1=0|1 in the environment overrides it, paged_decode_prefetch_l1 sets it
// (benchmarks, tests). It moves only loads, never a result.
int default_prefetch_l1() {
  if (const char* env = std::getenv("RADIXRT_PD_PREFETCH_L1")) {
    if (std::strcmp(env, "0") == 0) return 0;
    if (std::strcmp(env, "1") == 0) return 1;
  }
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") ? 1 : 0;
#else
  return 0;
#endif
}

std::atomic<int> g_prefetch_l1{-1};  // -1: not resolved yet

inline bool prefetch_l1() {
  int v = g_prefetch_l1.load(std::memory_order_relaxed);
  if (v < 0) {
    v = default_prefetch_l1();
    g_prefetch_l1.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// Blocks ahead the AVX-512 and AVX2 scans prefetch in this call.
inline int64_t prefetch_blocks() {
  return (runs_alone() ? g_prefetch_blocks_alone : g_prefetch_blocks)
      .load(std::memory_order_relaxed);
}

#if defined(CPU_CAPABILITY_AVX512)
// ---- AVX-512 scan (see the top of the file) ---------------------------------------------
// Transpose-reduce of 16 partial vectors (keys 0..15) into one score vector: combine_pairs on
// keys (2i, 2i + 1), combine_quads on two pairs, combine_lanes twice: 15 combines per block
// (reduce_block, for the fp32 and the int32 partials alike).

// Lane i of the result: lanes {i, i + 2} summed for a (i even) / b (i odd), per 128-bit lane.
inline __m512 combine_pairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
// Two combine_pairs results -> per 128-bit lane, position k holds key k's partial sum.
inline __m512 combine_quads(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
// Sums 128-bit lanes pairwise: [a0+a1, a2+a3, b0+b1, b2+b3].
inline __m512 combine_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
// The same three on int32 lanes (the int8 scan's exact sums).
inline __m512i combine_pairs(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i combine_quads(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512i combine_lanes(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}

// One block's scores of R queries: s[t] lane j = the sum of query t's 16-lane partial vector
// for key j. partials(j, emit) computes the partials of keys j and j + 1 (j even) and calls
// emit(t, partial of j, partial of j + 1) for each query t; pairs, then quads, then lanes are
// combined as they come.
template <int R, typename V, typename Partials>
inline void reduce_block(const Partials& partials, V* s) {
  V half[R][2];
#pragma GCC unroll 2
  for (int g2 = 0; g2 < 2; ++g2) {
    V quad[R][2];
#pragma GCC unroll 2
    for (int g = 0; g < 2; ++g) {
      V pair[R][2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        partials(8 * g2 + 4 * g + 2 * h,
                 [&](int t, V a, V b) { pair[t][h] = combine_pairs(a, b); });
      }
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) quad[t][g] = combine_quads(pair[t][0], pair[t][1]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) half[t][g2] = combine_lanes(quad[t][0], quad[t][1]);
  }
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) s[t] = combine_lanes(half[t][0], half[t][1]);
}

template <int N>
inline __m512 online_max(__m512 st, float& mx, __m512& lv, __m512* acc) {
  const float bmax = _mm512_reduce_max_ps(st);
  if (bmax > mx) {
    const float alpha = std::exp(mx - bmax);  // 0 while mx is -inf
    const __m512 va = _mm512_set1_ps(alpha);
    lv = _mm512_mul_ps(lv, va);
#pragma GCC unroll 16
    for (int c = 0; c < N; ++c) acc[c] = _mm512_mul_ps(acc[c], va);
    mx = bmax;
  }
  return _mm512_set1_ps(mx);
}

// The pair layout of P V accumulators (what unpacklo / unpackhi_epi16 of two key rows give, so
// that vdpbf16ps / vpdpwssd over pairs of keys accumulate in place): of each 32-dim chunk c,
// v[2c] holds dims 8L + 0..3 in 128-bit lane L, v[2c + 1] dims 8L + 4..7. D / 32 chunks.
template <int D>
inline void load_pair_layout(const float* acc, __m512* v) {
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi =
      _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#pragma GCC unroll 8
  for (int c = 0; c < D / 32; ++c) {
    const __m512 n0 = _mm512_loadu_ps(acc + c * 32);
    const __m512 n1 = _mm512_loadu_ps(acc + c * 32 + 16);
    v[2 * c] = _mm512_permutex2var_ps(n0, to_lo, n1);
    v[2 * c + 1] = _mm512_permutex2var_ps(n0, to_hi, n1);
  }
}

template <int D>
inline void store_pair_layout(const __m512* v, float* acc) {
  const __m512i to_n0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i to_n1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 8
  for (int c = 0; c < D / 32; ++c) {
    _mm512_storeu_ps(acc + c * 32, _mm512_permutex2var_ps(v[2 * c], to_n0, v[2 * c + 1]));
    _mm512_storeu_ps(acc + c * 32 + 16, _mm512_permutex2var_ps(v[2 * c], to_n1, v[2 * c + 1]));
  }
}

// One row of D floats into the pair layout / back to natural order, as stored vectors (src may
// be dst).
template <int D>
inline void to_pair_layout(const float* src, float* dst) {
  __m512 v[D / 16];
  load_pair_layout<D>(src, v);
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(dst + c * 16, v[c]);
}
template <int D>
inline void from_pair_layout(const float* src, float* dst) {
  __m512 v[D / 16];
  for (int c = 0; c < D / 16; ++c) v[c] = _mm512_loadu_ps(src + c * 16);
  store_pair_layout<D>(v, dst);
}

// How a key row is held for the dot products with the tile's queries.
template <typename T, int D, bool kDot>
struct RowDot;

// fp32 FMA: the row converted to fp32, D / 16 vectors; q fp32.
template <typename T, int D>
struct RowDot<T, D, false> {
  static constexpr int N = D / 16;
  using QType = float;
  __m512 c[N];
  inline void load(const T* row) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) c[i] = __m512(load_f32<T>(row + i * 16));
  }
  inline __m512 dot(const QType* q) const {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), c[0]);
#pragma GCC unroll 16
    for (int i = 1; i < N; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * 16), c[i], a);
    return a;
  }
};

// fp32 FMA on a bf16 row widened by unpacking it against zero (a bf16 is the top half of its
// fp32: one instruction per 16 elements instead of a zero-extension and a shift), which leaves
// each 32-element chunk in the pair layout (load_pair_layout); q fp32 in that layout too.
template <int D>
struct RowDotUnpacked {
  static_assert(D % 32 == 0, "whole 32-element chunks");
  static constexpr int N = D / 16;
  using QType = float;
  __m512 c[N];
  static inline __m512 widened(const at::BFloat16* row, int i) {  // vector i of the layout
    const __m512i x = _mm512_loadu_si512(row + (i / 2) * 32);
    const __m512i zero = _mm512_setzero_si512();
    return _mm512_castsi512_ps(i % 2 ? _mm512_unpackhi_epi16(zero, x)
                                     : _mm512_unpacklo_epi16(zero, x));
  }
  inline void load(const at::BFloat16* row) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) c[i] = widened(row, i);
  }
  inline __m512 dot(const QType* q) const {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), c[0]);
#pragma GCC unroll 16
    for (int i = 1; i < N; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * 16), c[i], a);
    return a;
  }
};

#if defined(__AVX512BF16__)
// vdpbf16ps: bf16 row and query as they are (exact products, fp32 sums), 32 elements per
// instruction; a last chunk of 16 is loaded zero-padded.
template <int D>
struct RowDot<at::BFloat16, D, true> {
  static constexpr int N = (D + 31) / 32;
  using QType = at::BFloat16;
  __m512i c[N];
  static inline __m512i chunk(const at::BFloat16* p, int i) {
    if (i * 32 + 32 <= D) return _mm512_loadu_si512(p + i * 32);
    return _mm512_maskz_loadu_epi16(0xFFFFu, p + i * 32);
  }
  inline void load(const at::BFloat16* row) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) c[i] = chunk(row, i);
  }
  inline __m512 dot(const QType* q) const {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) {
      a = _mm512_dpbf16_ps(a, (__m512bh)chunk(q, i), (__m512bh)c[i]);
    }
    return a;
  }
};
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

using fma_attention::with_rows;  // f(std::integral_constant<int, r>) for a runtime r <= R

// A scan's `run`: queries in tiles of TQ (the last one smaller), each tile's state in registers
// over all the keys via scan.scan<R>; the first tile prefetches rows ahead, later tiles find
// them in the caches.
template <int TQ, int D, typename Scan, typename QType>
inline void run_tiles(const Scan& scan, const QType* q, int64_t nq, const int32_t* idx, int64_t n,
                      float* m, float* l, float* acc) {
  if (n == 0) return;
  for (int64_t t0 = 0; t0 < nq; t0 += TQ) {
    const int tq = static_cast<int>(std::min<int64_t>(TQ, nq - t0));
    with_rows<TQ>(tq, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      scan.template scan<R>(q + t0 * D, idx, n, m + t0, l + t0, acc + t0 * D, t0 == 0);
    });
  }
}

// P V accumulators of R queries, NV vectors each.
template <int R, int NV>
struct AccTile {
  __m512 v[R][NV];
};

// What the AVX-512 scans share (CRTP; `Scan` derives from it): head_dim D in vectors of 16,
// queries in tiles of TQ, taken as QT, and `run` over run_tiles; the P V accumulators, in the
// pair layout where the scan's rows come in it (`Scan::kPairAcc`: its P V runs over pairs of
// keys, or it widens bf16 rows by unpacking), else in natural order, and P V in fp32 on value
// rows converted by `Scan::value_chunk`.
template <typename Scan, typename QT, int D>
struct TiledScan {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static constexpr int NV = D / 16;
  // Queries per tile: their P V accumulators (TQ x NV vectors) stay in registers.
  static constexpr int TQ = std::max(1, std::min(4, 12 / NV));
  static constexpr int64_t kD = D;
  using QType = QT;

  // Queries as the scan takes them: converted to QT, unscaled (the scores are scaled in fp32).
  template <typename S>
  static void load_queries(const S* src, int64_t n, float /*scale*/, QType* dst) {
    for (int64_t e = 0; e < n * D; ++e) dst[e] = static_cast<QType>(src[e]);
  }

  // Runs keys idx[0..n) (valid slots) through the state (m[i], l[i], acc[i, :]) of each query
  // q[i, :] (run_tiles).
  void run(const QType* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
           float* acc) const {
    run_tiles<TQ, D>(static_cast<const Scan&>(*this), q, nq, idx, n, m, l, acc);
  }

  // `run` for a cascade group's rows over their shared prefix (the same state in and out);
  // `group_rows`: how many rows the whole group has (not this chunk).
  void run_group(const QType* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
                 float* acc, int64_t /*group_rows*/) const {
    static_cast<const Scan&>(*this).run(q, nq, idx, n, m, l, acc);
  }

  template <int R>
  using Acc = AccTile<R, NV>;

  template <int R>
  static inline void load_acc(const float* acc, Acc<R>& a) {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      if constexpr (Scan::kPairAcc) {
        load_pair_layout<D>(acc + t * D, a.v[t]);
      } else {
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) a.v[t][c] = _mm512_loadu_ps(acc + t * D + c * 16);
      }
    }
  }

  template <int R>
  static inline void store_acc(const Acc<R>& a, float* acc) {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      if constexpr (Scan::kPairAcc) {
        store_pair_layout<D>(a.v[t], acc + t * D);
      } else {
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + t * D + c * 16, a.v[t][c]);
      }
    }
  }

  // acc += p @ V in fp32, each value row converted once for the R queries.
  template <int R, typename VT>
  static inline void accumulate_fma(const float (*p)[kBlock16], const VT* const* vrow, int nb,
                                    Acc<R>& a) {
    for (int jj = 0; jj < nb; ++jj) {
      __m512 vv[NV];
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) vv[c] = Scan::value_chunk(vrow[jj], c);
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        const __m512 pj = _mm512_set1_ps(p[t][jj]);
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) a.v[t][c] = _mm512_fmadd_ps(pj, vv[c], a.v[t][c]);
      }
    }
  }
};

// The bf16 dot path: a bf16 pool on a CPU with AVX512-BF16.
template <typename T>
constexpr bool kBf16Dot = kHaveBf16Dot && std::is_same_v<T, at::BFloat16>;

// Float pools. Queries as the dot products take them: bf16 as given for the dot path, else fp32.
template <typename T, int D>
struct KeyScan : TiledScan<KeyScan<T, D>, typename RowDot<T, D, kBf16Dot<T>>::QType, D> {
  using Base = TiledScan<KeyScan<T, D>, typename RowDot<T, D, kBf16Dot<T>>::QType, D>;
  using Base::NV;
  using typename Base::QType;
  static constexpr bool kDot = kBf16Dot<T>;
  // P V in bf16 pairs (vdpbf16ps) needs whole 32-element chunks.
  static constexpr bool kPairPV = kDot && kPvBf16 && D % 32 == 0;
  // bf16 rows without vdpbf16ps: widened by unpacking (RowDotUnpacked), queries and P V
  // accumulators in the pair layout.
  static constexpr bool kUnpack = !kDot && std::is_same_v<T, at::BFloat16> && D % 32 == 0;
  static constexpr bool kPairAcc = kPairPV || kUnpack;
  using Dot = std::conditional_t<kUnpack, RowDotUnpacked<D>, RowDot<T, D, kDot>>;

  const T* kbase;  // k_buffer + kv_head * D
  const T* vbase;  // v_buffer + kv_head * D
  int64_t stride;  // elements between consecutive slots
  float scale;
  int64_t ahead;  // blocks whose rows are prefetched ahead (prefetch_blocks())
  bool l1;  // whether they go into L1 (prefetch_l1())

  template <int R>
  using Acc = typename Base::template Acc<R>;

  // Value row `row`'s vector c as fp32 (the fp32 FMA P V): dims 16 c .. 16 c + 15, or vector c
  // of the pair layout (kUnpack).
  static inline __m512 value_chunk(const T* row, int c) {
    if constexpr (kUnpack) {
      return RowDotUnpacked<D>::widened(row, c);
    } else {
      return __m512(load_f32<T>(row + c * 16));
    }
  }

  // Queries as the scan takes them: QType, unscaled, in the pair layout where kUnpack.
  template <typename S>
  static void load_queries(const S* src, int64_t n, float scale, QType* dst) {
    Base::load_queries(src, n, scale, dst);
    if constexpr (kUnpack) {
      for (int64_t i = 0; i < n; ++i) to_pair_layout<D>(dst + i * D, dst + i * D);
    }
  }

  // A cascade group's pass over its shared prefix. For a large group without a
  // dot-product instruction (fp32 FMA on converted rows): fma_attention::attend, each key block
  // converted once for all of the item's queries (a chunk of the group's rows x the KV head's
  // query heads) and register-tiled like extend, instead of once per tile of TQ queries with a
  // transpose-reduce per key and query. Same state in and out: m, l in scaled-score units, acc
  // unnormalized in natural order.
  void run_group(const QType* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
                 float* acc, int64_t group_rows) const {
    // The block passes' view of a prefix: key j at slot idx[j], every key seen by every query.
    [[maybe_unused]] const auto slot_of = [idx](int64_t j) { return static_cast<int64_t>(idx[j]); };
    [[maybe_unused]] const auto no_row_skips = [](int64_t) { return int64_t{0}; };
    [[maybe_unused]] const auto every_key = [](int64_t, int64_t, int64_t nb) { return nb; };
    if constexpr (kDot) {
#ifdef RADIXRT_AMX_ATTENTION
      // On AMX tiles: each 64-key block packed once for all of the item's queries.
      if constexpr (amx_attention::supports_head_dim(D)) {
        if (g_amx.load(std::memory_order_relaxed) && amx_attention::amx_usable()) {
          thread_local amx_attention::Scratch sc;
          amx_attention::attend_copying<D>(
              q, nq, scale, n, slot_of, no_row_skips, every_key, kbase, vbase, stride, m, l, acc,
              sc);
          return;
        }
      }
#endif
#ifdef RADIXRT_LANE_ATTENTION
      // Query rows in vector lanes: each 64-key block's V packed once for all of them.
      if constexpr (lane_attention::supports_head_dim(D)) {
        const int64_t from = g_lane_group_rows.load(std::memory_order_relaxed);
        if (from > 0 && group_rows >= from) {
          thread_local lane_attention::Scratch sc;
          lane_attention::attend_all<D>(q, nq, scale, n, slot_of, kbase, vbase, stride, m, l,
                                        acc, sc);
          return;
        }
      }
#endif
      Base::run(q, nq, idx, n, m, l, acc);
    } else {
      if (group_rows < kBlockGroupRows) return Base::run(q, nq, idx, n, m, l, acc);
      thread_local std::vector<float> qs;
      thread_local fma_attention::Scratch sc;
      qs.resize(nq * D);
      const __m512 vs = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < nq; ++i) {  // natural order (load_queries' layout undone), scaled
        __m512 v[NV];
        for (int c = 0; c < NV; ++c) v[c] = _mm512_mul_ps(_mm512_loadu_ps(q + i * D + c * 16), vs);
        if constexpr (kUnpack) {
          store_pair_layout<D>(v, qs.data() + i * D);
        } else {
          for (int c = 0; c < NV; ++c) _mm512_storeu_ps(qs.data() + i * D + c * 16, v[c]);
        }
      }
      fma_attention::attend<T, D>(qs.data(), nq, n, slot_of, no_row_skips, every_key, kbase,
                                  vbase, stride, m, l, acc, sc);
    }
  }

  // A row's own keys: on AMX tiles where this process uses them for rows and the row has
  // kAmxRowsMinKeys of them or more (amx_decode.h; a row's bits never depend on the batch),
  // else the scan.
  void run(const QType* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
           float* acc) const {
#ifdef RADIXRT_AMX_DECODE
    if constexpr (kDot && amx_decode::supports(D, 1)) {
      if (n >= kAmxRowsMinKeys && amx_decode::supports(D, nq) &&
          g_amx_rows.load(std::memory_order_relaxed) && amx_usable()) {
        alignas(64) float o[amx_decode::kMaxQueries * D];  // the state in the pair layout
        for (int64_t t = 0; t < nq; ++t) to_pair_layout<D>(acc + t * D, o + t * D);
        amx_decode::scan<D>(q, static_cast<int>(nq), idx, n, scale, kbase, vbase, stride, m, l,
                            o, ahead * kBlock16, l1);
        for (int64_t t = 0; t < nq; ++t) from_pair_layout<D>(o + t * D, acc + t * D);
        return;
      }
    }
#endif
    Base::run(q, nq, idx, n, m, l, acc);
  }

  template <int R>
  inline void scan(const QType* q, const int32_t* idx, int64_t n, float* m, float* l,
                   float* acc, bool prefetch) const {
    Acc<R> a;
    Base::template load_acc<R>(acc, a);
    float mx[R];
    __m512 lv[R];  // per-lane partial sums of p; lane 0 starts from l
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      mx[t] = m[t];
      lv[t] = _mm512_castps128_ps512(_mm_set_ss(l[t]));
      lv[t] = _mm512_maskz_mov_ps(1, lv[t]);
    }
    const T* krow[kBlock16];
    const T* vrow[kBlock16 + 1];
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    for (int64_t j0 = 0; j0 < n; j0 += kBlock16) {
      const int nb = static_cast<int>(std::min<int64_t>(kBlock16, n - j0));
      for (int jj = 0; jj < nb; ++jj) {
        const int64_t off = static_cast<int64_t>(idx[j0 + jj]) * stride;
        krow[jj] = kbase + off;
        vrow[jj] = vbase + off;
      }
      // Padding keys reuse the first row (finite values; their probability is 0).
      for (int jj = nb; jj < kBlock16; ++jj) krow[jj] = krow[0];
      vrow[nb] = vrow[0];
      // The rows `ahead` blocks ahead are fetched while this one is computed, spread over it:
      // two K rows with each key pair's scores, two V rows with each key pair's P V in bf16
      // pairs (the fp32 P V takes its V rows' prefetches in one burst before it). On the AMX
      // Xeon (stop 66) that read bf16 pools 1.08-1.11x faster than a burst of K rows before the
      // scores and of V rows after them, from memory and from L3 (fp32 pools 1.01-1.02x;
      // bench/results/2026-12-05-s66-spr.md). Each block's slots are read twice, here and for
      // its own rows two blocks later: keeping them measured 1.00-1.03x, not worth a ring.
      const int64_t pf0 = j0 + ahead * kBlock16;
      const int npf = ahead > 0 && prefetch ? static_cast<int>(std::max<int64_t>(
                                                  0, std::min(n, pf0 + kBlock16) - pf0))
                                            : 0;
      int64_t pfoff[kBlock16];
      for (int jj = 0; jj < npf; ++jj) pfoff[jj] = static_cast<int64_t>(idx[pf0 + jj]) * stride;
      __m512 s[R];
      scores<R>(q, krow, s, pfoff, npf);
      const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1u);
      alignas(64) float p[R][kBlock16];
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        const __m512 st = _mm512_mask_mul_ps(neg_inf, valid, s[t], vscale);
        const __m512 mv = online_max<NV>(st, mx[t], lv[t], a.v[t]);
        // exp as 2^x (vec_util.h exp2_poly5, 8 instructions against exp_u20's 19): on the AMX
        // Xeon (stop 67) the op alone 1.01-1.03x from memory, 1.02-1.05x from the caches
        const __m512 pv = exp_masked(valid, _mm512_sub_ps(st, mv));  // 0 for padding
        _mm512_store_ps(p[t], pv);
        lv[t] = _mm512_add_ps(lv[t], pv);
      }
      if constexpr (kPairPV) {
        accumulate_pairs<R>(p, vrow, nb, a, pfoff, npf);
      } else {
        for (int jj = 0; jj < npf; ++jj) prefetch_row(vbase + pfoff[jj], D * sizeof(T), l1);
        Base::template accumulate_fma<R>(p, vrow, nb, a);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      m[t] = mx[t];
      l[t] = _mm512_reduce_add_ps(lv[t]);
    }
    Base::template store_acc<R>(a, acc);
  }

  // The rows at base + pfoff[j] and base + pfoff[j + 1], those of the two below npf.
  RADIXRT_HOT_INLINE void prefetch_pair(const T* base, const int64_t* pfoff, int j, int npf) const {
    if (j < npf) prefetch_row(base + pfoff[j], D * sizeof(T), l1);
    if (j + 1 < npf) prefetch_row(base + pfoff[j + 1], D * sizeof(T), l1);
  }

  // s[t] lane j = q[t] · k[j] for the 16 keys (unscaled): per key and query a 16-lane partial
  // vector, reduced by reduce_block. Prefetches the K rows at kbase + pfoff[0 .. npf), two per
  // key pair.
  template <int R>
  inline void scores(const QType* q, const T* const* krow, __m512* s,
                     const int64_t* pfoff = nullptr, int npf = 0) const {
    reduce_block<R>(
        [&](int j, const auto& emit) {
          prefetch_pair(kbase, pfoff, j, npf);
          Dot ka, kb;
          ka.load(krow[j]);
          kb.load(krow[j + 1]);
#pragma GCC unroll 4
          for (int t = 0; t < R; ++t) emit(t, ka.dot(q + t * D), kb.dot(q + t * D));
        },
        s);
  }

#if defined(__AVX512BF16__)
  // acc += p @ V with vdpbf16ps over pairs of keys: p rounded to bf16, the V rows of keys j and
  // j + 1 interleaved by unpacklo / unpackhi_epi16 (accumulated in the pair layout).
  // Prefetches the V rows at vbase + pfoff[0 .. npf), two per key pair.
  template <int R>
  inline void accumulate_pairs(const float (*p)[kBlock16], const T* const* vrow, int nb,
                               Acc<R>& a, const int64_t* pfoff = nullptr, int npf = 0) const {
    alignas(64) uint32_t pp[R][kBlock16 / 2];  // bf16 pairs (p_j, p_j+1), p_j in the low half
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[t]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[t])));
    }
    for (int jj = 0; jj < kBlock16; jj += 2) {
      prefetch_pair(vbase, pfoff, jj, npf);
      if (jj >= nb) continue;
      const T* va = vrow[jj];
      const T* vb = vrow[jj + 1];  // vrow[nb] is a padding row when nb is odd (p = 0)
#pragma GCC unroll 8
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(va + c * 32);
        const __m512i y = _mm512_loadu_si512(vb + c * 32);
        const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(x, y);
        const __m512bh vh = (__m512bh)_mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[t][jj / 2]));
          a.v[t][2 * c] = _mm512_dpbf16_ps(a.v[t][2 * c], pj, vl);
          a.v[t][2 * c + 1] = _mm512_dpbf16_ps(a.v[t][2 * c + 1], pj, vh);
        }
      }
    }
  }
#else
  template <int R>
  inline void accumulate_pairs(const float (*)[kBlock16], const T* const*, int, Acc<R>&,
                               const int64_t* = nullptr, int = 0) const {}
#endif
};


#if defined(__AVX512VNNI__)
constexpr bool kHaveInt8Scan = true;
// int8 pools (`kv_cache_dtype=int8`): every (slot, KV head) row holds D int8 codes and one fp32
// scale, the row's value being code * scale. Per query tile, each query is quantized to int8 the
// same way (symmetric, its own scale; stays in registers). Q K^T: vpdpbusd on the key codes
// offset to unsigned (k + 128) and the signed query codes, the offset's 128 * sum(q) taken off,
// 64 products per instruction, fp32 from the int32 sums times q scale, k scale and the softmax
// scale. Online softmax in fp32 as above. P V: p times the value row's scale, as 15-bit integers
// against the block's largest value scale (p <= 1, so p * scale_j * 32767 / max scale fits; the
// rounding error is at most 2^-16 of that scale, below the bf16 scan's rounding of p); the codes
// sign-extended to int16 and vpdpwssd over pairs of keys (the bf16 scan's pair layout) sum exact
// int32 products per block, folded into the fp32 accumulators once per block (half the
// instructions of fp32 FMA on the converted codes). Head dims not a multiple of 32 take the
// fp32 FMA.
template <int D>
struct KeyScanI8 : TiledScan<KeyScanI8<D>, float, D> {
  using Base = TiledScan<KeyScanI8<D>, float, D>;
  using Base::NV;
  using typename Base::QType;
  static constexpr int NC = (D + 63) / 64;  // 64-byte chunks of a row
  // P V in int16 pairs (vpdpwssd) needs whole 32-element chunks; other head dims take fp32 FMA
  // on the codes converted to fp32.
  static constexpr bool kPairPV = D % 32 == 0;
  static constexpr bool kPairAcc = kPairPV;

  const int8_t* kbase;  // k codes + kv_head * head stride
  const int8_t* vbase;
  int64_t stride;  // elements between consecutive slots
  const float* ksbase;  // k scales + kv_head * scale head stride
  const float* vsbase;
  int64_t sstride;  // scales between consecutive slots
  float scale;
  int64_t ahead;  // blocks whose rows are prefetched ahead (2 * prefetch_blocks())

  static inline __m512i chunk(const int8_t* p, int c) {
    if constexpr (D % 64 == 0) {
      return _mm512_loadu_si512(p + c * 64);
    } else {
      if (c + 1 < NC) return _mm512_loadu_si512(p + c * 64);
      return _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (D % 64)) - 1), p + c * 64);
    }
  }

  // Query t as int8 codes (zero past D), its scale and 128 * the sum of its codes.
  template <int R>
  static inline void quantize_queries(const float* q, __m512i (*q8)[NC], float* qs,
                                      int32_t* qoff) {
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      __m512 mx = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(q + t * D + v * 16)));
      const float amax = _mm512_reduce_max_ps(mx);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      qs[t] = amax / 127.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        __m512i z = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const int v = 4 * c + u;
          if (v < NV) {
            const __m512i x =
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + t * D + v * 16), vinv));
            sum = _mm512_add_epi32(sum, x);
            z = _mm512_inserti32x4(z, _mm512_cvtsepi32_epi8(x), u);
          }
        }
        q8[t][c] = z;
      }
      qoff[t] = 128 * _mm512_reduce_add_epi32(sum);
    }
  }

  template <int R>
  using Acc = typename Base::template Acc<R>;

  // Value row `row`'s codes for dims 16 c .. 16 c + 15 as fp32 (the fp32 FMA P V).
  static inline __m512 value_chunk(const int8_t* row, int c) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16))));
  }

  template <int R>
  inline void scan(const QType* q, const int32_t* idx, int64_t n, float* m, float* l,
                   float* acc, bool prefetch) const {
    __m512i q8[R][NC];
    float qs[R];
    int32_t qoff[R];
    quantize_queries<R>(q, q8, qs, qoff);
    Acc<R> a;
    Base::template load_acc<R>(acc, a);
    float mx[R];
    __m512 lv[R];
    __m512 qscale[R];
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      mx[t] = m[t];
      lv[t] = _mm512_maskz_mov_ps(1, _mm512_castps128_ps512(_mm_set_ss(l[t])));
      qscale[t] = _mm512_set1_ps(scale * qs[t]);
    }
    const int8_t* krow[kBlock16];
    const int8_t* vrow[kBlock16 + 1];
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    const __m512i vsstride = _mm512_set1_epi32(static_cast<int32_t>(sstride));
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t j0 = 0; j0 < n; j0 += kBlock16) {
      const int nb = static_cast<int>(std::min<int64_t>(kBlock16, n - j0));
      for (int jj = 0; jj < nb; ++jj) {
        const int64_t off = static_cast<int64_t>(idx[j0 + jj]) * stride;
        krow[jj] = kbase + off;
        vrow[jj] = vbase + off;
      }
      for (int jj = nb; jj < kBlock16; ++jj) krow[jj] = krow[0];
      vrow[nb] = vrow[0];  // the pair partner of an odd last key (its p is 0)
      const int64_t pf0 = j0 + ahead * kBlock16;
      const int64_t pf1 = ahead > 0 && prefetch ? std::min(n, pf0 + kBlock16) : 0;
      for (int64_t j = pf0; j < pf1; ++j) {
        prefetch_row(kbase + static_cast<int64_t>(idx[j]) * stride, D);
        // the scales' lines too (the gathers below would wait for each miss)
        const int64_t so = static_cast<int64_t>(idx[j]) * sstride;
        _mm_prefetch(reinterpret_cast<const char*>(ksbase + so), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vsbase + so), _MM_HINT_T0);
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1u);
      const __m512i slots = _mm512_maskz_loadu_epi32(valid, idx + j0);
      const __m512i soff = _mm512_mullo_epi32(slots, vsstride);
      const __m512 ks = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, soff, ksbase, 4);
      __m512i s[R];
      scores<R>(q8, krow, flip, s);
      for (int64_t j = pf0; j < pf1; ++j) {
        prefetch_row(vbase + static_cast<int64_t>(idx[j]) * stride, D);
      }
      const __m512 vs = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, soff, vsbase, 4);
      // What p is multiplied by: the value row's scale (fp32 P V), or that scale in units of the
      // block's largest / 32767 (int16 P V, folded back by `unit`).
      __m512 pw = vs;
      float unit = 1.f;
      if constexpr (kPairPV) {
        const float top = _mm512_reduce_max_ps(vs);
        unit = top / 32767.f;
        pw = _mm512_mul_ps(vs, _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f));
      }
      alignas(64) float p[R][kBlock16];
#pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        const __m512 raw = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[t], _mm512_set1_epi32(qoff[t])));
        const __m512 st = _mm512_mask_mul_ps(neg_inf, valid, raw, _mm512_mul_ps(ks, qscale[t]));
        const __m512 mv = online_max<NV>(st, mx[t], lv[t], a.v[t]);
        const __m512 pv = exp_masked(valid, _mm512_sub_ps(st, mv));  // 0 for padding
        lv[t] = _mm512_add_ps(lv[t], pv);
        _mm512_store_ps(p[t], _mm512_mul_ps(pv, pw));  // the value row's scale folded into p
      }
      if constexpr (kPairPV) {
        accumulate_pairs<R>(p, vrow, nb, _mm512_set1_ps(unit), a);
      } else {
        Base::template accumulate_fma<R>(p, vrow, nb, a);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      m[t] = mx[t];
      l[t] = _mm512_reduce_add_ps(lv[t]);
    }
    Base::template store_acc<R>(a, acc);
  }

  // acc += p @ V codes (see the top of this scan): p (times pw) as int16 pairs, pairs of keys'
  // codes (int16) by vpdpwssd into exact int32 sums (at most 16 * 32767 * 128 < 2^31), folded
  // into the fp32 accumulators times `unit`.
  template <int R>
  inline void accumulate_pairs(const float (*p)[kBlock16], const int8_t* const* vrow, int nb,
                               __m512 unit, Acc<R>& a) const {
    alignas(64) uint32_t pp[R][kBlock16 / 2];  // int16 pairs (p_j, p_j+1), p_j in the low half
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_load_ps(p[t]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[t]), _mm512_cvtsepi32_epi16(qi));
    }
    __m512i sum[R][NV];
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) sum[t][c] = _mm512_setzero_si512();
    for (int jj = 0; jj < nb; jj += 2) {
      const int8_t* va = vrow[jj];
      const int8_t* vb = vrow[jj + 1];
#pragma GCC unroll 8
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i x = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + c * 32)));
        const __m512i y = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + c * 32)));
        const __m512i vl = _mm512_unpacklo_epi16(x, y);
        const __m512i vh = _mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const __m512i pj = _mm512_set1_epi32(static_cast<int>(pp[t][jj / 2]));
          sum[t][2 * c] = _mm512_dpwssd_epi32(sum[t][2 * c], vl, pj);
          sum[t][2 * c + 1] = _mm512_dpwssd_epi32(sum[t][2 * c + 1], vh, pj);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c)
        a.v[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t][c]), unit, a.v[t][c]);
  }

  // s[t] lane j = sum over d of (k_j[d] + 128) * q_t[d] for the 16 keys, in int32: per key and
  // query a 16-lane partial from vpdpbusd, reduced as the bf16 scan's scores.
  template <int R>
  inline void scores(const __m512i (*q8)[NC], const int8_t* const* krow, __m512i flip,
                     __m512i* s) const {
    auto dot = [&](int t, const __m512i* ku) {
      __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc = _mm512_dpbusd_epi32(acc, ku[c], q8[t][c]);
      return acc;
    };
    reduce_block<R>(
        [&](int j, const auto& emit) {
          __m512i ka[NC], kb[NC];
#pragma GCC unroll 4
          for (int c = 0; c < NC; ++c) {
            ka[c] = _mm512_xor_si512(chunk(krow[j], c), flip);
            kb[c] = _mm512_xor_si512(chunk(krow[j + 1], c), flip);
          }
#pragma GCC unroll 4
          for (int t = 0; t < R; ++t) emit(t, dot(t, ka), dot(t, kb));
        },
        s);
  }
};
#else
constexpr bool kHaveInt8Scan = false;
#endif  // __AVX512VNNI__

#else  // not AVX-512

// One online-softmax step over a block's scores s[0..kBlock) (the first nb real, the rest set to
// -inf here): new running max m, s becomes the probabilities exp(s - m), l = l * alpha + their
// sum; returns alpha = exp(m_old - m) (0 while m_old is -inf).
inline float softmax_block(float* s, int64_t nb, float& m, float& l) {
  for (int64_t jj = nb; jj < kBlock; ++jj) s[jj] = kNegInf;
  Vec mx = Vec::loadu(s);
  for (int64_t c = kVec; c < kBlock; c += kVec) mx = at::vec::maximum(mx, Vec::loadu(s + c));
  const float m_new = std::max(m, hmax(mx));
  const float alpha = std::exp(m - m_new);
  const Vec vm(m_new);
  Vec sum(0.f);
  for (int64_t c = 0; c < kBlock; c += kVec) {
    const Vec p = (Vec::loadu(s + c) - vm).exp_u20();  // exp(-inf) = 0 for padding
    p.store(s + c);
    sum = sum + p;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

// Online softmax of `nq` fp32 queries (already scaled) over a list of pool slots of one KV head.
// Keys go in blocks of kBlock; within a block, queries go in tiles of TQ whose accumulators stay
// in vector registers while each key row is loaded (and converted to fp32) once per tile.
template <typename T, int D>
struct KeyScan {
  static_assert(D % kVec == 0, "head_dim must be a whole number of vectors");
  static constexpr int NV = D / kVec;
  static constexpr int TQ = std::max(1, std::min(4, 12 / NV));
  static constexpr int64_t kD = D;

  using QType = float;

  const T* kbase;  // k_buffer + kv_head * D
  const T* vbase;  // v_buffer + kv_head * D
  int64_t stride;  // elements between consecutive slots
  float scale;
  int64_t ahead;  // AVX2: blocks whose rows are prefetched ahead (prefetch_blocks())
  bool l1;  // AVX2: whether they go into L1 (prefetch_l1())

  // Queries scaled and converted to fp32.
  template <typename S>
  static void load_queries(const S* src, int64_t n, float scale, QType* dst) {
    for (int64_t e = 0; e < n * D; ++e) dst[e] = static_cast<float>(src[e]) * scale;
  }

  // The K and V rows of the nb keys at slots idx[0..nb).
  void block_rows(const int32_t* idx, int64_t nb, const T** kr, const T** vr) const {
    for (int64_t jj = 0; jj < nb; ++jj) {
      kr[jj] = kbase + idx[jj] * stride;
      vr[jj] = vbase + idx[jj] * stride;
    }
  }

  // `run` for a cascade group's rows over their shared prefix.
  void run_group(const float* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
                 float* acc, int64_t group_rows) const {
#if defined(CPU_CAPABILITY_AVX2)
    if (group_rows >= kBlockGroupRows) {
      const auto slot_of = [idx](int64_t j) { return static_cast<int64_t>(idx[j]); };
      const auto no_row_skips = [](int64_t) { return int64_t{0}; };
      const auto every_key = [](int64_t, int64_t, int64_t nb) { return nb; };
      thread_local fma_attention::Scratch sc;
      fma_attention::attend<T, D>(q, nq, n, slot_of, no_row_skips, every_key, kbase, vbase,
                                  stride, m, l, acc, sc);
      return;
    }
#else
    (void)group_rows;
#endif
    run(q, nq, idx, n, m, l, acc);
  }

#if defined(CPU_CAPABILITY_AVX2)
  // AVX2: tiles of up to kTileQueries queries whose scores and outputs stay in registers, every
  // K/V row read (and, from a 16-bit pool, converted) in registers once per tile.
  static constexpr int kTileQueries = 3;
  // Head-dim vectors per P V pass: kTileQueries x kPass accumulators, kTileQueries
  // probabilities and one V vector fill the 16 ymm registers.
  static constexpr int kPass = fma_attention::largest_divisor(NV, 4);

  // The rows of the keys `ahead` blocks on, fetched a few per score group of the block.
  struct Prefetch {
    const T* const* k = nullptr;
    const T* const* v = nullptr;
    int64_t n = 0;
    bool l1 = false;
    RADIXRT_HOT_INLINE void rows(int64_t from, int64_t to) const {
      for (int64_t j = from; j < std::min(to, n); ++j) {
        prefetch_row(k[j], D * sizeof(T), l1);
        prefetch_row(v[j], D * sizeof(T), l1);
      }
    }
    static const Prefetch& none() {
      static const Prefetch p;
      return p;
    }
  };

  // Eight values of a pool row (or of a converted fp32 row) as fp32.
  template <typename E>
  static RADIXRT_HOT_INLINE __m256 row8(const E* p) {
    if constexpr (std::is_same_v<E, float>) {
      return _mm256_loadu_ps(p);
    } else if constexpr (std::is_same_v<E, at::Half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      static_assert(std::is_same_v<E, at::BFloat16>, "float, Half or BFloat16 rows");
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    }
  }

  // s[t][j .. j + 4) = q_t · k_u for the TQ queries q (stride D) and the four key rows kr: per
  // (query, key) a product vector accumulated over the head dim (q_t c * k_u c, in order of c),
  // then four keys reduced together by horizontal adds. A query's bits never depend on TQ.
  template <int TQ, typename E>
  static RADIXRT_HOT_INLINE void scores4(const float* q, const E* const* kr,
                                         float (*s)[kBlock], int64_t j) {
    __m256 a[TQ][4];
    __m256 qv[TQ];
#pragma GCC unroll 4
    for (int t = 0; t < TQ; ++t) qv[t] = _mm256_loadu_ps(q + t * D);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m256 kv = row8<E>(kr[u]);
#pragma GCC unroll 4
      for (int t = 0; t < TQ; ++t) a[t][u] = _mm256_mul_ps(qv[t], kv);
    }
#pragma GCC unroll 16
    for (int c = 1; c < NV; ++c) {
#pragma GCC unroll 4
      for (int t = 0; t < TQ; ++t) qv[t] = _mm256_loadu_ps(q + t * D + c * kVec);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 kv = row8<E>(kr[u] + c * kVec);
#pragma GCC unroll 4
        for (int t = 0; t < TQ; ++t) a[t][u] = _mm256_fmadd_ps(qv[t], kv, a[t][u]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TQ; ++t) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[t][0], a[t][1]),
                                      _mm256_hadd_ps(a[t][2], a[t][3]));
      _mm_storeu_ps(&s[t][j], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }

  // o_t = o_t * alpha_t + sum over j < nb of p[t][j] * v_j for the TQ outputs o (stride D),
  // kPass vectors of the head dim at a time, keys in order.
  template <int TQ, typename E>
  static RADIXRT_HOT_INLINE void accumulate(const float (*p)[kBlock], const E* const* vr,
                                            int64_t nb, const float* alpha, float* o) {
#pragma GCC unroll 1
    for (int c0 = 0; c0 < NV; c0 += kPass) {
      __m256 av[TQ][kPass];
#pragma GCC unroll 4
      for (int t = 0; t < TQ; ++t) {
        const __m256 va = _mm256_set1_ps(alpha[t]);
#pragma GCC unroll 4
        for (int c = 0; c < kPass; ++c) {
          av[t][c] = _mm256_mul_ps(_mm256_loadu_ps(o + t * D + (c0 + c) * kVec), va);
        }
      }
      for (int64_t j = 0; j < nb; ++j) {
        __m256 pb[TQ];
#pragma GCC unroll 4
        for (int t = 0; t < TQ; ++t) pb[t] = _mm256_broadcast_ss(&p[t][j]);
#pragma GCC unroll 4
        for (int c = 0; c < kPass; ++c) {
          const __m256 vv = row8<E>(vr[j] + (c0 + c) * kVec);
#pragma GCC unroll 4
          for (int t = 0; t < TQ; ++t) av[t][c] = _mm256_fmadd_ps(pb[t], vv, av[t][c]);
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < TQ; ++t) {
#pragma GCC unroll 4
        for (int c = 0; c < kPass; ++c) _mm256_storeu_ps(o + t * D + (c0 + c) * kVec, av[t][c]);
      }
    }
  }

  // One block of nb keys (rows kr / vr) through the state of TQ queries.
  template <int TQ, typename E>
  static void block(const float* q, const E* const* kr, const E* const* vr, int64_t nb,
                    float* m, float* l, float* acc, const Prefetch& pf) {
    alignas(64) float scores[TQ][kBlock];
    for (int64_t j = 0; j < nb; j += 4) {
      // a partial group repeats the block's last key; its extra scores are masked below
      const E* k4[4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) k4[u] = kr[std::min<int64_t>(j + u, nb - 1)];
      pf.rows(j, j + 4);
      scores4<TQ, E>(q, k4, scores, j);
    }
    pf.rows(nb, kBlock);
    float alpha[TQ];
    for (int t = 0; t < TQ; ++t) alpha[t] = softmax_block(scores[t], nb, m[t], l[t]);
    accumulate<TQ, E>(scores, vr, nb, alpha, acc);
  }

  // Queries in tiles of at most kTileQueries over one block's rows.
  template <typename E>
  static void tiles(const float* q, int64_t nq, const E* const* kr, const E* const* vr,
                    int64_t nb, float* m, float* l, float* acc, const Prefetch& pf) {
    for (int64_t t0 = 0; t0 < nq; t0 += kTileQueries) {
      const float* qt = q + t0 * D;
      const Prefetch& p = t0 == 0 ? pf : Prefetch::none();  // the first tile fetches ahead
      switch (std::min<int64_t>(kTileQueries, nq - t0)) {
        case 1: block<1, E>(qt, kr, vr, nb, m + t0, l + t0, acc + t0 * D, p); break;
        case 2: block<2, E>(qt, kr, vr, nb, m + t0, l + t0, acc + t0 * D, p); break;
        default: block<3, E>(qt, kr, vr, nb, m + t0, l + t0, acc + t0 * D, p); break;
      }
    }
  }

  // Runs keys idx[0..n) through the state (m[i], l[i], acc[i, :]) of each query q[i, :]. A
  // 16-bit pool's rows are converted in registers by each tile; with more queries than one
  // tile, once per block into fp32 rows that every tile reads.
  void run(const float* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
           float* acc) const {
    const T* krow[kBlock];
    const T* vrow[kBlock];
    constexpr bool kWide = std::is_same_v<T, float>;
    constexpr int64_t kConv = kWide ? 1 : kBlock * D;
    alignas(64) float kconv[kConv];
    alignas(64) float vconv[kConv];
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t nb = std::min(kBlock, n - j0);
      block_rows(idx + j0, nb, krow, vrow);
      // The rows `ahead` blocks on, fetched while this block is computed.
      Prefetch pf;
      const T* pk[kBlock];
      const T* pv[kBlock];
      if (ahead > 0) {
        const int64_t p0 = j0 + ahead * kBlock;
        pf = Prefetch{pk, pv, std::clamp<int64_t>(n - p0, 0, kBlock), l1};
        for (int64_t jj = 0; jj < pf.n; ++jj) {
          const int64_t slot = idx[p0 + jj];
          pk[jj] = kbase + slot * stride;
          pv[jj] = vbase + slot * stride;
        }
      }
      if (kWide || nq <= kTileQueries) {
        tiles<T>(q, nq, krow, vrow, nb, m, l, acc, pf);
        continue;
      }
      const float* kf[kBlock];
      const float* vf[kBlock];
      for (int64_t jj = 0; jj < nb; ++jj) {
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) {
          _mm256_storeu_ps(kconv + jj * D + c * kVec, row8<T>(krow[jj] + c * kVec));
          _mm256_storeu_ps(vconv + jj * D + c * kVec, row8<T>(vrow[jj] + c * kVec));
        }
        kf[jj] = kconv + jj * D;
        vf[jj] = vconv + jj * D;
      }
      tiles<float>(q, nq, kf, vf, nb, m, l, acc, pf);
    }
  }
#else
  // Runs keys idx[0..n) through the state (m[i], l[i], acc[i, :]) of each query q[i, :].
  void run(const float* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
           float* acc) const {
    const T* krow[kBlock];
    const T* vrow[kBlock];
    alignas(64) float scores[TQ][kBlock];
    // converted rows of a 16-bit pool's block (unused for fp32 pools)
    constexpr int64_t kConv = std::is_same_v<T, float> ? 1 : kBlock * D;
    alignas(64) float kconv[kConv];
    alignas(64) float vconv[kConv];
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t nb = std::min(kBlock, n - j0);
      block_rows(idx + j0, nb, krow, vrow);
      // Start fetching the next block's rows while this one is computed.
      const int64_t next_end = std::min(n, j0 + 2 * kBlock);
      for (int64_t j = j0 + nb; j < next_end; ++j) {
        const int64_t slot = idx[j];
        prefetch_row(kbase + slot * stride, D * sizeof(T));
        prefetch_row(vbase + slot * stride, D * sizeof(T));
      }
      // The block's rows as fp32: the pool's own rows for an fp32 pool; a 16-bit pool's
      // converted once here for every query of the call (exact), not once per query (Zen 1,
      // float16 pool under fp32 queries, batch 64: per-query conversion made the step 1.09x
      // slower than an fp32 pool, the conversions costing as much as the FMAs).
      const float* kf[kBlock];
      const float* vf[kBlock];
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t jj = 0; jj < nb; ++jj) {
          kf[jj] = krow[jj];
          vf[jj] = vrow[jj];
        }
      } else {
        for (int64_t jj = 0; jj < nb; ++jj) {
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) {
            load_f32<T>(krow[jj] + c * kVec).store(kconv + jj * D + c * kVec);
            load_f32<T>(vrow[jj] + c * kVec).store(vconv + jj * D + c * kVec);
          }
          kf[jj] = kconv + jj * D;
          vf[jj] = vconv + jj * D;
        }
      }
      for (int64_t t0 = 0; t0 < nq; t0 += TQ) {
        const int64_t tq = std::min<int64_t>(TQ, nq - t0);
        const float* qt = q + t0 * D;
        // Scores of the tile's queries against the block's keys.
        int64_t jj = 0;
        for (; jj < nb; ++jj) {
          Vec kv[NV];
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) kv[c] = Vec::loadu(kf[jj] + c * kVec);
#pragma GCC unroll 4
          for (int t = 0; t < TQ; ++t) {
            if (t < tq) {
              Vec a = Vec::loadu(qt + t * D) * kv[0];
#pragma GCC unroll 16
              for (int c = 1; c < NV; ++c) {
                a = at::vec::fmadd(Vec::loadu(qt + t * D + c * kVec), kv[c], a);
              }
              scores[t][jj] = hsum(a);
            }
          }
        }
        // Online softmax: new running max, rescale factor, probabilities in place.
        float alpha[TQ];
        for (int t = 0; t < tq; ++t) alpha[t] = softmax_block(scores[t], nb, m[t0 + t], l[t0 + t]);
        // acc = acc * alpha + p @ V, accumulators in registers.
        Vec av[TQ][NV];
#pragma GCC unroll 4
        for (int t = 0; t < TQ; ++t) {
          if (t < tq) {
            const Vec va(alpha[t]);
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) av[t][c] = Vec::loadu(acc + (t0 + t) * D + c * kVec) * va;
          }
        }
        for (int64_t jj = 0; jj < nb; ++jj) {
          Vec vv[NV];
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) vv[c] = Vec::loadu(vf[jj] + c * kVec);
#pragma GCC unroll 4
          for (int t = 0; t < TQ; ++t) {
            if (t < tq) {
              const Vec p(scores[t][jj]);
#pragma GCC unroll 16
              for (int c = 0; c < NV; ++c) av[t][c] = at::vec::fmadd(p, vv[c], av[t][c]);
            }
          }
        }
#pragma GCC unroll 4
        for (int t = 0; t < TQ; ++t) {
          if (t < tq) {
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) av[t][c].store(acc + (t0 + t) * D + c * kVec);
          }
        }
      }
    }
  }
#endif  // CPU_CAPABILITY_AVX2
};

#endif  // CPU_CAPABILITY_AVX512

#if !defined(CPU_CAPABILITY_AVX512)
constexpr bool kHaveInt8Scan = false;
#endif

// One unit of parallel work: either a request row's own keys (for one KV head), or a chunk of a
// group's rows against the group's shared prefix (for one KV head).
struct Item {
  int64_t cost;  // keys x queries, for ordering (largest first)
  int32_t group;  // -1 for a row item
  int32_t first;  // row item: the row; group item: first index into group_rows
  int32_t last;  // group item: one past the last index into group_rows
  int32_t kv_head;
};

// The cascade and row phases over any key scan. `scan_for(h)` makes the Scan of KV head h;
// `slots` bounds every kv index. Queries and outputs are QT.
template <typename QT, typename Scan, typename ScanFor>
void paged_decode_run(const Tensor& q, int64_t Hkv, int64_t slots, const Tensor& kv_indices,
                      const Tensor& row_start, const Tensor& row_len, const Tensor& group_start,
                      const Tensor& group_len, const Tensor& group_row_ptr,
                      const Tensor& group_rows, float scale, const ScanFor& scan_for,
                      Tensor& out, Tensor& lse) {
  constexpr int64_t D = Scan::kD;
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t G = H / Hkv;
  const int64_t num_groups = group_start.size(0);
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  float* lp = lse.data_ptr<float>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* rl = row_len.data_ptr<int64_t>();
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t* gl = group_len.data_ptr<int64_t>();
  const int64_t* gptr = group_row_ptr.data_ptr<int64_t>();
  const int64_t* grows = group_rows.data_ptr<int64_t>();

  // Every slot is checked once here, so the scans read rows without checks.
  {
    const int32_t* ip = kv_indices.data_ptr<int32_t>();
    const int64_t n = kv_indices.numel();
    int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
    for (int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, ip[i]);
      hi = std::max(hi, ip[i]);
    }
    if (n > 0 && (lo < 0 || hi >= slots)) {
      const int32_t bad = lo < 0 ? lo : hi;
      TORCH_CHECK(false, "paged_decode: kv slot ", bad, " out of range [0, ", slots, ")");
    }
  }
  using QType = typename Scan::QType;
  // Query i of a (row, kv head) pair is query head h * G + i, as the scan takes it.
  auto load_queries = [&](int64_t b, int64_t h, QType* dst) {
    Scan::load_queries(qp + (b * H + h * G) * D, G, scale, dst);
  };

  // Phase 1: shared prefixes. State of (row b, head) saved for the row's own pass.
  std::vector<uint8_t> grouped(B, 0);
  // (m, l, acc) per (row, head): one buffer, shared by a team's members (team_empty), each
  // initializing its share before any is written.
  Tensor pre;
  float *pre_m = nullptr, *pre_l = nullptr, *pre_acc = nullptr;
  if (num_groups > 0) {
    pre = team_empty({B * H * (D + 2)}, at::TensorOptions().dtype(at::kFloat));
    pre_m = pre.data_ptr<float>();
    pre_l = pre_m + B * H;
    pre_acc = pre_l + B * H;
    TeamMember* member = team_member();
    const auto [p0, p1] = member ? member->rows(B * H) : std::pair<int64_t, int64_t>{0, B * H};
    std::fill(pre_m + p0, pre_m + p1, kNegInf);
    std::fill(pre_l + p0, pre_l + p1, 0.f);
    std::fill(pre_acc + p0 * D, pre_acc + p1 * D, 0.f);
    if (member) member->barrier();
    std::vector<Item> items;
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t r0 = gptr[g], r1 = gptr[g + 1];
      TORCH_CHECK(gs[g] >= 0 && gl[g] >= 0 && gs[g] + gl[g] <= kv_indices.size(0),
                  "paged_decode: group ", g, " keys out of kv_indices");
      for (int64_t r = r0; r < r1; ++r) {
        TORCH_CHECK(grows[r] >= 0 && grows[r] < B && !grouped[grows[r]],
                    "paged_decode: group_rows must be distinct batch rows");
        grouped[grows[r]] = 1;
      }
    }
    // Split each group's rows into chunks so every thread has work; a chunk reads the prefix
    // once for all of its rows.
    const int64_t threads = call_threads();
    const int64_t per_group = std::max<int64_t>(1, (2 * threads + num_groups * Hkv - 1) /
                                                       (num_groups * Hkv));
    const int64_t max_rows = std::max<int64_t>(1, kMaxChunkRows * 3 / std::max<int64_t>(G, 1));
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t r0 = gptr[g], n = gptr[g + 1] - r0;
      if (n == 0 || gl[g] == 0) continue;
      int64_t chunk = std::max<int64_t>(kMinChunkRows, (n + per_group - 1) / per_group);
      chunk = std::min(chunk, max_rows);
      for (int64_t c = 0; c < n; c += chunk) {
        const int64_t c1 = std::min(n, c + chunk);
        for (int64_t h = 0; h < Hkv; ++h) {
          items.push_back({gl[g] * (c1 - c) * G, static_cast<int32_t>(g),
                           static_cast<int32_t>(r0 + c), static_cast<int32_t>(r0 + c1),
                           static_cast<int32_t>(h)});
        }
      }
    }
    run_largest_first(items, min_parallel_attention_work(), [&](const Item& it) {
      thread_local std::vector<QType> qbuf;
      thread_local std::vector<float> mbuf, lbuf, abuf;
      const int64_t rows = it.last - it.first, nq = rows * G;
      qbuf.resize(nq * D);
      mbuf.assign(nq, kNegInf);
      lbuf.assign(nq, 0.f);
      abuf.assign(nq * D, 0.f);
      for (int64_t r = 0; r < rows; ++r) load_queries(grows[it.first + r], it.kv_head, &qbuf[r * G * D]);
      scan_for(it.kv_head)
          .run_group(qbuf.data(), nq, idx + gs[it.group], gl[it.group], mbuf.data(),
                     lbuf.data(), abuf.data(),
                     gptr[it.group + 1] - gptr[it.group]);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = grows[it.first + r] * H + it.kv_head * G;
        for (int64_t i = 0; i < G; ++i) {
          pre_m[base + i] = mbuf[r * G + i];
          pre_l[base + i] = lbuf[r * G + i];
          std::copy_n(&abuf[(r * G + i) * D], D, &pre_acc[(base + i) * D]);
        }
      }
    });
  }

  // Phase 2: every row's own keys, continuing from its prefix state; then normalize. A long
  // row's keys go in parts (row_split, work_queue.h): each part's item leaves its state in
  // `parts_state`, the first continuing from the prefix, and the row is merged after every
  // item ran. Items come in for_each_row_item's order, which attention_keeps_rows counts too.
  const int64_t threads = call_threads();
  std::vector<RowSplit> splits(B);
  std::vector<int64_t> part_base(B, -1);  // row b's first part state (per KV head), or -1
  int64_t num_parts = 0;
  std::vector<Item> items;
  items.reserve(B * Hkv);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rs[b] >= 0 && rl[b] >= 0 && rs[b] + rl[b] <= kv_indices.size(0),
                "paged_decode: row ", b, " keys out of kv_indices");
  }
  for_each_row_item(rl, B, Hkv, threads,
                    [&](int64_t b, int64_t h, int64_t p, int64_t keys, const RowSplit& sp) {
    if (h == 0 && p == 0) {
      splits[b] = sp;
      if (sp.parts > 1) {
        part_base[b] = num_parts;
        num_parts += sp.parts;
      }
    }
    items.push_back({keys * G, -1, static_cast<int32_t>(b), static_cast<int32_t>(p),
                     static_cast<int32_t>(h)});
  });
  // (m, l, acc) of G queries per (part, KV head): [num_parts][Hkv][G * (D + 2)].
  const int64_t state_size = G * (D + 2);
  Tensor parts_state;
  float* ps = nullptr;
  if (num_parts > 0) {
    parts_state = team_empty({num_parts * Hkv * state_size},
                             at::TensorOptions().dtype(at::kFloat));
    ps = parts_state.data_ptr<float>();
  }
  // Output and LSE of (row b, KV head h) from its state.
  auto write_row = [&](int64_t b, int64_t h, const float* m, const float* l, const float* acc) {
    const int64_t base = b * H + h * G;
    for (int64_t i = 0; i < G; ++i) {
      QT* o = op + (base + i) * D;
      const float li = l[i];
      if (li > 0.f) {
        const float inv = 1.f / li;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<QT>(acc[i * D + d] * inv);
        lp[base + i] = m[i] + std::log(li);
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<QT>(0.f);
        lp[base + i] = kNegInf;
      }
    }
  };
  TeamMember* member = team_member();
  const bool stay = member != nullptr && member->rows_stay;  // run_largest_first clears it
  run_largest_first(items, min_parallel_attention_work(), [&](const Item& it) {
    thread_local std::vector<QType> qbuf;
    thread_local std::vector<float> mbuf, lbuf, abuf;
    const int64_t b = it.first, h = it.kv_head, p = it.last;
    const RowSplit& sp = splits[b];
    qbuf.resize(G * D);
    load_queries(b, h, qbuf.data());
    const int64_t base = b * H + h * G;
    if (grouped[b] && p == 0) {
      mbuf.assign(pre_m + base, pre_m + base + G);
      lbuf.assign(pre_l + base, pre_l + base + G);
      abuf.assign(pre_acc + base * D, pre_acc + (base + G) * D);
    } else {
      mbuf.assign(G, kNegInf);
      lbuf.assign(G, 0.f);
      abuf.assign(G * D, 0.f);
    }
    scan_for(h).run(qbuf.data(), G, idx + rs[b] + p * sp.len, sp.keys_of(p, rl[b]),
                    mbuf.data(), lbuf.data(), abuf.data());
    if (sp.parts == 1) return write_row(b, h, mbuf.data(), lbuf.data(), abuf.data());
    float* st = ps + ((part_base[b] + p) * Hkv + h) * state_size;
    std::copy_n(mbuf.data(), G, st);
    std::copy_n(lbuf.data(), G, st + G);
    std::copy_n(abuf.data(), G * D, st + 2 * G);
  });
  if (num_parts == 0) return;
  // Merge each split (row, KV head)'s parts in key order: the same bits whoever merges.
  auto merge = [&](int64_t b, int64_t h) {
    thread_local std::vector<float> mbuf, lbuf, abuf;
    mbuf.assign(G, kNegInf);
    lbuf.assign(G, 0.f);
    abuf.assign(G * D, 0.f);
    const int64_t np = splits[b].parts;
    for (int64_t i = 0; i < G; ++i) {
      float mx = kNegInf;
      for (int64_t p = 0; p < np; ++p) {
        mx = std::max(mx, ps[((part_base[b] + p) * Hkv + h) * state_size + i]);
      }
      if (mx == kNegInf) continue;  // no part saw a key (l stays 0)
      float* a = abuf.data() + i * D;
      for (int64_t p = 0; p < np; ++p) {
        const float* st = ps + ((part_base[b] + p) * Hkv + h) * state_size;
        if (st[G + i] == 0.f) continue;
        const float w = std::exp(st[i] - mx);
        lbuf[i] += st[G + i] * w;
        const float* src = st + 2 * G + i * D;
        for (int64_t d = 0; d < D; ++d) a[d] += src[d] * w;
      }
      mbuf[i] = mx;
    }
    write_row(b, h, mbuf.data(), lbuf.data(), abuf.data());
  };
  std::vector<std::pair<int32_t, int32_t>> merges;  // (row, KV head), row-major
  for (int64_t b = 0; b < B; ++b) {
    if (splits[b].parts == 1) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      merges.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h)});
    }
  }
  const int64_t nm = static_cast<int64_t>(merges.size());
  if (member == nullptr) {
    at::parallel_for(0, nm, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t i = m0; i < m1; ++i) merge(merges[i].first, merges[i].second);
    });
    return;
  }
  if (stay) {  // this member's items were its own rows' (attention_keeps_rows): it merges them
    const auto [r0, r1] = member->rows(B);
    for (const auto& [b, h] : merges) {
      if (b >= r0 && b < r1) merge(b, h);
    }
    return;
  }
  // The team met at the end of the items; each merges its share, and it meets again before the
  // op after reads every row.
  const auto [m0, m1] = team_rows(member->id, nm, member->size);
  for (int64_t i = m0; i < m1; ++i) merge(merges[i].first, merges[i].second);
  member->barrier();
}

// A float / bfloat16 / half pool read as stored; q and the output have the pool's dtype QT, or
// are fp32 over a half pool (a narrowed pool: the scans take fp32 queries either way).
template <typename T, int D, typename QT = T>
void paged_decode_float(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                        const Tensor& idx, const Tensor& rs, const Tensor& rl, const Tensor& gs,
                        const Tensor& gl, const Tensor& gp, const Tensor& gr, float scale,
                        Tensor& out, Tensor& lse) {
  using Scan = KeyScan<T, D>;
  const T* kb = k_buffer.data_ptr<T>();
  const T* vb = v_buffer.data_ptr<T>();
  const int64_t slot_stride = k_buffer.stride(0), head_stride = k_buffer.stride(1);
  const int64_t ahead = prefetch_blocks();
  const bool l1 = prefetch_l1();
  auto scan_for = [&](int64_t h) {
    Scan scan{};  // the AVX-512 scans have an (empty) base, the generic one none
    scan.kbase = kb + h * head_stride;
    scan.vbase = vb + h * head_stride;
    scan.stride = slot_stride;
    scan.scale = scale;
    scan.ahead = ahead;
    scan.l1 = l1;
    return scan;
  };
  paged_decode_run<QT, Scan>(q, k_buffer.size(1), k_buffer.size(0), idx, rs, rl, gs, gl, gp, gr,
                             scale, scan_for, out, lse);
}

template <typename T, typename QT = T>
void dispatch_head_dim(int64_t D, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& idx, const Tensor& rs, const Tensor& rl, const Tensor& gs,
                       const Tensor& gl, const Tensor& gp, const Tensor& gr, float scale,
                       Tensor& out, Tensor& lse) {
#define RADIXRT_HEAD_DIM_CASE(DIM)                                                          \
  case DIM:                                                                                 \
    return paged_decode_float<T, DIM, QT>(q, k, v, idx, rs, rl, gs, gl, gp, gr, scale, out,  \
                                          lse);
  switch (D) {
    RADIXRT_HEAD_DIM_CASE(16)
    RADIXRT_HEAD_DIM_CASE(32)
    RADIXRT_HEAD_DIM_CASE(64)
    RADIXRT_HEAD_DIM_CASE(80)
    RADIXRT_HEAD_DIM_CASE(96)
    RADIXRT_HEAD_DIM_CASE(128)
    RADIXRT_HEAD_DIM_CASE(256)
    default:
      TORCH_CHECK(false, "paged_decode: unsupported head_dim ", D);
  }
#undef RADIXRT_HEAD_DIM_CASE
}

void check_index(const Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 &&
                  t.is_contiguous(),
              "paged_decode: ", name, " must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(numel < 0 || t.numel() == numel, "paged_decode: ", name, " must have ", numel,
              " elements, got ", t.numel());
}

// The checks both ops share: q [B, H, D] contiguous on the CPU, the pool buffers alike with
// head_dim D and kv_heads dividing H, and the plan's index tensors.
void check_plan(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                const Tensor& kv_indices, const Tensor& row_start, const Tensor& row_len,
                const Tensor& group_start, const Tensor& group_len, const Tensor& group_row_ptr,
                const Tensor& group_rows, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode: q must be contiguous [B, H, D]");
  check_kv_buffers(k_buffer, v_buffer, "paged_decode");
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu() && v_buffer.device().is_cpu(),
              "paged_decode: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_buffer.size(1);
  TORCH_CHECK(k_buffer.size(2) == D, "paged_decode: head_dim of q and the pool differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_decode: heads (", H,
              ") must be a multiple of kv_heads (", Hkv, ")");
  TORCH_CHECK(kv_indices.device().is_cpu() && kv_indices.scalar_type() == at::kInt &&
                  kv_indices.dim() == 1 && kv_indices.is_contiguous(),
              "paged_decode: kv_indices must be a contiguous 1-D int32 CPU tensor");
  check_index(row_start, "row_start", B);
  check_index(row_len, "row_len", B);
  check_index(group_start, "group_start", -1);
  const int64_t num_groups = group_start.numel();
  check_index(group_len, "group_len", num_groups);
  check_index(group_row_ptr, "group_row_ptr", num_groups + 1);
  check_index(group_rows, "group_rows", -1);
  const int64_t* gp = group_row_ptr.data_ptr<int64_t>();
  TORCH_CHECK(gp[0] == 0 && gp[num_groups] == group_rows.numel(),
              "paged_decode: group_row_ptr must run from 0 to len(group_rows)");
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(gp[g] <= gp[g + 1], "paged_decode: group_row_ptr must be non-decreasing");
  }
  TORCH_CHECK(scale > 0, "paged_decode: scale must be positive");
}

// Calls f(T{}) for q's floating dtype.
template <typename F>
void with_float_dtype(const Tensor& q, const char* op, const F& f) {
  switch (q.scalar_type()) {
    case at::kFloat:
      return f(0.f);
    case at::kBFloat16:
      return f(at::BFloat16(0.f));
    case at::kHalf:
      return f(at::Half(0.f));
    default:
      TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ",
                  q.scalar_type());
  }
}

std::tuple<Tensor, Tensor> paged_decode(const Tensor& q, const Tensor& k_buffer,
                                        const Tensor& v_buffer, const Tensor& kv_indices,
                                        const Tensor& row_start, const Tensor& row_len,
                                        const Tensor& group_start, const Tensor& group_len,
                                        const Tensor& group_row_ptr, const Tensor& group_rows,
                                        double scale) {
  check_plan(q, k_buffer, v_buffer, kv_indices, row_start, row_len, group_start, group_len,
             group_row_ptr, group_rows, scale);
  const bool narrowed = q.scalar_type() == at::kFloat && k_buffer.scalar_type() == at::kHalf;
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type() &&
                  (q.scalar_type() == k_buffer.scalar_type() || narrowed),
              "paged_decode: q, k_buffer and v_buffer must have one dtype (or q float32 over a "
              "float16 pool)");
  Tensor out = team_empty(q.sizes(), q.options());
  Tensor lse = team_empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return {out, lse};
  const float s = static_cast<float>(scale);
  if (narrowed) {
    dispatch_head_dim<at::Half, float>(q.size(2), q, k_buffer, v_buffer, kv_indices, row_start,
                                       row_len, group_start, group_len, group_row_ptr,
                                       group_rows, s, out, lse);
    return {out, lse};
  }
  with_float_dtype(q, "paged_decode", [&](auto zero) {
    dispatch_head_dim<decltype(zero)>(q.size(2), q, k_buffer, v_buffer, kv_indices, row_start,
                                      row_len, group_start, group_len, group_row_ptr,
                                      group_rows, s, out, lse);
  });
  return {out, lse};
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
template <typename QT, int D>
void paged_decode_i8_impl(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                          const Tensor& k_scale, const Tensor& v_scale, const Tensor& idx,
                          const Tensor& rs, const Tensor& rl, const Tensor& gs, const Tensor& gl,
                          const Tensor& gp, const Tensor& gr, float scale, Tensor& out,
                          Tensor& lse) {
  using Scan = KeyScanI8<D>;
  const int8_t* kb = k_buffer.data_ptr<int8_t>();
  const int8_t* vb = v_buffer.data_ptr<int8_t>();
  const float* ksb = k_scale.data_ptr<float>();
  const float* vsb = v_scale.data_ptr<float>();
  const int64_t slot_stride = k_buffer.stride(0), head_stride = k_buffer.stride(1);
  const int64_t s_slot = k_scale.stride(0), s_head = k_scale.stride(1);
  // The same bytes ahead as the bf16 scan: an int8 block is half of a bf16 one (Zen 5, op
  // alone from memory: 8 rows on 2 threads 0.93x the time of 1 block ahead, 32 rows on one
  // 0.97x of 2).
  const int64_t ahead = 2 * prefetch_blocks();
  auto scan_for = [&](int64_t h) {
    return Scan{{},
                kb + h * head_stride, vb + h * head_stride, slot_stride,
                ksb + h * s_head, vsb + h * s_head, s_slot, scale, ahead};
  };
  paged_decode_run<QT, Scan>(q, k_buffer.size(1), k_buffer.size(0), idx, rs, rl, gs, gl, gp, gr,
                             scale, scan_for, out, lse);
}
#endif

std::tuple<Tensor, Tensor> paged_decode_i8(const Tensor& q, const Tensor& k_buffer,
                                           const Tensor& v_buffer, const Tensor& k_scale,
                                           const Tensor& v_scale, const Tensor& kv_indices,
                                           const Tensor& row_start, const Tensor& row_len,
                                           const Tensor& group_start, const Tensor& group_len,
                                           const Tensor& group_row_ptr,
                                           const Tensor& group_rows, double scale) {
  TORCH_CHECK(kHaveInt8Scan, "paged_decode_i8: needs a build for AVX512-VNNI (this one is ",
              RADIXRT_STR(CPU_CAPABILITY), ")");
  check_plan(q, k_buffer, v_buffer, kv_indices, row_start, row_len, group_start, group_len,
             group_row_ptr, group_rows, scale);
  TORCH_CHECK(k_buffer.scalar_type() == at::kChar && v_buffer.scalar_type() == at::kChar,
              "paged_decode_i8: k_buffer and v_buffer must be int8");
  const int64_t slots = k_buffer.size(0), Hkv = k_buffer.size(1);
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && k_scale.dim() == 2 &&
                  k_scale.size(0) == slots && k_scale.size(1) == Hkv &&
                  v_scale.sizes() == k_scale.sizes() && v_scale.strides() == k_scale.strides(),
              "paged_decode_i8: k_scale / v_scale must be float32 [slots, kv_heads] alike");
  TORCH_CHECK(k_scale.stride(0) >= 0 && k_scale.stride(0) * slots < (int64_t{1} << 31),
              "paged_decode_i8: scale offsets must fit int32");
  Tensor out = team_empty(q.sizes(), q.options());
  Tensor lse = team_empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return {out, lse};
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
  const float s = static_cast<float>(scale);
  with_float_dtype(q, "paged_decode_i8", [&](auto zero) {
    using QT = decltype(zero);
#define RADIXRT_I8_CASE(DIM)                                                                   \
  case DIM:                                                                                    \
    return paged_decode_i8_impl<QT, DIM>(q, k_buffer, v_buffer, k_scale, v_scale, kv_indices, \
                                         row_start, row_len, group_start, group_len,           \
                                         group_row_ptr, group_rows, s, out, lse);
    switch (q.size(2)) {
      RADIXRT_I8_CASE(16)
      RADIXRT_I8_CASE(32)
      RADIXRT_I8_CASE(64)
      RADIXRT_I8_CASE(80)
      RADIXRT_I8_CASE(96)
      RADIXRT_I8_CASE(128)
      RADIXRT_I8_CASE(256)
      default:
        TORCH_CHECK(false, "paged_decode_i8: unsupported head_dim ", q.size(2));
    }
#undef RADIXRT_I8_CASE
  });
#endif
  return {out, lse};
}

bool paged_decode_i8_available() { return kHaveInt8Scan; }

bool paged_decode_amx(bool enable) {
  if (!amx_attention::amx_usable()) return false;
  return g_amx.exchange(enable);
}

bool paged_decode_amx_rows(bool enable) {
#ifdef RADIXRT_AMX_DECODE
  if (!amx_usable()) return false;
  return g_amx_rows.exchange(enable);
#else
  (void)enable;
  return false;
#endif
}

int64_t paged_decode_lane_groups(int64_t rows) {
#ifdef RADIXRT_LANE_ATTENTION
  TORCH_CHECK(rows >= -1, "paged_decode_lane_groups: rows must be >= 0 (or -1 to read), got ",
              rows);
  return rows < 0 ? g_lane_group_rows.load() : g_lane_group_rows.exchange(rows);
#else
  (void)rows;
  return -1;
#endif
}

std::vector<int64_t> paged_decode_prefetch(int64_t blocks, int64_t alone) {
  TORCH_CHECK(blocks >= -1 && blocks <= 16 && alone >= -1 && alone <= 16,
              "paged_decode_prefetch: blocks ahead must be in [0, 16] (or -1 to keep), got ",
              blocks, ", ", alone);
  std::vector<int64_t> previous{g_prefetch_blocks.load(), g_prefetch_blocks_alone.load()};
  if (blocks >= 0) g_prefetch_blocks.store(blocks);
  if (alone >= 0) g_prefetch_blocks_alone.store(alone);
  return previous;
}

// Sets whether the scan prefetches into L1 (1) or L2 (0); -1 keeps it. Returns the setting
// before (resolved: 0 or 1).
int64_t paged_decode_prefetch_l1(int64_t l1) {
  TORCH_CHECK(l1 >= -1 && l1 <= 1, "paged_decode_prefetch_l1: must be -1, 0 or 1, got ", l1);
  const int64_t previous = prefetch_l1() ? 1 : 0;
  if (l1 >= 0) g_prefetch_l1.store(static_cast<int>(l1), std::memory_order_relaxed);
  return previous;
}

std::vector<int64_t> paged_decode_head_dims() { return {16, 32, 64, 80, 96, 128, 256}; }

std::string paged_decode_isa() { return RADIXRT_STR(CPU_CAPABILITY); }

std::vector<int64_t> paged_decode_row_parts(int64_t min_keys, int64_t max_parts,
                                           int64_t items_per_thread) {
  TORCH_CHECK(min_keys >= -1 && max_parts >= -1 && max_parts <= 64 && items_per_thread >= -1,
              "paged_decode_row_parts: min_keys and items_per_thread must be >= 0 and max_parts "
              "in [0, 64] (or -1 to keep), got ", min_keys, ", ", max_parts, ", ",
              items_per_thread);
  RowPartSettings& s = row_part_settings();
  std::vector<int64_t> previous{s.min_keys.load(), s.max_parts.load(),
                                s.items_per_thread.load()};
  if (min_keys >= 0) s.min_keys.store(min_keys);
  if (max_parts >= 0) s.max_parts.store(max_parts);
  if (items_per_thread >= 0) s.items_per_thread.store(items_per_thread);
  return previous;
}

std::vector<int64_t> set_attention_parallel_work(int64_t team, int64_t regions) {
  AttentionParallelWork& w = attention_parallel_work();
  std::vector<int64_t> previous{w.team.load(), w.regions.load()};
  if (team >= 0) w.team.store(team);
  if (regions >= 0) w.regions.store(regions);
  return previous;
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY(radixrt, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor kv_indices, "
      "Tensor row_start, Tensor row_len, Tensor group_start, Tensor group_len, "
      "Tensor group_row_ptr, Tensor group_rows, float scale) -> (Tensor, Tensor)");
  m.def(
      "paged_decode_i8(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor k_scale, "
      "Tensor v_scale, Tensor kv_indices, Tensor row_start, Tensor row_len, Tensor group_start, "
      "Tensor group_len, Tensor group_row_ptr, Tensor group_rows, float scale) -> (Tensor, Tensor)");
  m.def("paged_decode_i8_available() -> bool", &radixrt_cpu::paged_decode_i8_available);
  m.def("paged_decode_head_dims() -> int[]", &radixrt_cpu::paged_decode_head_dims);
  m.def("paged_decode_isa() -> str", &radixrt_cpu::paged_decode_isa);
  // Benchmarks / tests: cascade groups over a bf16 pool on AMX tiles (true, the default where
  // this process may use them) or the scan; returns the previous setting (always false where AMX
  // is unusable).
  m.def("paged_decode_amx(bool enable) -> bool", &radixrt_cpu::paged_decode_amx);
  m.def("paged_decode_amx_rows(bool enable) -> bool", &radixrt_cpu::paged_decode_amx_rows);
  // Benchmarks / tests: from how many rows cascade groups over a bf16 pool pass over their
  // prefix with query rows in vector lanes where AMX is not used (0: never, -1: only read it);
  // returns the previous setting, or -1 where this build has no such path (no AVX512-BF16).
  m.def("paged_decode_lane_groups(int rows) -> int", &radixrt_cpu::paged_decode_lane_groups);
  // Benchmarks / tests: how many key blocks ahead the scans prefetch, in a call sharing its
  // items among threads and in one running alone (-1 keeps one); returns the previous pair.
  m.def("paged_decode_prefetch(int blocks=-1, int alone=-1) -> int[]",
        &radixrt_cpu::paged_decode_prefetch);
  // Benchmarks / tests: whether the scan prefetches into L1 (1) or L2 (0); -1 keeps it.
  m.def("paged_decode_prefetch_l1(int l1=-1) -> int", &radixrt_cpu::paged_decode_prefetch_l1);
  // Benchmarks / tests: how rows' own keys split into parts (work_queue.h, row_split): the
  // fewest keys of a part, the most parts of a row (1 or 0: never split) and the items per
  // thread below which rows split; -1 keeps one. Returns the previous [min_keys, max_parts,
  // items_per_thread]. Not while a decode step runs.
  m.def("paged_decode_row_parts(int min_keys=-1, int max_parts=-1, int items_per_thread=-1) "
        "-> int[]",
        &radixrt_cpu::paged_decode_row_parts);
  // Benchmarks / tests: the (query, key) pairs of an attention phase below which it runs on one
  // thread, in a decode team and with a parallel region per op (work_queue.h); a negative value
  // leaves that one as it is. Returns the previous [team, regions]. Not while a decode step
  // runs (a team's members read the team's threshold each).
  m.def("attention_parallel_work(int team=-1, int regions=-1) -> int[]",
        &radixrt_cpu::set_attention_parallel_work);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("paged_decode", &radixrt_cpu::paged_decode);
  m.impl("paged_decode_i8", &radixrt_cpu::paged_decode_i8);
}
