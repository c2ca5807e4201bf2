// The layout names of the sweep target, parsed at compile time into the named-field layouts of the
// kernels (the grammar of docs/kernels.md), so that a layout's name and its fields cannot
// disagree. Internal to kernels/sweep/.
//
//   forward mma.sync: w<warps>r<rows per warp>_k<keys per block>_s<stages>, then in this order any
//     of _qreg (q_in_registers), _skip (skip_rescale, with shift indexing), _shift
//     (shift_indexing), _2cta (ctas_per_sm = 2), _pad (padded_tiles), _pipe (pipelined), _seq
//     (sequential_row_tiles), _lazy (lazy_rescale);
//   backward, one warp per 16 keys: w<warps>_k<16 warps>_dq<dQ columns a warp holds at once at
//     head_dim 128>, then _pad, _s<Q/dO stages> (when not 3) and _d<dim_parts> (when not 1);
//   backward, split: w8_k128_split_s<stages>, then _pad and _dq4 (quad_dq_atomics).
#pragma once

#include "attention_backward_kernel.cuh"
#include "attention_forward_kernel.cuh"

namespace membar::kernels::cuda::sweep {

template <typename Tile>
struct Parsed {
  Tile tile;
  bool ok = false;
};

namespace name_detail {

constexpr bool take(const char*& cursor, const char* literal) {
  const char* at = cursor;
  while (*literal != '\0') {
    if (*at != *literal) return false;
    ++at;
    ++literal;
  }
  cursor = at;
  return true;
}

constexpr bool take_number(const char*& cursor, int& value) {
  if (*cursor < '0' || *cursor > '9') return false;
  value = 0;
  while (*cursor >= '0' && *cursor <= '9') value = 10 * value + (*cursor++ - '0');
  return true;
}

}  // namespace name_detail

constexpr Parsed<detail::ForwardTile> forward_tile_from_name(const char* name) {
  using name_detail::take;
  using name_detail::take_number;
  Parsed<detail::ForwardTile> parsed;
  detail::ForwardTile& tile = parsed.tile;
  const char* cursor = name;
  int rows = 0;
  if (!take(cursor, "w") || !take_number(cursor, tile.warps) || !take(cursor, "r") || !take_number(cursor, rows) ||
      !take(cursor, "_k") || !take_number(cursor, tile.keys_per_block) || !take(cursor, "_s") ||
      !take_number(cursor, tile.stages) || rows % 16 != 0) {
    return parsed;
  }
  tile.row_tiles_per_warp = rows / 16;
  if (take(cursor, "_qreg")) tile.q_in_registers = true;
  if (take(cursor, "_skip")) tile.skip_rescale = tile.shift_indexing = true;
  if (take(cursor, "_shift")) tile.shift_indexing = true;
  if (take(cursor, "_2cta")) tile.ctas_per_sm = 2;
  if (take(cursor, "_pad")) tile.padded_tiles = true;
  if (take(cursor, "_pipe")) tile.pipelined = true;
  if (take(cursor, "_seq")) tile.sequential_row_tiles = true;
  if (take(cursor, "_lazy")) tile.lazy_rescale = true;
  parsed.ok = *cursor == '\0';
  return parsed;
}

constexpr bool same_tile(const detail::ForwardTile& a, const detail::ForwardTile& b) {
  return a.warps == b.warps && a.row_tiles_per_warp == b.row_tiles_per_warp && a.keys_per_block == b.keys_per_block &&
         a.stages == b.stages && a.ctas_per_sm == b.ctas_per_sm && a.q_in_registers == b.q_in_registers &&
         a.skip_rescale == b.skip_rescale && a.shift_indexing == b.shift_indexing &&
         a.padded_tiles == b.padded_tiles && a.pipelined == b.pipelined &&
         a.sequential_row_tiles == b.sequential_row_tiles && a.lazy_rescale == b.lazy_rescale;
}

constexpr Parsed<detail::BackwardKeysTile> backward_keys_tile_from_name(const char* name) {
  using name_detail::take;
  using name_detail::take_number;
  Parsed<detail::BackwardKeysTile> parsed;
  detail::BackwardKeysTile& tile = parsed.tile;
  const char* cursor = name;
  int keys = 0;
  int columns = 0;
  if (!take(cursor, "w") || !take_number(cursor, tile.warps) || !take(cursor, "_k") || !take_number(cursor, keys) ||
      !take(cursor, "_dq") || !take_number(cursor, columns) || keys != 16 * tile.warps || tile.warps < 4 ||
      columns == 0) {
    return parsed;
  }
  if (take(cursor, "_pad")) tile.padded_tiles = true;
  if (take(cursor, "_s") && !take_number(cursor, tile.stages)) return parsed;
  if (take(cursor, "_d") && !take_number(cursor, tile.dim_parts)) return parsed;
  // The dQ columns a warp holds at once, at head_dim 128: 128 / dim_parts / (warps / 4) / dq_pieces.
  const int warp_columns = tile.dim_parts >= 1 ? 128 / tile.dim_parts / (tile.warps / 4) : 0;
  if (warp_columns == 0 || warp_columns % columns != 0) return parsed;
  tile.dq_pieces = warp_columns / columns;
  parsed.ok = *cursor == '\0';
  return parsed;
}

constexpr Parsed<detail::BackwardSplitTile> backward_split_tile_from_name(const char* name) {
  using name_detail::take;
  using name_detail::take_number;
  Parsed<detail::BackwardSplitTile> parsed;
  detail::BackwardSplitTile& tile = parsed.tile;
  const char* cursor = name;
  if (!take(cursor, "w8_k128_split_s") || !take_number(cursor, tile.stages)) return parsed;
  if (take(cursor, "_pad")) tile.padded_tiles = true;
  if (take(cursor, "_dq4")) tile.quad_dq_atomics = true;
  parsed.ok = *cursor == '\0';
  return parsed;
}

}  // namespace membar::kernels::cuda::sweep
