// A decode step's threads as one team (radixrt::decode_layers' one-pass path): every thread runs
// the whole layer loop inside one parallel region and the ops split their work among the team
// instead of opening a parallel region each. Between two ops the team meets at a spin barrier
// (tens of ns between two cores sharing a cache, a few hundred between cores that do not)
// instead of an OpenMP fork and join per op (~0.4 us between the first, far more between the
// second), and the ops that ran on one thread (norms, RoPE, kv_store) run on all.
//
// How an op sees the team: `team_member()` is the calling thread's membership while it runs a
// team's layers (null everywhere else: the ops then run as they always do). Every member calls
// the same ops in the same order on the same shapes, so:
// - `team_empty` hands each member the same memory for an op's output: each member bumps its
//   own offset through the team's arena by the same sizes (no communication). The arena has two
//   halves, one per layer parity (`next_layer`), so a layer's outputs are never overwritten
//   while the next layer reads them (a half is reused two layers later, past several barriers).
// - `own` memory (TeamMember::empty with own): each member's own part of the arena, for the
//   outputs of a row op that every member runs on every row (`whole_rows`), which only that
//   member reads.
// - no shared counter hands out the work: an op splits its items by a rule every member computes
//   alike (equal shares of rows or items, or the work queue's cost split), since a counter two
//   cores without a common cache both write costs a round trip per claim. A member that has run
//   its share may then take the others' last items (TeamMember::run_items, "stealing"): each
//   member claims its own items from a word on a cache line of its own, which the other cores
//   touch only when they come to take from it.
// Invariants: every member reaches every barrier (the ops' checks see the same inputs on every
// member, so they raise on every member or on none); a member that raises anyway marks the team
// failed, and the others leave their barriers with an error instead of waiting forever.

#pragma once

#include <ATen/ATen.h>

#include "placement.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace radixrt_cpu {

// Barrier waits by member and phase, for bench/team_waits.py only: a library built with
// RADIXRT_TEAM_WAITS=1 (under its own op namespace) times every wait of every barrier and adds
// it to the calling member's entry of the phase the layer loop last named (RADIXRT_TEAM_PHASE);
// elsewhere the macro is empty and nothing is timed.
#ifndef RADIXRT_TEAM_WAITS
#define RADIXRT_TEAM_WAITS 0
#endif
#if RADIXRT_TEAM_WAITS
constexpr int kWaitMembers = 4, kWaitPhases = 16;
struct TeamWaits {
  std::atomic<int64_t> ns[kWaitMembers][kWaitPhases];
  std::atomic<int64_t> count[kWaitMembers][kWaitPhases];
};
inline TeamWaits team_waits;
inline thread_local int team_phase = 0;
#define RADIXRT_TEAM_PHASE(k) (::radixrt_cpu::team_phase = (k))
#else
#define RADIXRT_TEAM_PHASE(k) ((void)0)
#endif

// A counter alone on its cache line.
struct alignas(64) TeamCounter {
  std::atomic<int64_t> v{0};
};

inline void team_pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// The process's settings of TeamMember::run_items (radixrt::decode_team_steal; tests and
// benchmarks change them between steps only: a team reads them as it forms). `mode`: whether a
// member that has run its share takes other members' items, 1 always, 0 never. `slow_us`
// (tests only, 0 in use): the team's last member sleeps this long before each of its own items,
// so that the others take some. `taken`: items run by a member other than their owner, since
// the process started (monotonic).
struct TeamStealSettings {
  std::atomic<int64_t> mode{1};
  std::atomic<int64_t> slow_us{0};
  std::atomic<int64_t> taken{0};
};

inline TeamStealSettings& team_steal_settings() {
  static TeamStealSettings s;
  return s;
}

// One member's items of the current phase, for the others to take from (TeamMember::run_items):
// `word` packs (phase << 40 | front << 20 | back); the owner claims from the front, the others
// take from the back, so each item runs once. `done` counts the items others ran for the owner.
struct TeamShare {
  static constexpr int kBits = 20;
  static constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  static constexpr uint64_t kFront = uint64_t{1} << kBits;  // one front item
  // Items are numbered below this, so a front one past its back stays in its bits.
  static constexpr int64_t kMaxItems = int64_t{1} << (kBits - 1);

