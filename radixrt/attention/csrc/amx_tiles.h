// Whether this process may use the AMX tile registers. Linux hands the AMX register state out only
// on request (arch_prctl ARCH_REQ_XCOMP_PERM, process-wide): `amx_usable()` asks once and says
// whether the tiles may be used; where they may not (no AMX, a hypervisor that does not enable
// it, an old kernel) callers take another path. Shared by the AMX attention (amx_attention.h)
// and the AMX linear (amx_linear.cpp).

#pragma once

#if defined(__x86_64__) && defined(__AMX_TILE__)
#define RADIXRT_AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace radixrt_cpu {

#ifdef RADIXRT_AMX_TILES
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}
#else
inline bool amx_usable() { return false; }
#endif

}  // namespace radixrt_cpu
