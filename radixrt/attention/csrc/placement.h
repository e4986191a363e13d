// Where a 2-thread step's two threads run, as the round trip of a cache line between them tells
// it: "near" (they share a cache: one core's, or one cache complex's L3; ~50-70 ns seen here) or
// "far" (no shared cache: ~300-400 ns, every line one writes and the other reads crosses). The
// one threshold the decode team (team.h, TeamMember::probe_far) and the benchmarks
// (bench/roofline.py, through radixrt::far_round_trip_ns, cpu_probe.cpp) both judge by.

#pragma once

namespace radixrt_cpu {

inline constexpr double kFarRoundTripNs = 150;  // a round trip over this many ns is "far"

}  // namespace radixrt_cpu
