// Extend (prefill) attention on CPU, read in place from radixrt's KV pool.
//
// Request b has P_b = kv_indptr[b+1] - kv_indptr[b] cached keys (pool slots
// kv_indices[kv_indptr[b]:...]) and E_b = qo_indptr[b+1] - qo_indptr[b] new tokens, whose K/V
// are already in the pool at slots loc[qo_indptr[b]:...]. Key j of the request is the prefix
// slot j for j < P_b, else the new slot j - P_b. Query i (token qo_indptr[b] + i) sees keys
// 0..P_b + i: the causal limit is offset by the prefix length. Nothing is gathered and no mask
// tensor exists: the limit is applied per row inside the key blocks that cross it.
//
// Flash-style, keys in blocks of kKeyBlock starting at key 0 for every request. Online softmax
// (running max m, sum l) and accumulation are fp32 whatever the pool's dtype; the output is
// rounded to q's dtype once at the end. Two paths:
// - bf16 pools on CPUs with AVX512-BF16 (__AVX512BF16__, added by the builder when the CPU has
//   it): vdpbf16ps for S = Q Kᵀ and for P V (P rounded to bf16), twice the multiply-adds per
//   instruction of fp32 FMA; prefill is compute-bound, so it pays (decode does not). Query rows
//   sit in vector lanes (LaneTiles): K is read straight from the pool, the softmax runs over keys
//   for 16 rows at once. Requests whose prefixes start with the same slots (a radix-cache hit)
//   are grouped (make_plan): a group item attends the shared key blocks once for all its rows,
//   then each request's own keys. A row's arithmetic depends only on its own keys, so grouping,
//   query blocking and threads never change a result bit.
// - every other pool / CPU: a work item is (request, KV head, block of query tokens), its rows
//   the block's tokens x the G query heads of the KV head (GQA folded); a key block is converted
//   to fp32 once per item (K transposed, V row-major) and register-tiled fp32 FMA micro-kernels
//   compute S and O += P V, a row at a time softmax in between. A float16 pool under fp32
//   queries (a float32 model's float16 KV cache) is read in place the same way.
// Items are run largest first over the intra-op threads, so both one long request (many query
// blocks) and many short ones keep every thread busy.

#include <torch_headers.h>  // first: precompiled by the build

#include "amx_attention.h"
#include "fma_attention.h"
#include "kv_pool_layout.h"
#include "lane_attention.h"
#include "vec_util.h"
#include "work_queue.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RADIXRT_EXTEND_BF16_DOT 1
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;
using fma_attention::kKeyBlock;
using fma_attention::kNegInf;

// Most query tokens per work item; fewer when that leaves too few items for the threads.
constexpr int64_t kMaxBlockTokens = 64;
constexpr int64_t kMinBlockTokens = 16;
// The same on the rows-in-lanes path (its per-item cost, packing V, is amortized over more rows).
constexpr int64_t kMaxLaneBlockTokens = 128;
// Most bytes of K / V blocks the AMX path packs ahead for requests cut into several parts; the
// requests past it pack in their items. More stays in no cache and was slower than packing twice
// (Xeon, 64 agents x (850 + 65) keys: 46 MB of blocks, 0.93x; 20 of them, 14 MB: 1.03-1.15x).
constexpr int64_t kMaxPackBytes = int64_t{16} << 20;
// Fewest parts of a request for its blocks to be packed ahead: two parts read each block about
// twice, and packing ahead measured 0.94-1.18x on the agent and mixed shapes (65 new tokens in
// two parts on 850 cached), run to run; a fresh 512-token prefill (8 parts) 1.12-1.25x.
constexpr int64_t kMinPackParts = 3;
// Below this many (query, key) pairs in the whole call, it runs on the calling thread.
constexpr int64_t kMinParallelWork = 16384;






#ifdef RADIXRT_EXTEND_BF16_DOT
// bf16 pools on CPUs with AVX512-BF16: scores and P·V by vdpbf16ps (products of bf16 pairs
// summed into fp32), twice the multiply-adds per instruction of fp32 FMA. Q and K stay bf16
// (as in the pool); P is rounded to bf16 for P·V (as torch's bf16 flash attention does).
//
// Query rows in vector lanes (lane_attention.h, shared with paged decode's large cascade groups):
// K read in place, one key's pair of dims broadcast against 16 query rows; a vertical online
// softmax; P V against V packed in pairs of keys. Every lane's arithmetic depends only on its own
// row and keys: outputs do not depend on which rows share a vector, an item or a thread.
#ifndef RADIXRT_EXT_PREFETCH
#define RADIXRT_EXT_PREFETCH 1
#endif
#endif

// Whether bf16 pools use the vdpbf16ps path (when compiled in); benchmarks switch it.
std::atomic<bool> g_bf16_dot{true};

// Whether the vdpbf16ps path attends shared prefixes once per group (Plan); benchmarks switch it.
std::atomic<bool> g_groups{true};

