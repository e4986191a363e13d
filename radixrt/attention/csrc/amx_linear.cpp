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
// place, two B tiles of weights), all of K. The threads split the N blocks (or, from kSplitRows
// rows, the rows; in a decode team, team.h, its members split the N blocks at any row count);
// a thread takes its blocks in groups of kGroupBytes of weights (kept in L2,
// the next group prefetched meanwhile) and passes every 32-row block of its activations over a
// group before the next (rows in 256-row chunks with every N block inside was 0.75-0.9x oneDNN
// for gate_up [3072, 576] at 512-1300 rows: its weights left L2). A pass's epilogue (bias,
// rounding, stores; for amx_linear_silu the SiLU-mul) runs inside the next pass's K loop.
//
// amx_linear_silu: a [gate | up] weight's silu_mul(amx_linear(x)) bitwise, without the [M, N]
// intermediate: each pass over gate block j is followed by one over up block j + N/64, and the
// second's epilogue computes silu_mul's arithmetic (silu_mul.h) on the two rounded results.
//
// amx_linear_argmax: argmax_rows(amx_linear_f32(x)) bitwise (an LM head's greedy ids), without
// the [M, N] fp32 logits: each pass's epilogue folds its rows' 32 sums into that thread's
// per-row lanes (argmax.h's LanePick16, columns visited in increasing order), and the threads'
// picks are merged after the call. At 64 rows x SmolLM2's 49152 x 576 head the logits'
// stores (12.6 MB) and argmax_rows' read of them took 1.9 of 6.7 ms (stop 72).
//
// Measured on a 2-vCPU Xeon with AMX (bench/amx_linear_ab.py; SmolLM2's matmuls): the first
// version (no prefetch, epilogue after each pass, N split) was against oneDNN's plain call
// (layer sums, weights in cache) 2.0x at 64 rows, 1.5x at 256, 1.07x at 512, 1.09-1.18x at
// 768-1300, 0.73-0.78x from 2048; prefills on the default model 1.18x at 256 tokens, 1.11x at
// 512, 1.15x at 1024, 0.91x at 1536: hence prepack.AMX_MAX_ROWS. This version against the
// first, weights from memory: 64 rows 1.13-1.33x, 512 rows 1.01-1.27x; gate_up then silu_mul
// against amx_linear_silu 1.45-1.58x.

#include <torch_headers.h>  // first: precompiled by the build
#include <c10/util/BFloat16.h>

#include "amx_tiles.h"
#include "argmax.h"
#include "silu_mul.h"
#include "team.h"

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
using BF16 = at::BFloat16;

constexpr int64_t kBlock = 32;  // outputs and inputs per weight block
// Calls of at least this many rows split their rows over the threads (each reads every weight),
// smaller ones their N blocks (each reads its share of the weights once). Rows: each thread
// then writes the rows that the row-split ops around it (norms, RoPE) read on the same core,
// and reads its own activations. Against N blocks, SmolLM2's matmuls with weights from memory:
// 128 rows 0.76-0.87x (the weights read twice), 256 0.91-0.99x, 512 1.01-1.14x, 1024
// 1.08-1.32x, 2048 1.11-1.19x.
constexpr int64_t kSplitRows = 512;
#if defined(RADIXRT_AMX_LINEAR)
// Weight bytes of the N blocks a thread takes together over every row (they stay in L2 while
// each 32-row block of activations, in L1, passes over them).
constexpr int64_t kGroupBytes = 256 << 10;
// Activation bytes of the rows a thread passes over all its groups before the next rows.
constexpr int64_t kChunkBytes = 1 << 20;
constexpr int64_t kBlockElems = 2 * 16 * 32;  // bf16 elements of one (nb, kb) block

