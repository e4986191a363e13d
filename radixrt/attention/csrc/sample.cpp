// Sampled rows' draw in one op per row: temperature, top-k, top-p (over the top-k renormalized
// distribution), min-p, then inverse CDF. sample_rows(scores [N, V] float32, temperatures [N]
// float32 (> 0), top_ks [N] int64 (>= V: off), top_ps [N] float32 (>= 1: off), min_ps [N]
// float32 (0: off), u [N] float64 in [0, 1)) -> int64 [N]. The same choice as the sampler's
// torch path (`filter_logits` + `pick_by_uniform`) up to float rounding at a cut or at a CDF
// boundary: the torch path took ~0.4 ms a row of a 49k vocabulary with top-p (a top-256
// selection, a scatter of -inf over the whole row, a cumulative sum), this a few tens of us.
//
// A row, with weights w_i = exp((x_i - max) / t) (the largest is exactly 1, masked tokens 0):
//  * the top-k / top-p cut needs only the heaviest tokens, ordered by weight descending, index
//    ascending among equals. Top-k: the k heaviest, from one pass with a heap. Top-p alone: the
//    tokens with w >= tau, tau lowered (2^-12, 2^-30, then every token with weight) until they
//    hold more than p of the mass. Kept: the sorted prefix whose mass before each token is at
//    most p x the kept top-k's mass (the whole row's without top-k);
//  * min-p keeps w >= min_p (the torch path's x >= max + log(min_p), in weights);
//  * the draw: the first kept token, in index order, whose cumulative weight exceeds u x the
//    kept total (summed in double); rounding past the end takes the last kept token with weight.
// Invariant: a token outside the cut, below min-p or masked (-inf, weight 0) is never picked.
// Rows are independent and go to threads when there are several.

#include <torch_headers.h>  // first: precompiled by the build

#include "vec_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace radixrt_cpu {
namespace {

using at::Tensor;
constexpr int64_t kChunk = 1024;  // the draw's running total is kept per chunk of tokens
constexpr float kTaus[] = {0x1p-12f, 0x1p-30f, 0.0f};

struct Cand {
  float w;
  int32_t i;
};

inline bool heavier(const Cand& a, const Cand& b) { return a.w > b.w || (a.w == b.w && a.i < b.i); }

// w[i] = exp((x[i] - m) * inv_t) (NaN -> 0); returns sum w (double over vectors).
double row_weights(const float* x, float* w, int64_t n, float m, float inv_t) {
  const Vec vm(m), vt(inv_t), zero(0.f);
  double total = 0.0;
  int64_t i = 0;
  for (; i + 4 * kVec <= n; i += 4 * kVec) {
    Vec acc(0.f);
    for (int64_t j = 0; j < 4; ++j) {
      Vec e = ((Vec::loadu(x + i + j * kVec) - vm) * vt).exp();
      e = Vec::blendv(zero, e, e == e);  // NaN -> 0
      e.store(w + i + j * kVec);
      acc = acc + e;
    }
    total += hsum(acc);
  }
  for (; i < n; ++i) {
    const float e = std::exp((x[i] - m) * inv_t);
    w[i] = std::isnan(e) ? 0.f : e;
    total += w[i];
  }
  return total;
}

float row_max(const float* x, int64_t n) {
  Vec acc(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) acc = at::vec::maximum(acc, Vec::loadu(x + i));
  float m = hmax(acc);  // a NaN lane propagates; it is dropped below
  if (std::isnan(m)) {
    m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < i; ++j) {
      if (!std::isnan(x[j])) m = std::max(m, x[j]);
    }
  }
  for (; i < n; ++i) {
    if (!std::isnan(x[i])) m = std::max(m, x[i]);
  }
  return m;
}

// The k heaviest tokens with weight (index ascending among equals), in no particular order: one
// pass keeping them in a heap whose top is the lightest; once it holds k, a vector of weights
// none heavier than that top is skipped whole (most of a row).
std::vector<Cand> heaviest(const float* w, int64_t n, int64_t k) {
  std::vector<Cand> h;
  h.reserve(k);
  auto offer = [&](int64_t i) {
    if (!(w[i] > 0.f)) return;
    const Cand c{w[i], static_cast<int32_t>(i)};
    if (static_cast<int64_t>(h.size()) < k) {
      h.push_back(c);
      std::push_heap(h.begin(), h.end(), heavier);
    } else if (heavier(c, h.front())) {
      std::pop_heap(h.begin(), h.end(), heavier);
      h.back() = c;
      std::push_heap(h.begin(), h.end(), heavier);
    }
  };
  constexpr int all_false = (1 << kVec) - 1;
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    if (static_cast<int64_t>(h.size()) == k) {
      // a later token equal to the lightest kept one loses its tie (higher index)
      const Vec gt = Vec::loadu(w + i) > Vec(h.front().w);
      if (gt.zero_mask() == all_false) continue;
    }
    for (int64_t j = i; j < i + kVec; ++j) offer(j);
  }
  for (; i < n; ++i) offer(i);
  return h;
}