// Whether bf16 pools use AMX tiles where this process may (amx_attention.h); benchmarks and
// tests switch it.
std::atomic<bool> g_amx{true};

bool extend_attention_amx(bool enable) {
  if (!amx_attention::amx_usable()) return false;
  return g_amx.exchange(enable);
}

bool extend_attention_groups(bool enable) {
#ifdef RADIXRT_EXTEND_BF16_DOT
  return g_groups.exchange(enable);
#else
  (void)enable;
  return false;
#endif
}

bool extend_attention_bf16_dot(bool enable) {
#ifdef RADIXRT_EXTEND_BF16_DOT
  return g_bf16_dot.exchange(enable);
#else
  (void)enable;
  return false;
#endif
}

// A run of one request's query tokens [t0, t1) inside a work item. Its query rows are the item's
// rows row0 .. row0 + (t1 - t0) * G - 1: row row0 + t * G + g = token t0 + t, query head g of
// the item's KV head.
struct Part {
  int32_t req, t0, t1, row0;
};

// One KV head's parts [p_begin, p_end) of the plan. With shared > 0 (vdpbf16ps path only), every
// part's request starts with the same `shared` prefix slots (a multiple of kKeyBlock): those
// keys are attended once for all the item's rows, then each part continues over its own keys.
struct Item {
  int64_t cost;  // (query row, key) pairs, for ordering (largest first)
  int32_t kv_head, shared, p_begin, p_end;
};

struct Plan {
  std::vector<Part> parts;
  std::vector<Item> items;
};

// Shared-prefix groups: requests with at least this many identical leading prefix slots are
// attended together (a multiple of kKeyBlock).
constexpr int64_t kMinShared = kKeyBlock;
// Query rows per group work item, about: larger items read each shared key block for more rows,
// smaller ones balance the threads better.
#ifndef RADIXRT_EXT_GROUP_ROWS
#define RADIXRT_EXT_GROUP_ROWS 768
#endif
constexpr int64_t kGroupItemRows = RADIXRT_EXT_GROUP_ROWS;

// Tokens per part when a request's e new tokens go in blocks of at most `block`: as even as
// the block count allows (the last part may be shorter).
inline int64_t part_tokens(int64_t e, int64_t block) {
  const int64_t nblk = (e + block - 1) / block;
  return (e + nblk - 1) / nblk;
}

// Keys a query row of request b's tokens [t0, t1) sees on average: its cached prefix plus the
// new tokens up to the middle of the run (causal), for costing work items.
inline int64_t mean_keys(const int64_t* kptr, int64_t b, int64_t t0, int64_t t1) {
  return kptr[b + 1] - kptr[b] + (t0 + t1) / 2 + 1;
}

// The query block (tokens) of make_plan on the rows-in-lanes and fp32-FMA paths: of max_block,
// max_block / 2, ... kMinBlockTokens, the one whose items finish first when dealt largest first
// to `threads` threads (the work queue's order); ties go to the larger block. An item costs its
// keys x its rows plus the per-key work beside the rows: rows-in-lanes, rows padded to 16-row
// vectors, a quarter vector per 48-row tile and a tenth per item (packing V); fp32 FMA,
// kFmaKeyRows rows per item (converting the key blocks). One 75-token extend on 3 KV heads and
// 2 threads: 2 blocks (6 items, 3 per thread), where the old rule (halve until there are 4
// items per thread, still the AMX path's) cut 3: 9 items, 5 on one thread and 4 on the other.
// Whole agent1 steps (bench/extend_steps.py) 0.97x in bf16, 0.94-0.96x in fp32.
constexpr int64_t kFmaKeyRows = 8;
int64_t choose_block(int64_t B, const int64_t* kptr, const int64_t* qptr, int64_t G, int64_t Hkv,
                     int64_t max_block, int64_t threads, bool lanes) {
  auto add_parts = [&](int64_t b, int64_t block, std::vector<double>& costs) {
    const int64_t e = qptr[b + 1] - qptr[b];
    if (e <= 0) return;
    const int64_t per = part_tokens(e, block);
    for (int64_t t0 = 0; t0 < e; t0 += per) {
      const int64_t t1 = std::min(e, t0 + per), rows = (t1 - t0) * G;
      const double keys = static_cast<double>(mean_keys(kptr, b, t0, t1));
      const double units = lanes ? 16.0 * ((rows + 15) / 16) + 4.0 * ((rows + 47) / 48) + 1.6
                                 : static_cast<double>(rows + kFmaKeyRows);
      for (int64_t h = 0; h < Hkv; ++h) costs.push_back(units * keys);
    }
  };
  // Requests of at most kMinBlockTokens new tokens (a mixed step's decode rows) are one part
  // whatever the block: their items are costed once. With no other request, any block will do.
  std::vector<double> fixed, split, costs;
  bool any_split = false;
  for (int64_t b = 0; b < B; ++b) {
    if (qptr[b + 1] - qptr[b] <= kMinBlockTokens) {
      add_parts(b, max_block, fixed);
    } else {
      any_split = true;
    }
  }
  if (!any_split) return max_block;
  std::sort(fixed.begin(), fixed.end(), std::greater<double>());
  int64_t best_block = max_block;
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> load(static_cast<size_t>(std::max<int64_t>(1, threads)));
  for (int64_t block = max_block; block >= kMinBlockTokens; block /= 2) {
    split.clear();
    for (int64_t b = 0; b < B; ++b) {
      if (qptr[b + 1] - qptr[b] > kMinBlockTokens) add_parts(b, block, split);
    }
    std::sort(split.begin(), split.end(), std::greater<double>());
    costs.resize(fixed.size() + split.size());
    std::merge(fixed.begin(), fixed.end(), split.begin(), split.end(), costs.begin(),
               std::greater<double>());
    std::fill(load.begin(), load.end(), 0.0);
    for (double c : costs) *std::min_element(load.begin(), load.end()) += c;
    const double span = *std::max_element(load.begin(), load.end());
    if (span < best * (1.0 - 1e-9)) {
      best = span;
      best_block = block;
    }
  }
  return best_block;
}