  alignas(64) std::atomic<uint64_t> word{0};
  TeamCounter done;

  static uint64_t pack(uint64_t phase, int64_t front, int64_t back) {
    return phase << (2 * kBits) | static_cast<uint64_t>(front) << kBits |
           static_cast<uint64_t>(back);
  }
  static uint64_t phase(uint64_t w) { return w >> (2 * kBits); }
  static int64_t front(uint64_t w) { return static_cast<int64_t>((w >> kBits) & kMask); }
  static int64_t back(uint64_t w) { return static_cast<int64_t>(w & kMask); }
};

// Member `id`'s equal share [lo, hi) of n rows in a team of `size`: the row split of every row
// op (norms, RoPE, kv_store, a matmul's activation quantization), which rows_stay relies on.
inline std::pair<int64_t, int64_t> team_rows(int64_t id, int64_t n, int64_t size) {
  return {id * n / size, (id + 1) * n / size};
}

// Shared state of one team (one decode step's region).
struct Team {
  static constexpr int64_t kSpinsBeforeYield = 20000;

  TeamCounter joined, claimed;  // forming the team (see the TeamMember constructor)
  TeamCounter arrive;  // barriers
  TeamCounter ball;  // the placement probe (TeamMember::probe_placement)
  static constexpr int64_t kMaxSharing = 8;  // members that may take each other's items
  TeamShare shares[kMaxSharing];  // member i's items (TeamMember::run_items)
  std::atomic<bool> failed{false};
  int64_t expected;  // parallel_for indices handed out
  int64_t arena_bytes;  // per half
  // (1 + expected) parts of 2 * arena_bytes (the shared halves, then each member's own), 64-byte
  // aligned, owned by the caller (team_arena, of arena_size)
  uint8_t* arena;

  Team(int64_t expected_, int64_t arena_bytes_, uint8_t* arena_)
      : expected(expected_), arena_bytes(arena_bytes_), arena(arena_) {}

  // Bytes of the arena of a team of `expected` threads with halves of `half` bytes.
  static int64_t arena_size(int64_t expected, int64_t half) { return (1 + expected) * 2 * half; }