// Software prefetch into L2 of `lines` cache lines from `from`, spread over `steps` K steps (the
// next group's weights: a group's first row block otherwise waits on memory for every B tile;
// the next row block's activations).
struct Prefetch {
  const char* p = nullptr;    // next line to prefetch
  const char* end = nullptr;  // past the last line
  int64_t per_step = 0;       // lines per K step
  Prefetch() = default;
  Prefetch(const void* from, int64_t lines, int64_t steps)
      : p(static_cast<const char*>(from)), end(p + lines * 64),
        per_step((lines + steps - 1) / steps) {}
  inline void step() {
    for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

// A finished pass's epilogue: its rows' vector work, run a few rows at a time inside the next
// pass's K loop (see Drain). `c`: the pass's four fp32 C tiles (tile t at c + 256 t:
// rows 16 (t / 2) + 0..15, outputs 16 (t % 2) + 0..15). Kinds:
// - kStore: row r's 32 outputs + bias, rounded to bf16, at y + r * ldy;
// - kStoreF32: the same sums + bias as fp32, at y + r * ldy (y then points into an fp32 output,
//   ldy counted in bf16 elements: twice the fp32 row stride);
// - kGate: the same values kept in `gate` [32 rows][32] (the gate half of a fused SiLU-mul);
// - kSilu: silu(gate) * up of the row (up = this pass's rounded outputs), rounded to bf16 at
//   y + r * ldy, as radixrt::silu_mul rounds it (silu_mul.h; `scalar`: columns past its
//   vectorised end, which silu_mul runs on the scalar path);
// - kPick: the same fp32 sums as kStoreF32, not stored: visited by row r's lanes, picks[r], as
//   columns `column` .. + 31.
struct Epilogue {
  enum Kind { kStore, kStoreF32, kGate, kSilu, kPick };
  const float* c = nullptr;
  const float* bias = nullptr;
  BF16* y = nullptr;
  BF16* gate = nullptr;
  int64_t ldy = 0, rows = 0, next = 0;
  Kind kind = kStore;
  bool scalar = false;
  LanePick16* picks = nullptr;
  int32_t column = 0;

  inline void row(int64_t r) {
    const float* c0 = c + (r / 16) * 512 + (r % 16) * 16;
    __m512 lo = _mm512_load_ps(c0), hi = _mm512_load_ps(c0 + 256);
    if (bias) {
      lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
      hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
    }
    if (kind == kPick) {
      picks[r].visit(lo, column);
      picks[r].visit(hi, column + 16);
      return;
    }
    if (kind == kStoreF32) {
      float* d = reinterpret_cast<float*>(y + r * ldy);
      _mm512_storeu_ps(d, lo);
      _mm512_storeu_ps(d + 16, hi);
      return;
    }
    const __m256i blo = (__m256i)_mm512_cvtneps_pbh(lo), bhi = (__m256i)_mm512_cvtneps_pbh(hi);
    BF16* dst = kind == kGate ? gate + r * 32 : y + r * ldy;
    if (kind != kSilu) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), blo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), bhi);
      return;
    }
    alignas(64) BF16 up[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(up), blo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(up + 16), bhi);
    const BF16* g = gate + r * 32;
    if (!scalar) {
      Vec va, vb;
      silu_times_up<BF16>(g, up, va, vb);
      store_pair<BF16>(dst, va, vb);
    } else {
      for (int i = 0; i < 32; ++i) {
        dst[i] = static_cast<BF16>(silu_times_up_scalar<BF16>(g[i], up[i]));
      }
    }
  }
  // Rows up to (not including) `end`.
  inline void run_to(int64_t end) {
    for (end = std::min(rows, end); next < end; ++next) row(next);
  }
};

// The last pass's epilogue, run in the next pass's K loop, a few rows per step: the vector work
// then overlaps that pass's tile work instead of leaving the tiles idle (a pass's stores wait
// for its last tile ops). Finished before that pass's own epilogue takes its place, so two C
// buffers and one gate buffer suffice. (Spreading each epilogue over two passes, so a SiLU-mul's
// costly rows and a gate's cheap ones share every pass, measured no faster.)
struct Drain {
  Epilogue prev;
  int64_t per = 0;

  inline void plan(int64_t ksteps) { per = (prev.rows - prev.next + ksteps - 1) / ksteps; }
  inline void step() { prev.run_to(prev.next + per); }
  inline void push(const Epilogue& e) {
    finish();
    prev = e;
  }
  inline void finish() { prev.run_to(prev.rows); }
};