// Splits the batch into work items. Requests' query tokens go in blocks of at most `max_block`
// tokens (choose_block, the split that keeps the threads evenly busy; on the AMX path fewer,
// down to kMinBlockTokens, until there are a few items per thread). With
// `group`, requests whose prefixes start with the same >= kMinShared slots (the radix cache
// hands every request that matched a prefix the same slots; the slots are compared here, not
// assumed) form groups; a group's blocks are cut into items of about kGroupItemRows rows.
Plan make_plan(int64_t B, const int64_t* kptr, const int64_t* qptr, const int32_t* pre_idx,
               int64_t G, int64_t Hkv, bool group, int64_t max_block, bool lanes, bool amx) {
  Plan plan;
  const int64_t threads = at::get_num_threads();
  int64_t block = max_block;
  if (!amx) {
    block = choose_block(B, kptr, qptr, G, Hkv, max_block, threads, lanes);
  } else {  // AMX items pack their keys (unmeasured here with choose_block: no AMX machine)
    int64_t total_tokens = 0;
    for (int64_t b = 0; b < B; ++b) total_tokens += qptr[b + 1] - qptr[b];
    while (block > kMinBlockTokens && Hkv * ((total_tokens + block - 1) / block) < 4 * threads) {
      block /= 2;
    }
  }
  auto add_blocks = [&](int64_t b, int32_t& row0) {  // appends b's token blocks as parts
    const int64_t e = qptr[b + 1] - qptr[b];
    const int64_t per = part_tokens(e, block);
    for (int64_t t0 = 0; t0 < e; t0 += per) {
      const int64_t t1 = std::min(e, t0 + per);
      plan.parts.push_back({static_cast<int32_t>(b), static_cast<int32_t>(t0),
                            static_cast<int32_t>(t1), row0});
      row0 += static_cast<int32_t>((t1 - t0) * G);
    }
  };
  auto part_cost = [&](const Part& p) {
    return (p.t1 - p.t0) * G * mean_keys(kptr, p.req, p.t0, p.t1);
  };
  auto add_items = [&](int32_t p_begin, int32_t p_end, int64_t shared) {
    int64_t cost = 0;
    for (int32_t i = p_begin; i < p_end; ++i) cost += part_cost(plan.parts[i]);
    for (int64_t h = 0; h < Hkv; ++h) {
      plan.items.push_back({cost, static_cast<int32_t>(h), static_cast<int32_t>(shared), p_begin,
                            p_end});
    }
  };

  std::vector<char> grouped(B, 0);
  if (group) {
    // Candidates keyed by the slot at position kMinShared - 1 (slot 0, the pool's dummy, never
    // groups); each candidate's common prefix with the bucket's first request is then counted.
    std::vector<std::pair<int32_t, int32_t>> cand;
    for (int64_t b = 0; b < B; ++b) {
      if (qptr[b + 1] > qptr[b] && kptr[b + 1] - kptr[b] >= kMinShared) {
        const int32_t slot = pre_idx[kptr[b] + kMinShared - 1];
        if (slot != 0) cand.push_back({slot, static_cast<int32_t>(b)});
      }
    }
    std::sort(cand.begin(), cand.end());
    for (size_t i = 0; i < cand.size();) {
      size_t j = i;
      while (j < cand.size() && cand[j].first == cand[i].first) ++j;
      if (j - i >= 2) {
        const int64_t first = cand[i].second;
        const int32_t* a = pre_idx + kptr[first];
        std::vector<int32_t> members;
        int64_t shared = kptr[first + 1] - kptr[first];
        for (size_t c = i; c < j; ++c) {
          const int64_t b = cand[c].second;
          const int32_t* s = pre_idx + kptr[b];
          const int64_t lim = std::min(kptr[b + 1] - kptr[b], kptr[first + 1] - kptr[first]);
          int64_t n = 0;
          while (n < lim && s[n] == a[n]) ++n;
          n -= n % kKeyBlock;
          if (n >= kMinShared) {
            members.push_back(static_cast<int32_t>(b));
            shared = std::min(shared, n);
          }
        }
        if (members.size() >= 2) {
          const int32_t p0 = static_cast<int32_t>(plan.parts.size());
          int32_t rows = 0;
          for (int32_t b : members) {
            grouped[b] = 1;
            add_blocks(b, rows);
          }
          const int32_t p1 = static_cast<int32_t>(plan.parts.size());
          // Items of about kGroupItemRows rows (whole parts, consecutive).
          const int64_t n_items =
              std::clamp<int64_t>((rows + kGroupItemRows - 1) / kGroupItemRows, 1, p1 - p0);
          int32_t begin = p0, row_base = 0;
          for (int64_t k = 1; k <= n_items; ++k) {
            const int64_t target = rows * k / n_items;
            int32_t end = begin + 1;
            while (end < p1 && (k == n_items || plan.parts[end].row0 < target)) ++end;
            for (int32_t p = begin; p < end; ++p) plan.parts[p].row0 -= row_base;
            add_items(begin, end, shared);
            if (end < p1) row_base = plan.parts[end].row0;
            begin = end;
            if (begin >= p1) break;
          }
        }
      }
      i = j;
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    if (grouped[b] || qptr[b + 1] == qptr[b]) continue;
    const int32_t p0 = static_cast<int32_t>(plan.parts.size());
    int32_t rows = 0;
    add_blocks(b, rows);
    for (int32_t p = p0; p < static_cast<int32_t>(plan.parts.size()); ++p) {
      plan.parts[p].row0 = 0;
      add_items(p, p + 1, 0);
    }
  }
  return plan;
}

// Per-thread scratch of one work item.
// The fp32 path's buffers (fma_attention::Scratch: s, kt, vp, alpha, which the vdpbf16ps path
// reuses for its scores and alphas) and both paths' own.
struct Scratch : fma_attention::Scratch {
  std::vector<float> q, o, m, l;
  // AMX path: the item's bf16 queries and the tiles' buffers.
  std::vector<at::BFloat16> qb;
  amx_attention::Scratch amx;
  // vdpbf16ps path (lane_attention.h): query pairs, causal limits, state, tiles, row pointers.
  lane_attention::Scratch lanes;
};

// T: q's and out's dtype; KV: the pool's (float16 under float32 queries: a narrowed pool, read in
// place on the fp32 FMA path like any pool whose keys it converts per block), else T.
template <typename T, int D, typename KV = T>
void extend_impl(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                 const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& loc,
                 const Tensor& qo_indptr, float scale, Tensor& out) {
  const int64_t B = kv_indptr.size(0) - 1;
  const int64_t H = q.size(1), Hkv = k_buffer.size(1), G = H / Hkv;
  const int64_t num_slots = k_buffer.size(0);
  const int64_t slot_stride = k_buffer.stride(0), head_stride = k_buffer.stride(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const KV* kb = k_buffer.data_ptr<KV>();
  const KV* vb = v_buffer.data_ptr<KV>();
  const int32_t* pre_idx = kv_indices.data_ptr<int32_t>();
  const int32_t* new_idx = loc.data_ptr<int32_t>();
  const int64_t* kptr = kv_indptr.data_ptr<int64_t>();
  const int64_t* qptr = qo_indptr.data_ptr<int64_t>();

  // AMX tiles for bf16 pools where usable (one part per item, as the fp32 path), else the
  // rows-in-lanes vdpbf16ps path where compiled in, else fp32 FMA.
  static_assert(std::is_same_v<KV, T> || !std::is_same_v<T, at::BFloat16>,
                "bf16 queries attend a bf16 pool (the AMX and lanes paths read it as T)");
  const bool amx = std::is_same_v<T, at::BFloat16> && amx_attention::supports_head_dim(D) &&
                   g_amx.load(std::memory_order_relaxed) && amx_attention::amx_usable();
  (void)amx;  // read only where the AMX path is compiled in
  bool lanes = false;  // rows-in-lanes vdpbf16ps path
#ifdef RADIXRT_EXTEND_BF16_DOT
  lanes = !amx && std::is_same_v<T, at::BFloat16> && g_bf16_dot.load(std::memory_order_relaxed);
  const bool group = lanes && g_groups.load(std::memory_order_relaxed);
#else
  const bool group = false;
#endif
  const Plan plan = make_plan(B, kptr, qptr, pre_idx, G, Hkv, group,
                              lanes ? kMaxLaneBlockTokens : kMaxBlockTokens, lanes, amx);

  auto check_slot = [&](int64_t slot) {
    TORCH_CHECK(slot >= 0 && slot < num_slots, "extend_attention: kv slot ", slot,
                " out of range [0, ", num_slots, ")");
    return slot;
  };
  // Part rows (row = row0 + t * G + g) from o [rows][D] / l [rows] into out, in T.
  auto write_out = [&](const Part& pt, int64_t h, const float* o, const float* l) {
    const int64_t nt = pt.t1 - pt.t0;
    for (int64_t r = 0; r < nt * G; ++r) {
      const int64_t t = r / G, g = r % G;
      T* dst = op + ((qptr[pt.req] + pt.t0 + t) * H + h * G + g) * D;
      const Vec inv(1.f / l[pt.row0 + r]);  // l >= 1: the row's maximum contributes exp(0)
      const float* src = o + (pt.row0 + r) * D;
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t c = 0; c < D; c += kVec) (Vec::loadu(src + c) * inv).store(dst + c);
      } else {
        for (int64_t c = 0; c < D; c += 2 * kVec) {
          if (c + 2 * kVec <= D) {
            from_f32<T>(Vec::loadu(src + c) * inv, Vec::loadu(src + c + kVec) * inv).store(dst + c);
          } else {
            store_f32<T>(dst + c, Vec::loadu(src + c) * inv);
          }
        }
      }
    }
  };

#ifdef RADIXRT_EXTEND_BF16_DOT
  // Rows-in-lanes path (LaneTiles): one item = shared-prefix phase over all its rows, then each
  // part over its own keys.
  auto work_lanes = [&](const Item& it, Scratch& sc) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
    constexpr int64_t DP = D / 2;
    const int64_t h = it.kv_head;
    const Part* parts = plan.parts.data() + it.p_begin;
    const int64_t nparts = it.p_end - it.p_begin;
    const Part& last = parts[nparts - 1];
    const int64_t nr = last.row0 + (last.t1 - last.t0) * G;
    const lane_attention::Pass<D> pass(sc.lanes, nr, scale);
    const int64_t ld = pass.ld;
    uint32_t* const qt = pass.qt;
    int32_t* const lim = pass.lim;
    const uint32_t** const krow = pass.krow;
    const void** const vrow = pass.vrow;
    // qt[dp][row]: the rows' query pairs, 16 rows at a time (each store fills a cache line);
    // lim[row]: the last key index its token sees.
    std::array<const uint32_t*, 16> qsrc{};
    for (int64_t p = 0; p < nparts; ++p) {
      const Part& pt = parts[p];
      const int64_t p_len = kptr[pt.req + 1] - kptr[pt.req];
      const int64_t rows = (pt.t1 - pt.t0) * G;
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t n = std::min<int64_t>(16, rows - r0);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = (r0 + i) / G, g = (r0 + i) % G;
          qsrc[i] = reinterpret_cast<const uint32_t*>(
              qp + ((qptr[pt.req] + pt.t0 + t) * H + h * G + g) * D);
          lim[pt.row0 + r0 + i] = static_cast<int32_t>(p_len + pt.t0 + t);
        }
        uint32_t* dst = qt + pt.row0 + r0;
        for (int64_t dp = 0; dp < DP; ++dp) {
          for (int64_t i = 0; i < n; ++i) dst[dp * ld + i] = qsrc[i][dp];
        }
      }
    }
    auto set_rows = [&](int64_t jj, int64_t slot) {
      check_slot(slot);
      krow[jj] = reinterpret_cast<const uint32_t*>(kb + slot * slot_stride + h * head_stride);
      vrow[jj] = vb + slot * slot_stride + h * head_stride;
    };
    // The K and V rows of a later block, into the caches while this one is computed.
    auto prefetch = [&](int64_t slot) {
      if (slot >= 0 && slot < num_slots) {
        prefetch_row(kb + slot * slot_stride + h * head_stride, D * sizeof(T));
        prefetch_row(vb + slot * slot_stride + h * head_stride, D * sizeof(T));
      }
    };
    // Shared prefix: keys [0, shared) of every part's request, all rows.
    const int32_t* shared_idx = pre_idx + kptr[parts[0].req];
    for (int64_t j0 = 0; j0 < it.shared; j0 += kKeyBlock) {
      for (int64_t jj = 0; jj < kKeyBlock; ++jj) set_rows(jj, shared_idx[j0 + jj]);
      if (RADIXRT_EXT_PREFETCH && j0 + kKeyBlock < it.shared) {
        for (int64_t jj = 0; jj < kKeyBlock; ++jj) prefetch(shared_idx[j0 + kKeyBlock + jj]);
      }
      pass.block(j0, kKeyBlock, 0, nr);
    }
    // Each part over its own keys [shared, p_len + t1): the rest of its prefix, then new keys.
    for (int64_t p = 0; p < nparts; ++p) {
      const Part& pt = parts[p];
      const int64_t p_len = kptr[pt.req + 1] - kptr[pt.req], key_end = p_len + pt.t1;
      const int32_t* pidx = pre_idx + kptr[pt.req];
      const int32_t* nidx = new_idx + qptr[pt.req];
      const int64_t row_end = pt.row0 + (pt.t1 - pt.t0) * G;
      for (int64_t j0 = it.shared; j0 < key_end; j0 += kKeyBlock) {
        const int64_t nb = std::min(kKeyBlock, key_end - j0);
        for (int64_t jj = 0; jj < nb; ++jj) {
          const int64_t j = j0 + jj;
          set_rows(jj, j < p_len ? pidx[j] : nidx[j - p_len]);
        }
        if (RADIXRT_EXT_PREFETCH) {
          for (int64_t j = j0 + kKeyBlock; j < std::min(key_end, j0 + 2 * kKeyBlock); ++j) {
            prefetch(j < p_len ? pidx[j] : nidx[j - p_len]);
          }
        }
        // Rows whose token sees no key of this block are skipped (a suffix of tokens is active).
        const int64_t r_lo = pt.row0 + std::max<int64_t>(0, j0 - p_len - pt.t0) * G;
        if (r_lo < row_end) pass.block(j0, nb, r_lo, row_end);
      }
    }
    for (int64_t p = 0; p < nparts; ++p) write_out(parts[p], h, pass.o, pass.l);
    }  // T is BFloat16
  };