  // Spins until `c` reaches `target` (yielding after a while), or raises once the team failed.
  void wait(const TeamCounter& c, int64_t target) const {
    for (int64_t spins = 0; c.v.load(std::memory_order_acquire) < target; ++spins) {
      TORCH_CHECK(!failed.load(std::memory_order_relaxed),
                  "decode team: another thread of the step failed");
      if (spins < kSpinsBeforeYield) {
        team_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }
};

// One thread's membership: its index, the team size, its barrier count and arena offset.
struct TeamMember {
  Team* team;
  int64_t id = 0, size = 1;
  int64_t barriers = 0;
  int64_t parity = 0, offset = 0, own_offset = 0;  // arena half, bump offsets in it
  // Set by the layer loop before a row-split op (for_rows) whose output rows the next op
  // reads on the same member only (rope_qk's K rows, stored by kv_store; an RMSNorm's rows,
  // quantized by the next matmul, whose team split takes the same rows): that op ends without
  // the team meeting. Every member sets it alike; cleared by the op.
  bool rows_stay = false;
  // Set by the layer loop before a row op (an RMSNorm) whose output only the next op reads and
  // that op takes every row on each member (a matmul with quantize_whole): the op runs every row
  // on each member into the member's own memory and ends without the team meeting. Every member
  // sets it alike; cleared by the op.
  bool whole_rows = false;
  // Set by the layer loop before a matmul: each member quantizes every row of the activations
  // into its own memory, so the team need not meet between the quantization and the tiles (a
  // member then reads no other member's quantized rows). Cleared by the matmul.
  bool quantize_whole = false;
  // Whether the layer loop runs each RMSNorm and the matmul's quantization after it whole on
  // every member (whole_rows, quantize_whole: one meeting fewer each) instead of splitting
  // their rows: set as the team forms, the same on every member.
  bool norms_whole = false;
  // Whether run_items lets members take each other's items, and the test delay before each of
  // this member's own items: set as the team forms (team_steal_settings), `steal` the same on
  // every member.
  bool steal = false;
  int64_t slow_us = 0;
  int64_t phases = 0;  // run_items calls so far (the same on every member: they call alike)
  int64_t taken = 0;  // of this member's items, those the others took, over every phase

  // Joins the team from a parallel_for body that got indices [b, e): the team is the set of
  // bodies that run (one thread may get several indices, e.g. when nested: then it is a
  // team of fewer members). Returns once every index has been handed out.
  TeamMember(Team& t, int64_t b, int64_t e) : team(&t) {
    id = t.joined.v.fetch_add(1, std::memory_order_acq_rel);
    t.claimed.v.fetch_add(e - b, std::memory_order_acq_rel);
    t.wait(t.claimed, t.expected);
    size = t.joined.v.load(std::memory_order_acquire);
  }

  // Where the team's first two members are (placement.h), measured as the team forms: the
  // first bounces a line with the second kProbeRounds times (~0.2 us near, ~1.5 us far) and
  // publishes the verdict, which every member returns: kFar where the mean round trip is over
  // kFarRoundTripNs (no shared cache), kFarApart where even the fastest round is over
  // kMicrobatchRoundTripNs (a mean over 4 rounds, the first crossing included, reads 210-620
  // ns on a Xeon whose fastest round is 170-230 ns), else kNear; kNear for a team of one.
  static constexpr int64_t kProbeRounds = 4;
  enum Placement : int64_t { kNear = 0, kFar = 1, kFarApart = 2 };
  Placement probe_placement() {
    if (size == 1) return kNear;
    TeamCounter& ball = team->ball;
    const int64_t verdict_at = 2 * kProbeRounds + 1;  // then + the verdict
    if (id == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      auto t = t0;
      double fastest = std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < kProbeRounds; ++i) {
        ball.v.store(2 * i + 1, std::memory_order_release);
        team->wait(ball, 2 * i + 2);
        const auto t1 = std::chrono::steady_clock::now();
        fastest = std::min(fastest, std::chrono::duration<double, std::nano>(t1 - t).count());
        t = t1;
      }
      const double mean =
          std::chrono::duration<double, std::nano>(t - t0).count() / kProbeRounds;
      const Placement p = fastest > kMicrobatchRoundTripNs ? kFarApart
                          : mean > kFarRoundTripNs         ? kFar
                                                           : kNear;
      ball.v.store(verdict_at + p, std::memory_order_release);
      return p;
    }
    if (id == 1) {
      for (int64_t i = 0; i < kProbeRounds; ++i) {
        team->wait(ball, 2 * i + 1);
        ball.v.store(2 * i + 2, std::memory_order_release);
      }
    }
    team->wait(ball, verdict_at);
    return static_cast<Placement>(ball.v.load(std::memory_order_acquire) - verdict_at);
  }

  // Every member has arrived (and everything written before is visible).
  void barrier() {
    ++barriers;
    if (size == 1) return;
    team->arrive.v.fetch_add(1, std::memory_order_acq_rel);
    timed_wait(team->arrive, barriers * size, true);
  }

  // team->wait, its time added to this member's entry of the current phase where waits are
  // timed (RADIXRT_TEAM_WAITS; `barrier`: counted as one of the phase's barriers too).
  void timed_wait(const TeamCounter& c, int64_t target, bool barrier) {
#if RADIXRT_TEAM_WAITS
    const auto t0 = std::chrono::steady_clock::now();
#endif
    team->wait(c, target);
#if RADIXRT_TEAM_WAITS
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - t0).count();
    const int64_t who = std::min<int64_t>(id, kWaitMembers - 1);
    team_waits.ns[who][team_phase].fetch_add(ns, std::memory_order_relaxed);
    if (barrier) team_waits.count[who][team_phase].fetch_add(1, std::memory_order_relaxed);
#else
    (void)barrier;
#endif
  }

