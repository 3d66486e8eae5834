// The tile pipeline of the kernels whose weights come in groups of 32 along K, each group's sums scaled
// once (int4_tile_mm's Q4_0/Q4_1 and int8_tile_mm's Q8_0): a group's block of 16 columns is one B tile
// (row p: the K pair 2p, 2p + 1 of each column), its products with up to 16 rows of x one TDPBF16PS into a
// C tile, whose sums the caller scales into its rows' accumulators.
#pragma once

#include "amx_tiles.h"

#if defined(ZENSERVE_AMX)
namespace zenserve {

// Tiles: 0 and 1 two groups' weights (B), 2 and 3 their rows of x (A), 4 and 5 their sums (C), of `rows` rows.
inline void configure_group_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 6; ++t) config.set(t, t < 2 ? 16 : rows, 64);
  _tile_loadconfig(&config);
}

// `lines` cache lines into L2 from 8 KB past `p`: a call's weights stream from memory once, and the
// stream runs on into the next groups and column blocks. Past the weight's end: a prefetch never faults.
inline void prefetch_weight_lines(const uint8_t* p, int lines) {
  constexpr int64_t kAhead = 128 * 64;
  for (int line = 0; line < lines; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + line * 64), _MM_HINT_T1);
}

// One block of 16 columns over all of K's groups, the tiles configured (configure_group_tiles): two groups
// go to the tile unit at a time, and the pair before's sums are scaled while they run.
// - `weights(g, slot)` readies group g's B tile (16 rows of 32 bf16, 64-byte aligned) and returns it; `slot`
//   (0 or 1) is its place in the pair, for a buffer it may unpack into.
// - `scale(sums, g)` takes group g's sums, [16][16] float32 (row r of x at sums + 16 r).
// Always inlined, so that the callers' accumulators, which `scale` captures, stay in registers.
template <typename Weights, typename Scale>
__attribute__((always_inline)) inline void tile_group_pairs(const uint16_t* x, int64_t x_stride_bytes, int64_t groups,
                                                            Weights&& weights, Scale&& scale) {
  alignas(64) float sums[2][16 * 16];
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const uint16_t* first = weights(g, 0);
    const uint16_t* second = weights(g + 1, 1);
    if (g > 0) {
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
    }
    _tile_loadd(0, first, 64);
    _tile_loadd(2, x + g * 32, x_stride_bytes);
    _tile_zero(4);
    _tile_loadd(1, second, 64);
    _tile_loadd(3, x + (g + 1) * 32, x_stride_bytes);
    _tile_zero(5);
    _tile_dpbf16ps(4, 2, 0);
    _tile_dpbf16ps(5, 3, 1);
    if (g > 0) {
      scale(sums[0], g - 2);
      scale(sums[1], g - 1);
    }
  }
  if (g > 0) {
    _tile_stored(4, sums[0], 64);
    _tile_stored(5, sums[1], 64);
    scale(sums[0], g - 2);
    scale(sums[1], g - 1);
  }
  if (g < groups) {  // an odd group count's last
    _tile_loadd(0, weights(g, 0), 64);
    _tile_loadd(2, x + g * 32, x_stride_bytes);
    _tile_zero(4);
    _tile_dpbf16ps(4, 2, 0);
    _tile_stored(4, sums[0], 64);
    scale(sums[0], g);
  }
}

}  // namespace zenserve
#endif