#endif

#ifdef RADIXRT_AMX_ATTENTION
  // AMX: the K / V blocks of each request cut into kMinPackParts parts or more, packed once
  // for all of them (each part's item attends every block up to its last token: a 512-token
  // prefill in 64-token parts packed 36 blocks instead of 8), up to kMaxPackBytes in all.
  // packed_at[b * Hkv + h]: request b's blocks for KV head h in `packs`, or -1 (its items pack
  // as they go). `packs` is kept from call to call, grown to the largest (a fresh allocation of
  // MBs is mapped anew by each call, its page faults costing more than the packing saves), 64-byte
  // aligned (each packed tile row one cache line), held by the calling thread: the workers reach
  // it through `pack_base` (a thread_local named in a worker is the worker's own).
  std::vector<int64_t> packed_at;
  thread_local Tensor packs;
  uint16_t* pack_base = nullptr;
  if constexpr (std::is_same_v<T, at::BFloat16> && amx_attention::supports_head_dim(D)) {
    if (amx && team_member() == nullptr) {  // a decode team's members would each pack all
      std::vector<int32_t> nparts(B, 0);
      for (const Part& pt : plan.parts) ++nparts[pt.req];
      packed_at.assign(B * Hkv, -1);
      struct PackTask {
        int32_t req, kv_head, j0;
      };
      std::vector<PackTask> tasks;
      int64_t total = 0;
      for (int64_t b = 0; b < B; ++b) {
        if (nparts[b] < kMinPackParts) continue;
        const int64_t keys = kptr[b + 1] - kptr[b] + qptr[b + 1] - qptr[b];
        const int64_t need = Hkv * ((keys + kKeyBlock - 1) / kKeyBlock) *
                             amx_attention::kBlockPack<D>;
        if ((total + need) * 2 > kMaxPackBytes) continue;
        for (int64_t h = 0; h < Hkv; ++h) {
          packed_at[b * Hkv + h] = total;
          total += (keys + kKeyBlock - 1) / kKeyBlock * amx_attention::kBlockPack<D>;
          for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
            tasks.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                             static_cast<int32_t>(j0)});
          }
        }
      }
      if (total > 0) {
        if (!packs.defined() || packs.numel() < total) {
          packs = at::empty({total}, at::TensorOptions().dtype(at::kShort));
        }
        pack_base = reinterpret_cast<uint16_t*>(packs.data_ptr<int16_t>());
        uint16_t* pk = pack_base;
        at::parallel_for(0, static_cast<int64_t>(tasks.size()), 4, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            const PackTask& task = tasks[t];
            const int64_t b = task.req, h = task.kv_head, j0 = task.j0;
            const int64_t p_len = kptr[b + 1] - kptr[b];
            const int64_t keys = p_len + qptr[b + 1] - qptr[b];
            const int32_t* pidx = pre_idx + kptr[b];
            const int32_t* nidx = new_idx + qptr[b];
            auto row = [&](const T* base, int64_t jj) {
              const int64_t j = j0 + jj;
              const int64_t slot = check_slot(j < p_len ? pidx[j] : nidx[j - p_len]);
              return reinterpret_cast<const uint16_t*>(base + slot * slot_stride +
                                                       h * head_stride);
            };
            amx_attention::pack_block<D>([&](int64_t jj) { return row(kb, jj); },
                                         [&](int64_t jj) { return row(vb, jj); },
                                         std::min(kKeyBlock, keys - j0),
                                         pk + packed_at[b * Hkv + h] +
                                             j0 / kKeyBlock * amx_attention::kBlockPack<D>);
          }
        });
      }
    }
  }
