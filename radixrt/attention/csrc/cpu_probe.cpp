// What a benchmark records about the two CPUs a 2-thread step runs on.
//
//   thread_round_trip_ns(rounds) -> float: mean ns of one round trip of a cache line between
//   torch's first two intra-op threads (thread 0 writes, thread 1 sees it and answers, thread 0
//   sees the answer), over `rounds` round trips; NaN when fewer than 2 threads run the region.
//   thread_compute_scaling(iters) -> float: the multiply-add throughput of those two threads
//   running a loop of `iters` steps together, over the calling thread's running it alone (best
//   of 3 each): ~2 when each thread has a core of its own, ~1-1.3 when they are two hardware
//   threads of one core sharing its execution units; NaN when fewer than 2 threads run.
//   far_round_trip_ns() -> float: the round trip over which two threads are "far" (placement.h),
//   the decode team's threshold, for benchmarks to judge by the same.
//
// On the 2-vCPU machines seen here the round trip tells two placements apart that move a decode
// step by 10-25%: "near" (~50 ns: the two vCPUs share a cache, and with it the memory
// bandwidth of one cache complex, ~45 GB/s) or "far" (~350-400 ns: twice the bandwidth, every
// cache line one thread writes and the other reads costs a trip between them). The compute
// scaling was 2.0 in both (stop 30): each vCPU is a core of its own either way, "near" being
// two cores behind one L3, not two hardware threads of one core. The hypervisor moves a VM
// between the two placements from minute to minute, so a benchmark measures this next to its
// steps.

#include <torch_headers.h>  // first: precompiled by the build

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>

#include "placement.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace {

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// Spins until `ready()`; false, with `gave_up` set, once it has waited ~seconds (the other
// thread may never come) or the other thread gave up.
template <typename F>
bool spin_until(const F& ready, std::atomic<bool>& gave_up) {
  for (int64_t spins = 0; !ready(); ++spins) {
    if (spins > (int64_t{1} << 26) || gave_up.load(std::memory_order_relaxed)) {
      gave_up.store(true, std::memory_order_relaxed);
      return false;
    }
    relax();
  }
  return true;
}

double thread_round_trip_ns(int64_t rounds) {
  TORCH_CHECK(rounds > 0, "thread_round_trip_ns: rounds must be positive, got ", rounds);
  if (at::in_parallel_region() || at::get_num_threads() < 2) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  struct alignas(64) Line {
    std::atomic<int64_t> v{0};
  };
  Line ball, arrived;
  std::atomic<bool> gave_up{false};
  auto wait = [&](const auto& ready) { return spin_until(ready, gave_up); };
  double ns = std::numeric_limits<double>::quiet_NaN();
  at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {
    if (e - b != 1) return;  // one thread got both: nothing to measure
    arrived.v.fetch_add(1, std::memory_order_acq_rel);
    if (!wait([&] { return arrived.v.load(std::memory_order_acquire) >= 2; })) return;
    if (b == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < rounds; ++i) {
        ball.v.store(2 * i + 1, std::memory_order_release);
        if (!wait([&] { return ball.v.load(std::memory_order_acquire) == 2 * i + 2; })) return;
      }
      const auto t1 = std::chrono::steady_clock::now();
      ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(rounds);
    } else {
      for (int64_t i = 0; i < rounds; ++i) {
        if (!wait([&] { return ball.v.load(std::memory_order_acquire) == 2 * i + 1; })) return;
        ball.v.store(2 * i + 2, std::memory_order_release);
      }
    }
  });
  return ns;
}

// Seconds for `iters` steps of kChains independent vector multiply-adds (enough chains to keep
// the FMA units busy rather than waiting on one chain's latency); their sum is added to `sink`,
// which the caller uses, so that the loop is not optimized away.
double fma_loop_seconds(int64_t iters, float factor, float& sink) {
  using V = at::vec::Vectorized<float>;
  constexpr int kChains = 12;
  V acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = V(static_cast<float>(c) * 1e-3f);
  const V a(factor), b(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = at::vec::fmadd(acc[c], a, b);
  }
  const auto t1 = std::chrono::steady_clock::now();
  for (int c = 0; c < kChains; ++c) {
    float lanes[V::size()];
    acc[c].store(lanes);
    sink += lanes[0];
  }
  return std::chrono::duration<double>(t1 - t0).count();
}

double thread_compute_scaling(int64_t iters) {
  TORCH_CHECK(iters > 0, "thread_compute_scaling: iters must be positive, got ", iters);
  if (at::in_parallel_region() || at::get_num_threads() < 2) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const float factor = 0.999999f;
  double alone = std::numeric_limits<double>::infinity();
  double together = std::numeric_limits<double>::infinity();
  std::atomic<bool> gave_up{false};  // or one thread got both indices
  float sinks[3] = {0.f, 0.f, 0.f};  // the loops' results (alone, thread 0, thread 1)
  for (int rep = 0; rep < 3; ++rep) {
    alone = std::min(alone, fma_loop_seconds(iters, factor, sinks[2]));
    double secs[2] = {0.0, 0.0};
    std::atomic<int64_t> arrived{0};
    at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {
      if (e - b != 1) {  // one thread got both: nothing to measure
        gave_up.store(true, std::memory_order_relaxed);
        return;
      }
      arrived.fetch_add(1, std::memory_order_acq_rel);
      if (!spin_until([&] { return arrived.load(std::memory_order_acquire) >= 2; }, gave_up)) {
        return;
      }
      secs[b] = fma_loop_seconds(iters, factor, sinks[b]);
    });
    if (gave_up.load(std::memory_order_relaxed)) return std::numeric_limits<double>::quiet_NaN();
    together = std::min(together, std::max(secs[0], secs[1]));
  }
  volatile float used = sinks[0] + sinks[1] + sinks[2];  // keeps the loops
  (void)used;
  return 2.0 * alone / together;
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("thread_round_trip_ns(int rounds=2000) -> float", &radixrt_cpu::thread_round_trip_ns);
  m.def("thread_compute_scaling(int iters=2000000) -> float",
        &radixrt_cpu::thread_compute_scaling);
  m.def("far_round_trip_ns() -> float", [] { return radixrt_cpu::kFarRoundTripNs; });
}