// Rows [0, rows) (rows <= 16 * (TWO ? 2 : 1)) of a at stride lda (elements) x N block `w`
// (ksteps blocks) into the C tiles, stored as fp32 at c (Epilogue's layout). Tiles (TileConfig,
// amx_tiles.h: all 16 x 64 bytes) 0-3: C (rows 0-15 / 16-31 x outputs 0-15 / 16-31), 4-5: A,
// 6-7: B. Each K step also prefetches and runs its share of the drain's epilogues.
template <bool TWO>
inline void pass(const BF16* a, int64_t lda, const BF16* w, int64_t ksteps, float* c,
                 Prefetch& pf, Prefetch& pa, Drain& drain) {
  const int64_t stride = lda * static_cast<int64_t>(sizeof(BF16));
  drain.plan(ksteps);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < ksteps; ++kb) {
    const BF16* b = w + kb * kBlockElems;
    _tile_loadd(4, a + kb * kBlock, stride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + kBlockElems / 2, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a + 16 * lda + kb * kBlock, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pf.step();
    pa.step();
    drain.step();
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (TWO) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// One thread's share of a call: N blocks [b0, b1) of `w` over every row of x (m rows, k = 32
// ksteps columns; `tail`: the rows past the last whole 16, padded with zero rows) into y
// (ldy = its row stride). With `silu`, block j is a gate block whose up block is j + up_offset:
// each pass over a gate block is followed by one over its up block, and y's block j is their
// SiLU-mul (the output has up_offset blocks); else y's block j is x W_j^T, in fp32 with `f32`
// (y then points into an fp32 output, ldy in bf16 elements: twice its row stride). With `picks`
// (one LanePick16 per row of x, f32 only) nothing is stored: the rows' lanes visit the sums.
void run_blocks(const BF16* xa, int64_t m, int64_t k, const BF16* tail, const BF16* w,
                int64_t ksteps, const float* bias, BF16* y, int64_t ldy, int64_t b0, int64_t b1,
                bool silu, int64_t up_offset, int64_t vec_end, bool f32,
                LanePick16* picks = nullptr) {
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) float cbuf[2][4 * 256];
  alignas(64) BF16 gate[32 * 32];
  const int64_t block_bytes = ksteps * kBlockElems * static_cast<int64_t>(sizeof(BF16));
  const int64_t weights_per_block = silu ? 2 : 1;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (block_bytes * weights_per_block));
  const int64_t full = m / 16 * 16;
  Drain drain;
  Prefetch pf_a;  // the next row block's activations
  int buf = 0;
  // One pass of `rows` rows at a (stride lda) over weight block wb into the next C buffer; its
  // epilogue (kind, writing y rows at dst, bias bb; kPick: the rows' lanes pk from column)
  // joins the drain.
  auto one = [&](const BF16* a, int64_t lda, int64_t rows, const BF16* wb, Epilogue::Kind kind,
                 const float* bb, BF16* dst, bool scalar, Prefetch& pf,
                 LanePick16* pk = nullptr, int32_t column = 0) {
    float* c = cbuf[buf];
    if (rows > 16) {
      pass<true>(a, lda, wb, ksteps, c, pf, pf_a, drain);
    } else {
      pass<false>(a, lda, wb, ksteps, c, pf, pf_a, drain);
    }
    buf ^= 1;
    drain.push(Epilogue{c, bb, dst, gate, ldy, rows, 0, kind, scalar, pk, column});
  };
  // Rows in chunks of about kChunkBytes of activations (kept in L2 beside a group), every group
  // over a chunk before the next: each chunk reads the weights once, each group the chunk's
  // activations from L2 (whole calls per group read every row again from L3 or memory: at
  // 4096 rows 1.5x the time).
  const int64_t chunk = std::max<int64_t>(32, kChunkBytes / (k * 2) / 32 * 32);
  for (int64_t c0 = 0; c0 < m; c0 += chunk) {
    const int64_t c1 = std::min(m, c0 + chunk);
    const int64_t chunk_blocks = (c1 - c0 + 31) / 32;
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group);
      // the next group's weights (the next chunk's first group after the last; for silu its
      // gate blocks, then its up blocks)
      Prefetch pf, pf_up;
      const int64_t n0 = g1 < b1 ? g1 : (c1 < m ? b0 : b1);
      if (n0 < b1) {
        const int64_t lines = (std::min(b1, n0 + group) - n0) * block_bytes / 64;
        const int64_t steps = chunk_blocks * (g1 - g0) * ksteps;  // passes over each stream
        pf = Prefetch(w + n0 * ksteps * kBlockElems, lines, steps);
        if (silu) pf_up = Prefetch(w + (n0 + up_offset) * ksteps * kBlockElems, lines, steps);
      }
      for (int64_t r = c0; r < c1; r += 32) {
        // a chunk's first group prefetches the next row block's activations (from the cores
        // that wrote them, or memory: without this the tile loads wait on each line; later
        // groups find them in L2)
        if (g0 == b0 && r + 32 < c1) {
          pf_a = Prefetch(xa + (r + 32) * k, (std::min(c1, r + 64) - (r + 32)) * k * 2 / 64,
                          (g1 - g0) * ksteps * weights_per_block);
        }
        for (int64_t nb = g0; nb < g1; ++nb) {
          // the rows of this block: a pass of 32 (or 16) rows in place, then the padded tail
          int64_t q = r;
          while (q < std::min(c1, r + 32)) {
            const int64_t rows = q + 32 <= full ? 32 : (q + 16 <= full ? 16 : m - q);
            const BF16* a = q + 16 <= full ? xa + q * k : tail;
            BF16* dst = y + q * ldy + nb * kBlock * (f32 ? 2 : 1);
            const float* bb = bias ? bias + nb * kBlock : nullptr;
            const BF16* wg = w + nb * ksteps * kBlockElems;
            if (picks != nullptr) {
              one(a, k, rows, wg, Epilogue::kPick, bb, nullptr, false, pf, picks + q,
                  static_cast<int32_t>(nb * kBlock));
            } else if (!silu) {
              one(a, k, rows, wg, f32 ? Epilogue::kStoreF32 : Epilogue::kStore, bb, dst, false,
                  pf);
            } else {
              const int64_t ub = nb + up_offset;
              one(a, k, rows, wg, Epilogue::kGate, bb, dst, false, pf);
              one(a, k, rows, w + ub * ksteps * kBlockElems, Epilogue::kSilu,
                  bias ? bias + ub * kBlock : nullptr, dst, nb * kBlock >= vec_end, pf_up);
            }
            q += rows;
          }
        }
      }
    }
  }
  drain.finish();
  _tile_release();
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