#endif

  // One part per item: on AMX tiles where `amx` (bf16 queries as given, the scores scaled in
  // fp32), else the fp32 FMA path (keys converted to fp32 per block, queries scaled).
  auto work = [&](const Item& it, Scratch& sc) {
    const Part& pt = plan.parts[it.p_begin];
    const int64_t b = pt.req, h = it.kv_head;
    const int64_t p_len = kptr[b + 1] - kptr[b];
    const int32_t* pidx = pre_idx + kptr[b];
    const int32_t* nidx = new_idx + qptr[b];
    const int64_t nt = pt.t1 - pt.t0, nq = nt * G;
    sc.o.assign(nq * D, 0.f);
    sc.m.assign(nq, kNegInf);
    sc.l.assign(nq, 0.f);
    const int64_t key_end = p_len + pt.t1;  // keys of the last token: 0..p_len + t1 - 1
    auto slot_of = [&](int64_t j) { return check_slot(j < p_len ? pidx[j] : nidx[j - p_len]); };
    // rows whose token sees no key of block j0 are skipped (a suffix of tokens is active)
    auto row_lo = [&](int64_t j0) { return std::max<int64_t>(0, j0 - p_len - pt.t0) * G; };
    // the causal limit: keys of block j0 (nb of them) that row r sees, >= 1
    auto visible = [&](int64_t r, int64_t j0, int64_t nb) {
      return std::min(nb, p_len + pt.t0 + r / G - j0 + 1);
    };
    // Row r = token (t0 + r / G), query head h * G + r % G.
    auto query = [&](int64_t t) { return qp + ((qptr[b] + pt.t0 + t) * H + h * G) * D; };
#ifdef RADIXRT_AMX_ATTENTION
    if constexpr (std::is_same_v<T, at::BFloat16> && amx_attention::supports_head_dim(D)) {
      if (amx) {
        // queries and outputs with the slack rows attend's tiles may touch
        sc.qb.resize((nq + amx_attention::kSlackRows) * D);
        for (int64_t t = 0; t < nt; ++t) std::copy_n(query(t), G * D, sc.qb.data() + t * G * D);
        sc.o.resize((nq + amx_attention::kSlackRows) * D);
        const int64_t at = packed_at[b * Hkv + h];
        const uint16_t* packed = at < 0 ? nullptr : pack_base + at;
        amx_attention::attend<D>(sc.qb.data(), nq, scale, key_end, slot_of, row_lo, visible,
                                 kb + h * head_stride, vb + h * head_stride, slot_stride,
                                 sc.m.data(), sc.l.data(), sc.o.data(), sc.amx, packed);
        return write_out(Part{pt.req, pt.t0, pt.t1, 0}, h, sc.o.data(), sc.l.data());
      }
    }
#endif
    sc.q.resize(nq * D);
    for (int64_t t = 0; t < nt; ++t) {
      const T* src = query(t);
      float* dst = sc.q.data() + t * G * D;
      const Vec vs(scale);
      for (int64_t e = 0; e < G * D; e += kVec) (load_f32<T>(src + e) * vs).store(dst + e);
    }
    fma_attention::attend<KV, D>(sc.q.data(), nq, key_end, slot_of, row_lo, visible,
                                 kb + h * head_stride, vb + h * head_stride, slot_stride,
                                 sc.m.data(), sc.l.data(), sc.o.data(), sc);
    write_out(Part{pt.req, pt.t0, pt.t1, 0}, h, sc.o.data(), sc.l.data());
  };

  std::vector<Item> items = plan.items;
  run_largest_first(items, kMinParallelWork, [&](const Item& it) {
    thread_local Scratch sc;  // grows to the largest item a thread has run
#ifdef RADIXRT_EXTEND_BF16_DOT
    if (lanes) return work_lanes(it, sc);
#endif
    work(it, sc);
  });
}

