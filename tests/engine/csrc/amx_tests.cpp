// amx_configure against the configuration the tiles then hold (sttilecfg), compiled as the amx
// table is (its flags, -O3) and inlined here. It once went through GCC 12's _tile_loadconfig,
// which tells the optimizer that ldtilecfg reads one pointer's 8 bytes: inlined into a benchmark's
// main, -O3 dropped the stores of the column widths as dead and ldtilecfg faulted. These tests did
// not make GCC drop them (the drop depends on the inlining context); they pin the layout each
// shape gives the tiles.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernel_table.hpp"
#include "kernels/amx.hpp"

using namespace cpuserve;

namespace {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The configuration the tiles hold now (sttilecfg, its whole 64 bytes as the asm's output).
TileConfig stored_config() {
  TileConfig c;
  __asm__ volatile("sttilecfg %0" : "=m"(c));
  return c;
}

bool have_amx() { return table_by_name("amx") != nullptr; }  // (asks the kernel for the tile state)

TEST(AmxConfigure, ShapesEveryTileAsAsked) {
  if (!have_amx()) GTEST_SKIP() << "this CPU has no AMX, or the kernel refused its tile state";
  amx_configure(16, 5);
  const TileConfig c = stored_config();
  _tile_release();
  EXPECT_EQ(c.palette, 1);
  const int rows[8] = {16, 16, 5, 5, 16, 5, 16, 16};  // C 0-1, C 2-3, A 4, A 5, B 6-7
  for (int t = 0; t < 8; ++t) {
    EXPECT_EQ(c.rows[t], rows[t]) << "tile " << t;
    EXPECT_EQ(c.colsb[t], 64) << "tile " << t;
  }
}

TEST(AmxConfigure, LeavesUnusedTilesEmpty) {
  if (!have_amx()) GTEST_SKIP() << "this CPU has no AMX, or the kernel refused its tile state";
  amx_configure(7, 0);
  const TileConfig c = stored_config();
  _tile_release();
  for (int t : {2, 3, 5}) {
    EXPECT_EQ(c.rows[t], 0) << "tile " << t;
    EXPECT_EQ(c.colsb[t], 0) << "tile " << t;
  }
  for (int t : {0, 1, 4}) EXPECT_EQ(c.rows[t], 7) << "tile " << t;
}

}  // namespace