  // Runs items [lo, hi) of a phase whose items every member may run (run(i) writes only item i's
  // outputs and reads only what its owner had made visible when it started its share), then,
  // with `steal`, the other members' last items, and returns once every item of [lo, hi) has
  // run (those another member took included). Every member calls it in the same order, each
  // with its own share. Without `steal`, the share alone: the team's static split.
  // A member that runs ahead (its share done first) takes work from one that was slowed (a
  // busy neighbour, a preempted thread, uneven rows), instead of waiting at the next meeting.
  // Item outputs being the same whoever runs the item, results do not change.
  template <typename F>
  void run_items(int64_t lo, int64_t hi, const F& run) {
    // counted on every member alike, whether it offers its items or not (a member whose items
    // do not fit a word runs them alone: its word keeps an earlier phase, so none is taken)
    const uint64_t phase = static_cast<uint64_t>(++phases);
    if (!steal || size < 2 || size > Team::kMaxSharing || hi >= TeamShare::kMaxItems) {
      for (int64_t i = lo; i < hi; ++i) run(i);
      return;
    }
    TeamShare& mine = team->shares[id];
    mine.word.store(TeamShare::pack(phase, lo, hi), std::memory_order_release);
    uint64_t w;
    for (;;) {  // own items, from the front
      w = mine.word.fetch_add(TeamShare::kFront, std::memory_order_acq_rel);
      if (TeamShare::front(w) >= TeamShare::back(w)) break;
      if (slow_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
      run(TeamShare::front(w));
    }
    const int64_t lost = hi - TeamShare::back(w);  // final: front passed back
    for (int64_t o = 1; o < size; ++o) {  // the others' items, from the back
      TeamShare& other = team->shares[(id + o) % size];
      uint64_t ow = other.word.load(std::memory_order_acquire);
      while (TeamShare::phase(ow) == phase && TeamShare::front(ow) < TeamShare::back(ow)) {
        if (other.word.compare_exchange_weak(ow, ow - 1, std::memory_order_acq_rel,
                                             std::memory_order_acquire)) {
          run(TeamShare::back(ow) - 1);
          other.done.v.fetch_add(1, std::memory_order_release);
          ow = other.word.load(std::memory_order_acquire);
        }
      }
    }
    if (lost > 0) {
      taken += lost;
      timed_wait(mine.done, taken, false);
    }
  }

  // This member's equal share [lo, hi) of n rows.
  std::pair<int64_t, int64_t> rows(int64_t n) const { return team_rows(id, n, size); }

  // The next layer: its op outputs go to the other half of the arena.
  void next_layer() {
    parity ^= 1;
    offset = own_offset = 0;
  }

  // An op's output of `sizes`: the next bytes of this layer's half of the arena, the same
  // memory on every member, or (`own`) of the member's own part (raises on every member when
  // the half is full).
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options, bool own = false) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const int64_t bytes = (numel * static_cast<int64_t>(options.dtype().itemsize()) + 63) &
                          ~int64_t{63};
    int64_t& off = own ? own_offset : offset;
    TORCH_CHECK(off + bytes <= team->arena_bytes, "decode team: arena of ",
                team->arena_bytes, " bytes too small");
    const int64_t part = own ? 1 + id : 0;
    uint8_t* p = team->arena + (2 * part + parity) * team->arena_bytes + off;
    off += bytes;
    return at::from_blob(p, sizes, options);
  }
};

// An arena of at least `bytes` (64-byte aligned) for the calling thread's teams, grown when
// too small and reused from step to step (a team's outputs are copied out before its region
// ends, so the next step may overwrite them).
inline uint8_t* team_arena(int64_t bytes) {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint8_t, Free> buf;
  thread_local int64_t capacity = 0;
  if (bytes > capacity) {
    const int64_t cap = (bytes + 4095) & ~int64_t{4095};
    buf.reset(static_cast<uint8_t*>(std::aligned_alloc(64, cap)));
    capacity = buf ? cap : 0;
    TORCH_CHECK(buf, "decode team: cannot allocate ", cap, " bytes");
  }
  return buf.get();
}

// The calling thread's team membership while it runs a team's layers, else null (set by
// TeamScope only).
inline thread_local TeamMember* tls_team_member = nullptr;

inline TeamMember* team_member() { return tls_team_member; }

// Sets the calling thread's membership for a scope.
struct TeamScope {
  explicit TeamScope(TeamMember& m) { tls_team_member = &m; }
  ~TeamScope() { tls_team_member = nullptr; }
  TeamScope(const TeamScope&) = delete;
  TeamScope& operator=(const TeamScope&) = delete;
};

// An op's output: the team's shared memory in a team (the member's own while `whole_rows`),
// else a new tensor.
inline at::Tensor team_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TeamMember* m = team_member();
  return m != nullptr ? m->empty(sizes, options, m->whole_rows) : at::empty(sizes, options);
}

}  // namespace radixrt_cpu