template <typename T, typename KV = T>
void dispatch_head_dim(int64_t D, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& idx, const Tensor& kptr, const Tensor& loc,
                       const Tensor& qptr, float scale, Tensor& out) {
  switch (D) {
    case 16:
      return extend_impl<T, 16, KV>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 32:
      return extend_impl<T, 32, KV>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 64:
      return extend_impl<T, 64, KV>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 96:
      return extend_impl<T, 96, KV>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 128:
      return extend_impl<T, 128, KV>(q, k, v, idx, kptr, loc, qptr, scale, out);
    default:
      TORCH_CHECK(false, "extend_attention: unsupported head_dim ", D);
  }
}

void check_index(const Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(),
              "extend_attention: ", name, " must be a contiguous 1-D ", dtype, " CPU tensor");
}

Tensor extend_attention(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                        const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& loc,
                        const Tensor& qo_indptr, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "extend_attention: q must be contiguous [N, H, D]");
  check_kv_buffers(k_buffer, v_buffer, "extend_attention");
  const bool narrowed = q.scalar_type() == at::kFloat && k_buffer.scalar_type() == at::kHalf;
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type() &&
                  (q.scalar_type() == k_buffer.scalar_type() || narrowed),
              "extend_attention: q, k_buffer and v_buffer must have one dtype (or q float32 "
              "over a float16 pool)");
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu() && v_buffer.device().is_cpu(),
              "extend_attention: CPU tensors only");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_buffer.size(1);
  TORCH_CHECK(k_buffer.size(2) == D, "extend_attention: head_dim of q and the pool differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "extend_attention: heads (", H,
              ") must be a multiple of kv_heads (", Hkv, ")");
  check_index(kv_indices, "kv_indices", at::kInt);
  check_index(loc, "loc", at::kInt);
  check_index(kv_indptr, "kv_indptr", at::kLong);
  check_index(qo_indptr, "qo_indptr", at::kLong);
  const int64_t B = kv_indptr.numel() - 1;
  TORCH_CHECK(B >= 0 && qo_indptr.numel() == B + 1,
              "extend_attention: kv_indptr and qo_indptr must both have batch + 1 entries");
  TORCH_CHECK(loc.numel() == N, "extend_attention: loc must have one slot per query token");
  const int64_t* kp = kv_indptr.data_ptr<int64_t>();
  const int64_t* qp = qo_indptr.data_ptr<int64_t>();
  TORCH_CHECK(B == 0 || (kp[0] == 0 && qp[0] == 0 && kp[B] == kv_indices.numel() && qp[B] == N),
              "extend_attention: indptrs must run from 0 to len(kv_indices) / num tokens");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(kp[b] <= kp[b + 1] && qp[b] <= qp[b + 1],
                "extend_attention: indptrs must be non-decreasing");
  }
  TORCH_CHECK(scale > 0, "extend_attention: scale must be positive");
  Tensor out = at::empty_like(q);
  if (N == 0) return out;
  const float s = static_cast<float>(scale);
  if (narrowed) {
    dispatch_head_dim<float, at::Half>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc,
                                       qo_indptr, s, out);
    return out;
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc, qo_indptr,
                               s, out);
      break;
    case at::kBFloat16:
      dispatch_head_dim<at::BFloat16>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc,
                                      qo_indptr, s, out);
      break;
    case at::kHalf:
      dispatch_head_dim<at::Half>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc,
                                  qo_indptr, s, out);
      break;
    default:
      TORCH_CHECK(false, "extend_attention: dtype must be float32, bfloat16 or float16, got ",
                  q.scalar_type());
  }
  return out;
}

