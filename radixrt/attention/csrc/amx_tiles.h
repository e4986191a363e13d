// Whether this process may use the AMX tile registers. Linux hands the AMX register state out only
// on request (arch_prctl ARCH_REQ_XCOMP_PERM, process-wide): `amx_usable()` asks once and says
// whether the tiles may be used; where they may not (no AMX, a hypervisor that does not enable
// it, an old kernel) callers take another path. `TileConfig`: the eight-tile 16 x 64-byte
// configuration both users load. Shared by the AMX attention (amx_attention.h) and the AMX linear
// (amx_linear.cpp).

#pragma once

#include <cstdint>

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

// A tile configuration (palette 1) of eight tiles, each 16 rows x 64 bytes, for _tile_loadconfig.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};
#else
inline bool amx_usable() { return false; }
#endif

}  // namespace radixrt_cpu