// A call's checked inputs (named `op` in errors): x [M, K] bfloat16 and packed [N/32, K/32, 2,
// 16, 32] alike in K, the bias [N] in fp32; `rows()` x contiguous and `tail()` its last rows
// short of a tile padded with zero rows (both made on first use).
struct CallInputs {
  int64_t m = 0, k = 0, blocks = 0, ksteps = 0;
  Tensor x, bias_f;
  Tensor xc;
  std::vector<BF16> padded;

  CallInputs(const Tensor& x_, const Tensor& packed, const std::optional<Tensor>& bias,
             const char* op)
      : x(x_) {
    TORCH_CHECK(amx_linear_available(), op,
                ": this kernel library or CPU has no usable AMX-BF16 tiles");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op,
                ": x must be 2-D bfloat16 [M, K], got ", x.sizes(), " ", x.scalar_type());
    TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 &&
                    packed.is_contiguous() && packed.size(2) == 2 && packed.size(3) == 16 &&
                    packed.size(4) == 32,
                op, ": packed must be contiguous bfloat16 [N/32, K/32, 2, 16, 32], got ",
                packed.sizes());
    m = x.size(0);
    k = x.size(1);
    blocks = packed.size(0);
    ksteps = packed.size(1);
    TORCH_CHECK(k == ksteps * kBlock, op, ": x has ", k, " features, the weight ",
                ksteps * kBlock);
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == blocks * kBlock, op, ": bias must be [",
                  blocks * kBlock, "], got ", bias->sizes());
      bias_f = bias->to(at::kFloat).contiguous();
    }
  }

  const float* bias() const { return bias_f.defined() ? bias_f.data_ptr<float>() : nullptr; }

  const BF16* rows() {
    if (!xc.defined()) xc = x.contiguous();
    return xc.data_ptr<BF16>();
  }

  const BF16* tail() {
    const int64_t full = m / 16 * 16;
    if (full < m && padded.empty()) {
      padded.assign(16 * k, BF16(0.f));
      std::memcpy(padded.data(), rows() + full * k, (m - full) * k * sizeof(BF16));
    }
    return padded.data();
  }
};