std::vector<int64_t> extend_attention_head_dims() { return {16, 32, 64, 96, 128}; }

std::string extend_attention_isa() { return RADIXRT_STR(CPU_CAPABILITY); }

// choose_block for requests with `cached` prefix keys and `new_tokens` query tokens each, on the
// rows-in-lanes path (`lanes`) or the fp32-FMA one.
int64_t extend_attention_block(std::vector<int64_t> cached, std::vector<int64_t> new_tokens,
                               int64_t group_size, int64_t num_kv_heads, int64_t threads,
                               bool lanes) {
  TORCH_CHECK(cached.size() == new_tokens.size() && group_size > 0 && num_kv_heads > 0 &&
                  threads > 0,
              "extend_attention_block: one cached count per request, positive sizes");
  const int64_t B = static_cast<int64_t>(cached.size());
  std::vector<int64_t> kptr(B + 1, 0), qptr(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    kptr[b + 1] = kptr[b] + cached[b];
    qptr[b + 1] = qptr[b] + new_tokens[b];
  }
  return choose_block(B, kptr.data(), qptr.data(), group_size, num_kv_heads,
                      lanes ? kMaxLaneBlockTokens : kMaxBlockTokens, threads, lanes);
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def(
      "extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor kv_indices, "
      "Tensor kv_indptr, Tensor loc, Tensor qo_indptr, float scale) -> Tensor");
  m.def("extend_attention_head_dims() -> int[]", &radixrt_cpu::extend_attention_head_dims);
  m.def("extend_attention_isa() -> str", &radixrt_cpu::extend_attention_isa);
  // Benchmarks / tests: bf16 pools through vdpbf16ps (true, the default where compiled in) or
  // fp32 FMA; returns the previous setting (always false without AVX512-BF16).
  m.def("extend_attention_bf16_dot(bool enable) -> bool",
        &radixrt_cpu::extend_attention_bf16_dot);
  // Benchmarks / tests: shared-prefix groups on the vdpbf16ps path (true, the default) or every
  // request alone; returns the previous setting (always false without AVX512-BF16).
  m.def("extend_attention_groups(bool enable) -> bool", &radixrt_cpu::extend_attention_groups);
  // Benchmarks / tests: bf16 pools on AMX tiles (true, the default where this process may use
  // them) or not; returns the previous setting (always false where AMX is unusable).
  m.def("extend_attention_amx(bool enable) -> bool", &radixrt_cpu::extend_attention_amx);
  // Tests: the query block (tokens per work item) the rows-in-lanes (`lanes`) or fp32-FMA path
  // picks for these requests on `threads` threads.
  m.def("extend_attention_block(int[] cached, int[] new_tokens, int group_size, "
        "int num_kv_heads, int threads, bool lanes) -> int",
        &radixrt_cpu::extend_attention_block);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("extend_attention", &radixrt_cpu::extend_attention);
}