// The top-k / top-p kept tokens of a row (weights w, total z), in no particular order.
std::vector<Cand> cut_row(const float* w, int64_t n, double z, int64_t k, float p, bool has_k,
                          bool has_p) {
  std::vector<Cand> c;
  if (has_k) {
    c = heaviest(w, n, k);
  } else {  // top-p alone: the tokens above a threshold, lowered until they hold more than p
    for (const float tau : kTaus) {
      c.clear();
      double mass = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        if (w[i] >= tau && w[i] > 0.f) {
          c.push_back({w[i], static_cast<int32_t>(i)});
          mass += w[i];
        }
      }
      if (mass > double(p) * z || tau == 0.f) break;
    }
  }
  if (!has_p) return c;
  std::sort(c.begin(), c.end(), heavier);
  double kept_total = 0.0;
  if (has_k) {
    for (const Cand& e : c) kept_total += e.w;
  } else {
    kept_total = z;
  }
  const double limit = double(p) * kept_total;
  double before = 0.0;
  size_t keep = 0;
  while (keep < c.size() && before <= limit) before += c[keep++].w;
  c.resize(std::max<size_t>(keep, 1));
  return c;
}

int64_t draw_listed(std::vector<Cand>& kept, float min_p, double u) {
  // min_p <= 1 and the heaviest token weighs 1, so something is left
  kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Cand& e) { return e.w < min_p; }),
             kept.end());
  std::sort(kept.begin(), kept.end(), [](const Cand& a, const Cand& b) { return a.i < b.i; });
  double total = 0.0;
  for (const Cand& e : kept) total += e.w;
  const double target = u * total;
  double acc = 0.0;
  for (const Cand& e : kept) {
    acc += e.w;
    if (acc > target) return e.i;
  }
  return kept.back().i;
}

// Every token with w >= thr kept (thr 0: all).
int64_t draw_above(const float* w, int64_t n, float thr, double u) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> sums(chunks);
  const Vec vt(thr), zero(0.f);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    Vec acc(0.f);
    int64_t i = lo;
    for (; i + kVec <= hi; i += kVec) {
      const Vec v = Vec::loadu(w + i);
      acc = acc + Vec::blendv(zero, v, v >= vt);
    }
    double s = hsum(acc);
    for (; i < hi; ++i) s += w[i] >= thr ? w[i] : 0.f;
    sums[c] = s;
    total += s;
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t c = 0; c < chunks; ++c) {
    if (sums[c] > 0.0) last = c;
    if (acc + sums[c] <= target) {
      acc += sums[c];
      continue;
    }
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    for (int64_t i = lo; i < hi; ++i) {
      if (w[i] >= thr && w[i] > 0.f) {
        acc += w[i];
        if (acc > target) return i;
      }
    }
    acc = 0.0;  // rounding: the chunk's tokens summed to no more than its vector sum; go on
    for (int64_t d = 0; d <= c; ++d) acc += sums[d];
  }
  // the target is at or past the total: the last token with weight
  for (int64_t i = std::min(n, (last + 1) * kChunk) - 1; i >= 0; --i) {
    if (w[i] >= thr && w[i] > 0.f) return i;
  }
  return 0;
}

Tensor sample_rows(const Tensor& scores, const Tensor& temperatures, const Tensor& top_ks,
                   const Tensor& top_ps, const Tensor& min_ps, const Tensor& u) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 && scores.scalar_type() == at::kFloat,
              "sample_rows: scores must be a 2-D float32 CPU tensor");
  const int64_t rows = scores.size(0), n = scores.size(1);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31), "sample_rows: bad vocabulary size ", n);
  auto check = [&](const Tensor& t, at::ScalarType dt, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == rows && t.scalar_type() == dt,
                "sample_rows: ", name, " must be a CPU ", dt, " tensor of ", rows, " rows");
  };
  check(temperatures, at::kFloat, "temperatures");
  check(top_ks, at::kLong, "top_ks");
  check(top_ps, at::kFloat, "top_ps");
  check(min_ps, at::kFloat, "min_ps");
  check(u, at::kDouble, "u");
  const Tensor x = scores.contiguous();
  const Tensor tc = temperatures.contiguous(), kc = top_ks.contiguous();
  const Tensor pc = top_ps.contiguous(), mc = min_ps.contiguous(), uc = u.contiguous();
  Tensor out = at::empty({rows}, scores.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  const float* pp = pc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / n);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    // each thread's weights row, kept between calls: a fresh [rows, V] buffer a call cost its
    // page faults (~1.5 ms at 64 rows) and left the L2 before being read back
    thread_local std::vector<float> weights;
    if (static_cast<int64_t>(weights.size()) < n) weights.resize(n);
    float* w = weights.data();
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * n;
      const float m = row_max(xr, n);
      TORCH_CHECK(std::isfinite(m) && tp[r] > 0.f, "sample_rows: row ", r,
                  " has no finite score or a temperature <= 0");
      const double z = row_weights(xr, w, n, m, 1.0f / tp[r]);
      const bool has_k = kp[r] < n, has_p = pp[r] < 1.0f;
      const float min_p = std::clamp(mp[r], 0.0f, 1.0f);
      const double ur = std::clamp(up[r], 0.0, 1.0);
      if (has_k || has_p) {
        std::vector<Cand> kept = cut_row(w, n, z, std::max<int64_t>(kp[r], 1), pp[r], has_k, has_p);
        op[r] = draw_listed(kept, min_p, ur);
      } else {
        op[r] = draw_above(w, n, min_p, ur);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("sample_rows(Tensor scores, Tensor temperatures, Tensor top_ks, Tensor top_ps, "
        "Tensor min_ps, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) { m.impl("sample_rows", &radixrt_cpu::sample_rows); }