// Checks and the common call: x [M, K] times packed [N/32, K/32, 2, 16, 32] (+ bias), into y
// [M, N] (bf16, or with `f32` the fp32 sums unrounded) or, with `silu`, silu_mul's [M, N/2] of
// the [gate | up] result.
Tensor linear_impl(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias,
                   bool silu, bool f32, const char* op) {
  CallInputs in(x, packed, bias, op);
  const int64_t m = in.m, k = in.k, n_blocks = in.blocks, ksteps = in.ksteps;
  TORCH_CHECK(!silu || n_blocks % 2 == 0, op,
              ": packed [gate | up] must have an even number of 32-output blocks, got ",
              n_blocks);
  const int64_t n = n_blocks * kBlock;
  const int64_t out_n = silu ? n / 2 : n;
  TeamMember* member = team_member();
  const auto y_options = f32 ? x.options().dtype(at::kFloat) : x.options();
  Tensor y = member != nullptr ? team_empty({m, out_n}, y_options)
                               : at::empty({m, out_n}, y_options);
  if (m == 0) return y;
#if defined(RADIXRT_AMX_LINEAR)
  const BF16* xa = in.rows();
  const BF16* tail = in.tail();
  const auto* w = packed.data_ptr<BF16>();
  // the output as bf16 elements (an fp32 output's rows are twice as long in them)
  auto* yp = static_cast<BF16*>(y.data_ptr());
  const int64_t ldy = f32 ? 2 * out_n : out_n;
  const float* bp = in.bias();
  const int64_t blocks = silu ? n_blocks / 2 : n_blocks;
  const int64_t vec_end = silu ? silu_mul_vec_end<BF16>(out_n) : 0;
  if (member != nullptr) {
    // In a decode team (team.h) each member runs its equal share of the N blocks over every
    // row, into the team's output. x is whole on this member where the layer loop had it
    // quantized whole (quantize_whole: each member normed every row into its own memory);
    // else the op before may have ended with each member holding only its rows (rows_stay),
    // so the team meets first. It meets again after, as the vnni kernel's team path does.
    if (!member->quantize_whole) member->barrier();
    member->quantize_whole = false;
    const auto [b0, b1] = member->rows(blocks);
    if (b0 < b1) {
      run_blocks(xa, m, k, tail, w, ksteps, bp, yp, ldy, b0, b1, silu, blocks, vec_end,
                 f32);
    }
    member->barrier();
  } else if (m >= kSplitRows && at::get_num_threads() > 1) {
    at::parallel_for(0, (m + 31) / 32, 1, [&](int64_t r0, int64_t r1) {
      const int64_t q0 = r0 * 32, q1 = std::min(m, r1 * 32);
      run_blocks(xa + q0 * k, q1 - q0, k, tail, w, ksteps, bp, yp + q0 * ldy, ldy, 0,
                 blocks, silu, blocks, vec_end, f32);
    });
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      run_blocks(xa, m, k, tail, w, ksteps, bp, yp, ldy, b0, b1, silu, blocks, vec_end,
                 f32);
    });
  }
#endif
  return y;
}

Tensor amx_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  return linear_impl(x, packed, bias, false, false, "amx_linear");
}

