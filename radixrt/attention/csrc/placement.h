// Where a 2-thread step's two threads run, as the round trip of a cache line between them tells
// it: "near" (they share a cache: one core's, or one cache complex's L3; ~50-70 ns seen here) or
// "far" (no shared cache: ~300-400 ns, every line one writes and the other reads crosses).
// kFarRoundTripNs is the threshold the decode team (team.h, TeamMember::probe_placement) and the
// benchmarks (bench/roofline.py, through radixrt::far_round_trip_ns, cpu_probe.cpp) both judge
// by; kMicrobatchRoundTripNs, the team's alone, picks its micro-batches.

#pragma once

#include <cstdint>

namespace radixrt_cpu {

inline constexpr double kFarRoundTripNs = 150;  // a round trip over this many ns is "far"

// A decode team whose first two threads are this far apart in every round of its probe (Zen 5's
// two CCDs: ~370 ns; a Xeon's two cores on one mesh: 170-230 ns, the fastest of the team's 4
// rounds) runs a step of kFarMicrobatchRows rows or more as two micro-batches, one per thread,
// instead of one pass: no meetings and no crossings, each thread reading every weight. Zen 5,
// int8 K/V, batch 8, in one process: micro-batches -0.21 +- 0.05 ms a step far, +0.62 +- 0.02
// near (bench/results/2026-11-25-s32-team-crossings.md); on the Xeon, near by this measure,
// 1.03-1.16x the team's step (bench/results/2026-12-01-s40-*).
inline constexpr double kMicrobatchRoundTripNs = 300;
inline constexpr int64_t kFarMicrobatchRows = 8;

}  // namespace radixrt_cpu
