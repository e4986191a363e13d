// What a benchmark records about the two CPUs a 2-thread step runs on: the round trip of a
// cache line between torch's first two intra-op threads.
//
//   thread_round_trip_ns(rounds) -> float: mean ns of one round trip (thread 0 writes, thread 1
//   sees it and answers, thread 0 sees the answer), over `rounds` round trips; NaN when fewer
//   than 2 threads run the region.
//
// On the 2-vCPU machines seen here it tells two placements apart that move a decode step by
// 10-25%: two hyperthreads of one core (~50 ns: they share the core's caches and its memory
// bandwidth, ~45 GB/s) or two cores (~350-400 ns: twice the bandwidth, every cache line one
// thread writes and the other reads costs a trip between them). The hypervisor moves a VM
// between the two from minute to minute, so a benchmark measures this next to its steps.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>

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
  // Spins until `ready()`; false once it waited ~seconds (the other thread may never come) or
  // the other gave up.
  auto wait = [&](const auto& ready) {
    for (int64_t spins = 0; !ready(); ++spins) {
      if (spins > (int64_t{1} << 26) || gave_up.load(std::memory_order_relaxed)) {
        gave_up.store(true, std::memory_order_relaxed);
        return false;
      }
      relax();
    }
    return true;
  };
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

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("thread_round_trip_ns(int rounds=2000) -> float", &radixrt_cpu::thread_round_trip_ns);
}