// amx_linear's fp32 sums (+ bias) before its rounding to bf16, as an fp32 [M, N] (an LM head's
// logits: a bf16 logit near 20 is only good to 0.125).
Tensor amx_linear_f32(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  return linear_impl(x, packed, bias, false, true, "amx_linear_f32");
}

// argmax_rows(amx_linear_f32(x, packed, bias)) (int64 [M]: torch.argmax's index, the first
// maximum; a row holding a NaN gives its first NaN), without the logits: each thread's passes
// fold their fp32 sums into its per-row lanes, merged after the call (a total order: the same
// index whatever the split). Not inside a decode team (its members' picks would not be merged).
Tensor amx_linear_argmax(const Tensor& x, const Tensor& packed,
                         const std::optional<Tensor>& bias) {
  const char* op = "amx_linear_argmax";
  TORCH_CHECK(team_member() == nullptr, op, ": not inside a decode team");
  CallInputs in(x, packed, bias, op);
  const int64_t m = in.m, k = in.k, blocks = in.blocks, ksteps = in.ksteps;
  TORCH_CHECK(blocks > 0, op, ": the weight has no output features");
  TORCH_CHECK(blocks * kBlock < (int64_t{1} << 31), op, ": at most 2^31 outputs");
  const int64_t n = blocks * kBlock;
  Tensor ids = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return ids;
#if defined(RADIXRT_AMX_LINEAR)
  const BF16* xa = in.rows();
  const BF16* tail = in.tail();
  const auto* w = packed.data_ptr<BF16>();
  const float* bp = in.bias();
  int64_t* out = ids.data_ptr<int64_t>();
  if (m >= kSplitRows && at::get_num_threads() > 1) {
    // rows split: each thread visits every column of its rows
    at::parallel_for(0, (m + 31) / 32, 1, [&](int64_t r0, int64_t r1) {
      const int64_t q0 = r0 * 32, q1 = std::min(m, r1 * 32);
      std::vector<LanePick16> lanes(static_cast<size_t>(q1 - q0));
      run_blocks(xa + q0 * k, q1 - q0, k, tail, w, ksteps, bp, nullptr, 2 * n, 0, blocks,
                 false, blocks, 0, true, lanes.data());
      for (int64_t r = q0; r < q1; ++r) out[r] = lanes[r - q0].reduce().index();
    });
    return ids;
  }
  // N blocks split: run t of `runs` takes blocks [t B / runs, (t + 1) B / runs) of every row
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<RowPick> picks(static_cast<size_t>(runs * m));
  at::parallel_for(0, runs, 1, [&](int64_t t0, int64_t t1) {
    std::vector<LanePick16> lanes(static_cast<size_t>(m));
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(lanes.begin(), lanes.end(), LanePick16{});
      run_blocks(xa, m, k, tail, w, ksteps, bp, nullptr, 2 * n, t * blocks / runs,
                 (t + 1) * blocks / runs, false, blocks, 0, true, lanes.data());
      for (int64_t r = 0; r < m; ++r) picks[t * m + r] = lanes[r].reduce();
    }
  });
  for (int64_t r = 0; r < m; ++r) {
    RowPick p;
    for (int64_t t = 0; t < runs; ++t) p = merge_picks(p, picks[t * m + r]);
    TORCH_CHECK(p.column >= 0, op, ": row ", r, " was not computed");
    out[r] = p.index();
  }
#endif
  return ids;
}

// silu_mul(amx_linear(x, packed, bias)) bitwise, without the [M, N] intermediate.
Tensor amx_linear_silu(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  return linear_impl(x, packed, bias, true, false, "amx_linear_silu");
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_linear_silu(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_linear_f32(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_linear_argmax(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_linear_available() -> bool", &radixrt_cpu::amx_linear_available);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("amx_linear", &radixrt_cpu::amx_linear);
  m.impl("amx_linear_silu", &radixrt_cpu::amx_linear_silu);
  m.impl("amx_linear_f32", &radixrt_cpu::amx_linear_f32);
  m.impl("amx_linear_argmax", &radixrt_cpu::amx_linear_argmax);
}
