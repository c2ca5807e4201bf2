// CPU reference kernels of paged attention (the contract is in membar/kernels/attention.h).
//
// Note [CPU paged attention]
// Rationale: the trainer runs these on CPU machines and in CI, so they must be exact enough to
// serve as the reference for the CUDA kernels and fast enough for real chunks.
// Approach: every pass works on blocks. A query block is up to kQueryRowsTarget rows, where a row
// is one (query token, q head) pair of one GQA group: the group's q heads share their keys, so
// each key block is converted and loaded once for all of them. A key block is up to
// kMaxKeyBlock rows of one kv head: part of a history page, or consecutive chunk keys.
// Keys and values stay row-major as they come from the pools ([n][D], a plain widening copy);
// queries are transposed once per query block ([D][rows]); scores, probabilities and their
// gradients are kept transposed ([n][rows]), which lets every product below be one of the two
// matmul forms in attention_cpu_math.h without transposing anything inside the key loop.
//   Forward: one task per (kv head, query block); online softmax over key blocks (FlashAttention
//   style): scores, running max, rescaled running sum and output; then out = acc / sum and
//   lse = max + log(sum).
//   Backward (FlashAttention-2 recomputation, D_i = rowsum(dO_i * O_i)). Pass 1, one task per
//   (kv head, key block): loops over every query block that sees the block, recomputes
//   P = exp(S - lse) and dS, accumulates dV += P^T dO and dK += dS^T Q in local buffers, then
//   writes the chunk's dK/dV or ADDS the history's into the grad pages once. dQ needs the sum
//   over key blocks, which different tasks own; two ways to get it:
//     deterministic (params.deterministic, or when the copies below would not fit in memory):
//     pass 2, one task per (kv head, query block), recomputes P and dS over the key blocks the
//     block sees and accumulates dQ += dS K locally, then writes dq. Every output element is
//     summed by one task in one fixed order, whatever the thread count: the same bits on every
//     run. Cost: 7 block products per (query, key) block pair instead of 5;
//     otherwise: pass 1 also accumulates dQ += dS K into a per-worker copy of dq (compute type), and the
//     copies are summed at the end. 5 block products, but dq's rounding depends on which worker
//     ran which block (with one worker it is deterministic too).
// A sliding window (Note [Sliding window] in attention.h) skips the key blocks no row of a query
// block can see (in both passes: a key-block task visits only the query blocks that see it) and
// masks the scores of the blocks that straddle the window's edge, after the soft-cap.
// Limitations: compute is fp32 for fp32/bf16/fp16 inputs and fp64 for fp64 inputs; P is never
// rounded to 16 bits (the CPU results are slightly more exact than the GPU kernels').
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "attention_cpu_math.h"
#include "membar/kernels/attention.h"
#include "membar/kernels/half_types.h"

namespace membar::kernels::cpu {
namespace {

using detail::exp_subtract_columns;
using detail::from_compute;
using detail::matmul;
using detail::matmul_transposed_a;
using detail::parallel_for;
using detail::parallel_for_workers;
using detail::planned_workers;
using detail::to_compute;
using detail::workers_for_work;

// Rows (query token x q head of the group) per query block; the block's scores and
// accumulators stay in L2.
constexpr int kQueryRowsTarget = 64;
// Key rows per key block (history pages longer than this are split).
constexpr int kMaxKeyBlock = 128;
// Chunk keys per key block.
constexpr int kChunkKeyBlock = 64;
// The most memory the non-deterministic backward spends on per-worker copies of dq.
constexpr double kMaxDqPartialBytes = 256.0 * 1024 * 1024;

// One key block: `rows` keys of one kv head. Row r's key is k[r * row_stride .. + head_dim].
// For chunk keys, first_chunk_key is the chunk position of row 0 and the causal mask applies;
// for history keys it is -1 and every query sees every row (but for a sliding window).
// first_position is the position of row 0 (Note [Sliding window] in attention.h): history row t
// is at t, chunk key j at history_tokens + j.
template <typename Element>
struct KeyBlock {
  const Element* k = nullptr;
  const Element* v = nullptr;
  int rows = 0;
  int32_t first_chunk_key = -1;
  int32_t first_position = 0;
};

// A block of queries of one GQA group: tokens [query_begin, query_end), all q heads of kv head
// `kv_head`. Row r is token query_begin + r / group, q head kv_head * group + r % group.
struct QueryBlock {
  int32_t kv_head = 0;
  int32_t query_begin = 0;
  int32_t query_end = 0;
  int32_t tile = 0;  // the sparse selection's query tile holding the block (0 when dense)
};

// Everything a pass needs to know about the problem, with typed pointers.
template <typename Element>
struct Problem {
  PagedAttentionShape shape;
  int32_t group = 1;          // q heads per kv head
  int64_t kv_row_stride = 0;  // elements between consecutive key rows: num_kv_heads * head_dim
  int64_t q_row_stride = 0;   // elements between consecutive query tokens: num_q_heads * head_dim
  int32_t num_pages = 0;
  const Element* q = nullptr;
  const Element* k_chunk = nullptr;
  const Element* v_chunk = nullptr;
  const Element* k_pool = nullptr;
  const Element* v_pool = nullptr;
  const int32_t* k_page_index = nullptr;
  const int32_t* v_page_index = nullptr;
  PageSelection selection;
  int32_t tile_tokens = 0;  // query_tile_tokens when sparse, else chunk_tokens

  Problem(const PagedAttentionShape& s, const void* q_, const void* k_chunk_, const void* v_chunk_,
          const HistoryPages& history, const PageSelection& selection_)
      : shape(s),
        group(s.num_q_heads / s.num_kv_heads),
        kv_row_stride(int64_t(s.num_kv_heads) * s.head_dim),
        q_row_stride(int64_t(s.num_q_heads) * s.head_dim),
        num_pages(s.num_history_pages()),
        q(static_cast<const Element*>(q_)),
        k_chunk(static_cast<const Element*>(k_chunk_)),
        v_chunk(static_cast<const Element*>(v_chunk_)),
        k_pool(static_cast<const Element*>(history.k_pool)),
        v_pool(static_cast<const Element*>(history.v_pool)),
        k_page_index(history.k_page_index),
        v_page_index(history.v_page_index),
        selection(selection_),
        tile_tokens(selection_.enabled() ? selection_.query_tile_tokens : s.chunk_tokens) {}

  int32_t valid_rows_of_page(int32_t page) const {
    return std::min(shape.page_tokens, shape.history_tokens - page * shape.page_tokens);
  }

  // Key block `part` (kMaxKeyBlock rows each) of history page `page`, kv head `kv_head`.
  KeyBlock<Element> history_block(int32_t page, int32_t part, int32_t kv_head) const {
    const int32_t first_row = part * kMaxKeyBlock;
    KeyBlock<Element> block;
    block.rows = std::min(kMaxKeyBlock, valid_rows_of_page(page) - first_row);
    block.first_position = page * shape.page_tokens + first_row;
    const int64_t row_offset = int64_t(first_row) * kv_row_stride + int64_t(kv_head) * shape.head_dim;
    const int64_t page_elements = int64_t(shape.page_tokens) * kv_row_stride;
    block.k = k_pool + int64_t(k_page_index[page]) * page_elements + row_offset;
    block.v = v_pool + int64_t(v_page_index[page]) * page_elements + row_offset;
    return block;
  }

  int32_t parts_of_page(int32_t page) const { return (valid_rows_of_page(page) + kMaxKeyBlock - 1) / kMaxKeyBlock; }

  KeyBlock<Element> chunk_block(int32_t first_key, int32_t kv_head) const {
    KeyBlock<Element> block;
    block.rows = std::min(kChunkKeyBlock, shape.chunk_tokens - first_key);
    block.first_chunk_key = first_key;
    block.first_position = shape.history_tokens + first_key;
    const int64_t offset = int64_t(first_key) * kv_row_stride + int64_t(kv_head) * shape.head_dim;
    block.k = k_chunk + offset;
    block.v = v_chunk + offset;
    return block;
  }

  // With a sliding window: whether some query of tokens [query_begin, query_end) sees a key at
  // positions [first_position, first_position + rows) (the causal side is the callers' business).
  bool window_reaches(int32_t query_begin, int32_t first_position, int rows) const {
    if (shape.sliding_window <= 0) return true;
    // The first query sees the most keys of the past: positions > its position - W.
    return int64_t(first_position) + rows - 1 > int64_t(shape.history_tokens) + query_begin - shape.sliding_window;
  }

  // With a sliding window: the end of the chunk tokens whose queries can see a key at position
  // `last_position` (queries at positions <= last_position + W - 1); chunk_tokens without one.
  int32_t window_query_end(int32_t last_position) const {
    if (shape.sliding_window <= 0) return shape.chunk_tokens;
    const int64_t end = int64_t(last_position) + shape.sliding_window - shape.history_tokens;
    return int32_t(std::clamp<int64_t>(end, 0, shape.chunk_tokens));
  }

  // Calls visit(block) for every key block the queries of `query` see, in a fixed order: the
  // history pages (all of them ascending, or the tile's selection in slot order), then (with
  // attend_chunk) the chunk keys ascending up to the block's last query. A sliding window skips
  // the blocks that lie wholly before every query's window.
  template <typename Visit>
  void for_each_key_block(const QueryBlock& query, Visit&& visit) const {
    if (shape.sliding_window > 0) {  // dense only (page_selection_check)
      for (int32_t page = 0; page < num_pages; ++page) {
        for (int32_t part = 0; part < parts_of_page(page); ++part) {
          const KeyBlock<Element> block = history_block(page, part, query.kv_head);
          if (window_reaches(query.query_begin, block.first_position, block.rows)) visit(block);
        }
      }
      for (int32_t first_key = 0; first_key < query.query_end; first_key += kChunkKeyBlock) {
        const KeyBlock<Element> block = chunk_block(first_key, query.kv_head);
        if (window_reaches(query.query_begin, block.first_position, block.rows)) visit(block);
      }
      return;
    }
    if (selection.enabled()) {
      const int32_t* row = selection.selected_pages + int64_t(query.tile) * selection.selected_per_tile;
      for (int32_t slot = 0; slot < selection.selected_per_tile; ++slot) {
        if (row[slot] < 0) continue;
        for (int32_t part = 0; part < parts_of_page(row[slot]); ++part) visit(history_block(row[slot], part, query.kv_head));
      }
    } else {
      for (int32_t page = 0; page < num_pages; ++page) {
        for (int32_t part = 0; part < parts_of_page(page); ++part) visit(history_block(page, part, query.kv_head));
      }
    }
    if (!shape.attend_chunk) return;
    for (int32_t first_key = 0; first_key < query.query_end; first_key += kChunkKeyBlock) {
      visit(chunk_block(first_key, query.kv_head));
    }
  }

  int32_t query_tokens_per_block() const { return std::max(1, kQueryRowsTarget / group); }

  // Floating-point operations of the forward (dense; an upper bound when sparse): two products
  // of 2 * D per visible (query, key) pair and q head.
  double forward_flops() const {
    const double pairs = double(shape.chunk_tokens) * (double(shape.history_tokens) + (shape.chunk_tokens + 1) / 2.0);
    return 4.0 * pairs * shape.num_q_heads * shape.head_dim;
  }

  // Splits tokens [begin, end) of tile `tile` into query blocks, for every kv head.
  void append_query_blocks(int32_t begin, int32_t end, int32_t tile, int32_t kv_head,
                           std::vector<QueryBlock>& blocks) const {
    const int32_t step = query_tokens_per_block();
    for (int32_t token = begin; token < end; token += step) {
      blocks.push_back(QueryBlock{kv_head, token, std::min(end, token + step), tile});
    }
  }

  // Query blocks of the whole chunk: each lies inside one query tile.
  std::vector<QueryBlock> all_query_blocks() const {
    std::vector<QueryBlock> blocks;
    const int32_t num_tiles = num_query_tiles(shape.chunk_tokens, tile_tokens);
    for (int32_t kv_head = 0; kv_head < shape.num_kv_heads; ++kv_head) {
      for (int32_t tile = 0; tile < num_tiles; ++tile) {
        append_query_blocks(tile * tile_tokens, std::min(shape.chunk_tokens, (tile + 1) * tile_tokens), tile,
                            kv_head, blocks);
      }
    }
    return blocks;
  }

  // Pointer to query token `token`, q head `head` of a [Tc, Hq, D] tensor.
  template <typename Pointer>
  Pointer* row_of(Pointer* base, int32_t token, int32_t head) const {
    return base + int64_t(token) * q_row_stride + int64_t(head) * shape.head_dim;
  }
};

// Loads `rows` key (or value) rows of one kv head (source rows `source_stride` apart) into a
// dense [rows][head_dim] compute-type matrix.
template <typename Element, typename Compute>
void load_key_rows(const Element* source, int64_t source_stride, int rows, int32_t head_dim, Compute* destination) {
  for (int r = 0; r < rows; ++r) detail::widen(source + r * source_stride, destination + int64_t(r) * head_dim, head_dim);
}

// Loads the rows of a query block from a [Tc, Hq, D] tensor: into `rows_out` as [rows][D]
// and/or into `transposed_out` as [D][rows], multiplied by `scale`.
template <typename Element, typename Compute>
void load_query_block(const Problem<Element>& problem, const Element* base, const QueryBlock& block, Compute scale,
                      Compute* rows_out, Compute* transposed_out, Compute* scratch) {
  const int32_t head_dim = problem.shape.head_dim;
  const int rows = (block.query_end - block.query_begin) * problem.group;
  // The group's q heads of one token are adjacent in memory: one token is `group` rows.
  Compute* dense = rows_out ? rows_out : scratch;
  for (int32_t token = block.query_begin; token < block.query_end; ++token) {
    detail::widen(problem.row_of(base, token, block.kv_head * problem.group),
                  dense + int64_t(token - block.query_begin) * problem.group * head_dim, int64_t(problem.group) * head_dim);
  }
  if (scale != Compute(1)) {
    for (int64_t i = 0; i < int64_t(rows) * head_dim; ++i) dense[i] *= scale;
  }
  if (transposed_out) {
    for (int r = 0; r < rows; ++r) {
      for (int32_t d = 0; d < head_dim; ++d) transposed_out[int64_t(d) * rows + r] = dense[int64_t(r) * head_dim + d];
    }
  }
}

// Gathers per-row values of a [Hq, Tc] array (lse, delta) for a query block.
template <typename Element, typename Value, typename Compute>
void load_row_values(const Problem<Element>& problem, const Value* base, const QueryBlock& block, Compute* destination) {
  int r = 0;
  for (int32_t token = block.query_begin; token < block.query_end; ++token) {
    for (int32_t head = 0; head < problem.group; ++head, ++r) {
      const int32_t q_head = block.kv_head * problem.group + head;
      destination[r] = Compute(base[int64_t(q_head) * problem.shape.chunk_tokens + token]);
    }
  }
}

// Scores are kept transposed, [key][query row]. Sets scores[c][r] to -inf where chunk key
// first_chunk_key + c lies after row r's token (rows are token-major, `group` rows per token).
template <typename Compute>
void apply_causal_mask(Compute* scores_transposed, int keys, int rows, int group, int32_t query_begin,
                       int32_t first_chunk_key) {
  if (first_chunk_key < 0) return;
  for (int c = 0; c < keys; ++c) {
    // Rows of tokens before key c cannot see it.
    const int64_t hidden_rows = std::clamp<int64_t>(int64_t(first_chunk_key + c - query_begin) * group, 0, rows);
    Compute* row = scores_transposed + int64_t(c) * rows;
    for (int64_t r = 0; r < hidden_rows; ++r) row[r] = -std::numeric_limits<Compute>::infinity();
  }
}

// Note [Sliding window] in attention.h: sets scores[c][r] to -inf where key c (at position
// first_position + c) lies at or before row r's position minus `window` (row r is token
// query_begin + r / group, at position history_tokens + that). Applies only to keys some row of
// the block cannot see.
template <typename Compute>
void apply_window_mask(Compute* scores_transposed, int keys, int rows, int group, int32_t query_begin,
                       int32_t history_tokens, int32_t first_position, int32_t window) {
  if (window <= 0) return;
  for (int c = 0; c < keys; ++c) {
    // Tokens t with history_tokens + t >= position + window cannot see key c: rows from the first such token on.
    const int64_t first_hidden_token = int64_t(first_position) + c + window - history_tokens;
    const int64_t first_hidden_row = std::clamp<int64_t>((first_hidden_token - query_begin) * group, 0, rows);
    Compute* row = scores_transposed + int64_t(c) * rows;
    for (int64_t r = first_hidden_row; r < rows; ++r) row[r] = -std::numeric_limits<Compute>::infinity();
  }
}

// Note [Soft-capped scores] in attention.h: every scaled score s of a [n][rows] block becomes
// cap * tanh(s / cap); with `slopes` its derivative 1 - tanh^2 is kept there for the backward.
template <typename Compute>
void apply_softcap(Compute* scores, int keys, int rows, Compute cap, Compute* slopes) {
  const int64_t count = int64_t(keys) * rows;
  for (int64_t i = 0; i < count; ++i) {
    const Compute t = std::tanh(scores[i] / cap);
    scores[i] = cap * t;
    if (slopes != nullptr) slopes[i] = Compute(1) - t * t;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <typename Element, typename Compute>
void forward_query_block(const Problem<Element>& problem, const QueryBlock& block, Element* out, Compute* lse) {
  const int32_t head_dim = problem.shape.head_dim;
  const int rows = (block.query_end - block.query_begin) * problem.group;
  constexpr Compute kMinusInfinity = -std::numeric_limits<Compute>::infinity();
  // [D][rows] queries (pre-scaled), [rows][D] output accumulator, [n][D] keys and values,
  // [n][rows] scores then probabilities; per-row running max, running sum and rescale factor.
  std::vector<Compute> queries_transposed(size_t(rows) * head_dim), scratch(size_t(rows) * head_dim);
  std::vector<Compute> accumulator(size_t(rows) * head_dim, Compute(0));
  std::vector<Compute> keys(size_t(kMaxKeyBlock) * head_dim), values(size_t(kMaxKeyBlock) * head_dim);
  std::vector<Compute> scores(size_t(kMaxKeyBlock) * rows);
  std::vector<Compute> running_max(rows, kMinusInfinity), running_sum(rows, Compute(0));
  std::vector<Compute> block_max(rows), subtract(rows), correction(rows);

  load_query_block(problem, problem.q, block, Compute(problem.shape.softmax_scale), static_cast<Compute*>(nullptr),
                   queries_transposed.data(), scratch.data());

  problem.for_each_key_block(block, [&](const KeyBlock<Element>& key_block) {
    const int n = key_block.rows;
    load_key_rows(key_block.k, problem.kv_row_stride, n, head_dim, keys.data());
    load_key_rows(key_block.v, problem.kv_row_stride, n, head_dim, values.data());
    // scores^T [n][rows] = K [n][D] x (scale Q)^T [D][rows]
    matmul(n, rows, head_dim, keys.data(), head_dim, queries_transposed.data(), rows, scores.data(), rows, false);
    if (problem.shape.logit_softcap > 0.f) {
      apply_softcap(scores.data(), n, rows, Compute(problem.shape.logit_softcap), static_cast<Compute*>(nullptr));
    }
    apply_causal_mask(scores.data(), n, rows, problem.group, block.query_begin, key_block.first_chunk_key);
    apply_window_mask(scores.data(), n, rows, problem.group, block.query_begin, problem.shape.history_tokens,
                      key_block.first_position, problem.shape.sliding_window);
    std::copy(running_max.begin(), running_max.end(), block_max.begin());
    for (int c = 0; c < n; ++c) {
      const Compute* score_row = scores.data() + int64_t(c) * rows;
      for (int r = 0; r < rows; ++r) block_max[size_t(r)] = std::max(block_max[size_t(r)], score_row[r]);
    }
    bool rescale = false;
    for (int r = 0; r < rows; ++r) {
      // A row that has seen no visible key yet keeps max -inf; subtracting 0 keeps its
      // probabilities exactly 0 and its (empty) accumulator untouched.
      const Compute new_max = block_max[size_t(r)];
      subtract[size_t(r)] = new_max == kMinusInfinity ? Compute(0) : new_max;
      correction[size_t(r)] = new_max == kMinusInfinity ? Compute(1) : std::exp(running_max[size_t(r)] - new_max);
      running_max[size_t(r)] = new_max;
      running_sum[size_t(r)] *= correction[size_t(r)];
      rescale = rescale || correction[size_t(r)] != Compute(1);
    }
    if (rescale) {
      for (int r = 0; r < rows; ++r) {
        if (correction[size_t(r)] == Compute(1)) continue;
        Compute* out_row = accumulator.data() + int64_t(r) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) out_row[d] *= correction[size_t(r)];
      }
    }
    exp_subtract_columns(scores.data(), n, rows, subtract.data(), running_sum.data());
    // out [rows][D] += P [rows][n] x V [n][D], with P given transposed.
    matmul_transposed_a(rows, head_dim, n, scores.data(), rows, values.data(), head_dim, accumulator.data(), head_dim,
                        true);
  });

  int r = 0;
  for (int32_t token = block.query_begin; token < block.query_end; ++token) {
    for (int32_t head = 0; head < problem.group; ++head, ++r) {
      const int32_t q_head = block.kv_head * problem.group + head;
      // A row that saw no key (Note [Blocked history] in attention.h) gets out = 0, lse = -inf.
      const bool saw_keys = running_sum[size_t(r)] > Compute(0);
      const Compute inverse_sum = saw_keys ? Compute(1) / running_sum[size_t(r)] : Compute(0);
      const Compute* from = accumulator.data() + int64_t(r) * head_dim;
      Element* to = problem.row_of(out, token, q_head);
      for (int32_t d = 0; d < head_dim; ++d) to[d] = from_compute<Element>(from[d] * inverse_sum);
      lse[int64_t(q_head) * problem.shape.chunk_tokens + token] =
          saw_keys ? running_max[size_t(r)] + std::log(running_sum[size_t(r)]) : kMinusInfinity;
    }
  }
}

template <typename Element, typename Compute>
int forward_typed(const PagedAttentionForwardParams& params, int64_t thread_limit) {
  const Problem<Element> problem(params.shape, params.q, params.k_chunk, params.v_chunk, params.history,
                                 params.selection);
  const std::vector<QueryBlock> blocks = problem.all_query_blocks();
  Element* out = static_cast<Element*>(params.out);
  Compute* lse = static_cast<Compute*>(params.lse);
  const bool ok = parallel_for(int64_t(blocks.size()), [&](int64_t index) {
    forward_query_block<Element, Compute>(problem, blocks[size_t(index)], out, lse);
  }, std::min(workers_for_work(problem.forward_flops()), thread_limit));
  return ok ? 0 : kCpuOutOfMemory;
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Per-task work buffers of the backward passes. Query-side blocks are [rows][D] or transposed
// [D][rows]; key-side blocks [n][D]; score-shaped blocks transposed, [n][rows].
template <typename Compute>
struct BackwardBuffers {
  std::vector<Compute> queries, queries_transposed, output_grads, output_grads_transposed, scratch;
  std::vector<Compute> row_lse, row_delta;
  std::vector<Compute> keys, values;
  std::vector<Compute> probabilities, score_grads;
  std::vector<Compute> softcap_slopes;  // [n][rows] 1 - tanh^2 of soft-capped scores (empty without a cap)

  BackwardBuffers(int max_rows, int head_dim, bool softcap)
      : queries(size_t(max_rows) * head_dim),
        queries_transposed(size_t(max_rows) * head_dim),
        output_grads(size_t(max_rows) * head_dim),
        output_grads_transposed(size_t(max_rows) * head_dim),
        scratch(size_t(max_rows) * head_dim),
        row_lse(max_rows),
        row_delta(max_rows),
        keys(size_t(kMaxKeyBlock) * head_dim),
        values(size_t(kMaxKeyBlock) * head_dim),
        probabilities(size_t(max_rows) * kMaxKeyBlock),
        score_grads(size_t(max_rows) * kMaxKeyBlock),
        softcap_slopes(softcap ? size_t(max_rows) * kMaxKeyBlock : size_t(0)) {}
};

// Loads a query block for the backward: scale * Q^T and dO^T always; Q and dO row-major
// when with_rows (pass 1 needs them for dK and dV).
template <typename Element, typename Compute>
void load_backward_query_block(const Problem<Element>& problem, const QueryBlock& block, const Element* dout,
                               const Compute* lse, const Compute* delta, bool with_rows,
                               BackwardBuffers<Compute>& buffers) {
  const Compute scale = Compute(problem.shape.softmax_scale);
  const int32_t head_dim = problem.shape.head_dim;
  const int rows = (block.query_end - block.query_begin) * problem.group;
  if (with_rows) {
    load_query_block(problem, problem.q, block, Compute(1), buffers.queries.data(), static_cast<Compute*>(nullptr),
                     buffers.scratch.data());
    for (int r = 0; r < rows; ++r) {
      for (int32_t d = 0; d < head_dim; ++d) {
        buffers.queries_transposed[int64_t(d) * rows + r] = scale * buffers.queries[int64_t(r) * head_dim + d];
      }
    }
    load_query_block(problem, dout, block, Compute(1), buffers.output_grads.data(), buffers.output_grads_transposed.data(),
                     buffers.scratch.data());
  } else {
    load_query_block(problem, problem.q, block, scale, static_cast<Compute*>(nullptr), buffers.queries_transposed.data(),
                     buffers.scratch.data());
    load_query_block(problem, dout, block, Compute(1), static_cast<Compute*>(nullptr),
                     buffers.output_grads_transposed.data(), buffers.scratch.data());
  }
  load_row_values(problem, lse, block, buffers.row_lse.data());
  // lse = -inf marks a row that sees no key at all: +inf makes its P exactly 0.
  for (int r = 0; r < rows; ++r) {
    if (buffers.row_lse[size_t(r)] == -std::numeric_limits<Compute>::infinity()) {
      buffers.row_lse[size_t(r)] = std::numeric_limits<Compute>::infinity();
    }
  }
  load_row_values(problem, delta, block, buffers.row_delta.data());
}

// For the query block and key block loaded in `buffers`, recomputes (transposed, [n][rows])
// P^T = exp(scale K Q^T - lse) and dS^T = scale * P^T * (V dO^T - delta) (with a soft-cap: the capped scores, and
// dS^T times the cap's slope 1 - tanh^2).
template <typename Element, typename Compute>
void recompute_probabilities_and_score_grads(const Problem<Element>& problem, const QueryBlock& block, int rows,
                                             const KeyBlock<Element>& key_block, BackwardBuffers<Compute>& buffers) {
  const int n = key_block.rows;
  const int32_t head_dim = problem.shape.head_dim;
  const Compute scale = Compute(problem.shape.softmax_scale);
  Compute* probabilities = buffers.probabilities.data();
  Compute* score_grads = buffers.score_grads.data();
  matmul(n, rows, head_dim, buffers.keys.data(), head_dim, buffers.queries_transposed.data(), rows, probabilities, rows,
         false);
  const bool softcap = problem.shape.logit_softcap > 0.f;
  if (softcap) {
    apply_softcap(probabilities, n, rows, Compute(problem.shape.logit_softcap), buffers.softcap_slopes.data());
  }
  apply_causal_mask(probabilities, n, rows, problem.group, block.query_begin, key_block.first_chunk_key);
  apply_window_mask(probabilities, n, rows, problem.group, block.query_begin, problem.shape.history_tokens,
                    key_block.first_position, problem.shape.sliding_window);
  exp_subtract_columns(probabilities, n, rows, buffers.row_lse.data(), static_cast<Compute*>(nullptr));
  matmul(n, rows, head_dim, buffers.values.data(), head_dim, buffers.output_grads_transposed.data(), rows, score_grads,
         rows, false);
  const Compute* delta = buffers.row_delta.data();
  for (int c = 0; c < n; ++c) {
    Compute* grad_row = score_grads + int64_t(c) * rows;
    const Compute* probability_row = probabilities + int64_t(c) * rows;
    for (int r = 0; r < rows; ++r) grad_row[r] = scale * probability_row[r] * (grad_row[r] - delta[r]);
    if (softcap) {
      const Compute* slope_row = buffers.softcap_slopes.data() + int64_t(c) * rows;
      for (int r = 0; r < rows; ++r) grad_row[r] *= slope_row[r];
    }
  }
}

template <typename Element, typename Compute>
void load_backward_key_block(const Problem<Element>& problem, const KeyBlock<Element>& key_block,
                             BackwardBuffers<Compute>& buffers) {
  load_key_rows(key_block.k, problem.kv_row_stride, key_block.rows, problem.shape.head_dim, buffers.keys.data());
  load_key_rows(key_block.v, problem.kv_row_stride, key_block.rows, problem.shape.head_dim, buffers.values.data());
}

// Adds a [rows][head_dim] block of key gradients into grad page rows (row stride kv_row_stride).
template <typename Compute>
void add_into_grad_page(const Compute* gradient, int rows, int32_t head_dim, int64_t row_stride, void* page_rows,
                        DType grad_page_dtype) {
  for (int r = 0; r < rows; ++r) {
    const Compute* from = gradient + int64_t(r) * head_dim;
    const int64_t offset = r * row_stride;
    switch (grad_page_dtype) {
      case DType::kFloat32: {
        float* to = static_cast<float*>(page_rows) + offset;
        for (int32_t d = 0; d < head_dim; ++d) to[d] = float(Compute(to[d]) + from[d]);
        break;
      }
      case DType::kFloat64: {
        double* to = static_cast<double*>(page_rows) + offset;
        for (int32_t d = 0; d < head_dim; ++d) to[d] = double(to[d]) + double(from[d]);
        break;
      }
      case DType::kBFloat16: {
        BFloat16* to = static_cast<BFloat16*>(page_rows) + offset;
        for (int32_t d = 0; d < head_dim; ++d) {
          to[d] = float_to_bfloat16(float(Compute(bfloat16_to_float(to[d])) + from[d]));
        }
        break;
      }
      case DType::kFloat16: {
        Float16* to = static_cast<Float16*>(page_rows) + offset;
        for (int32_t d = 0; d < head_dim; ++d) {
          to[d] = float_to_float16(float(Compute(float16_to_float(to[d])) + from[d]));
        }
        break;
      }
    }
  }
}

// A key block owned by one task of backward pass 1: either part `part` of history page `page`
// (chunk_first_key < 0) or the chunk keys from chunk_first_key.
struct OwnedKeyBlock {
  int32_t kv_head = 0;
  int32_t page = -1;
  int32_t part = 0;
  int32_t chunk_first_key = -1;
};

template <typename Element, typename Compute>
int backward_typed(const PagedAttentionBackwardParams& params, int64_t thread_limit) {
  const Problem<Element> problem(params.shape, params.q, params.k_chunk, params.v_chunk, params.history,
                                 params.selection);
  const PagedAttentionShape& shape = params.shape;
  const int32_t head_dim = shape.head_dim;
  const int32_t chunk_tokens = shape.chunk_tokens;
  const Element* out = static_cast<const Element*>(params.out);
  const Element* dout = static_cast<const Element*>(params.dout);
  const Compute* lse = static_cast<const Compute*>(params.lse);
  const int max_rows = problem.query_tokens_per_block() * problem.group;
  const size_t grad_page_element = dtype_size(params.grad_page_dtype);

  // delta[h][i] = sum_d dO[i][h][d] * O[i][h][d], the softmax backward's row term ([Hq, Tc]).
  std::vector<Compute> delta(size_t(shape.num_q_heads) * chunk_tokens);
  const int64_t workers = std::min(workers_for_work(3.5 * problem.forward_flops()), thread_limit);
  bool ok = parallel_for(shape.num_q_heads, [&](int64_t head) {
    for (int32_t token = 0; token < chunk_tokens; ++token) {
      const Element* o_row = problem.row_of(out, token, int32_t(head));
      const Element* do_row = problem.row_of(dout, token, int32_t(head));
      Compute sum = 0;
      for (int32_t d = 0; d < head_dim; ++d) sum += to_compute(o_row[d]) * to_compute(do_row[d]);
      delta[size_t(head) * chunk_tokens + token] = sum;
    }
  }, workers);

  // Sparse: the query tiles that selected each history page (tiles ascending).
  std::vector<std::vector<int32_t>> tiles_of_page;
  if (problem.selection.enabled()) {
    tiles_of_page.resize(size_t(problem.num_pages));
    const int32_t num_tiles = num_query_tiles(chunk_tokens, problem.tile_tokens);
    for (int32_t tile = 0; tile < num_tiles; ++tile) {
      for (int32_t slot = 0; slot < problem.selection.selected_per_tile; ++slot) {
        const int32_t page = problem.selection.selected_pages[int64_t(tile) * problem.selection.selected_per_tile + slot];
        if (page >= 0) tiles_of_page[size_t(page)].push_back(tile);
      }
    }
  }

  // Pass 1: dK and dV, one task per owned key block. History blocks come first (they see the
  // most queries), then chunk blocks from the first (which sees every query).
  std::vector<OwnedKeyBlock> owned;
  for (int32_t kv_head = 0; kv_head < shape.num_kv_heads; ++kv_head) {
    for (int32_t page = 0; page < problem.num_pages; ++page) {
      if (problem.selection.enabled() && tiles_of_page[size_t(page)].empty()) continue;
      for (int32_t part = 0; part < problem.parts_of_page(page); ++part) owned.push_back(OwnedKeyBlock{kv_head, page, part, -1});
    }
  }
  for (int32_t first_key = 0; shape.attend_chunk && first_key < chunk_tokens; first_key += kChunkKeyBlock) {
    for (int32_t kv_head = 0; kv_head < shape.num_kv_heads; ++kv_head) owned.push_back(OwnedKeyBlock{kv_head, -1, 0, first_key});
  }

  // Without the determinism promise, and when per-worker copies of dq fit in kMaxDqPartialBytes,
  // pass 1 also accumulates dQ += dS K into the copy of the worker that runs it, and the copies
  // are summed afterwards: 5 block products instead of 7, but the summation order of dq depends
  // on which worker ran which key block. See Note [CPU paged attention].
  const int64_t pass_one_workers = planned_workers(int64_t(owned.size()), workers);
  const int64_t rows_per_kv_head = int64_t(chunk_tokens) * problem.group;
  const int64_t dq_partial_elements = int64_t(shape.num_kv_heads) * rows_per_kv_head * head_dim;
  const bool single_pass = !params.deterministic &&
                           double(pass_one_workers) * double(dq_partial_elements) * sizeof(Compute) <= kMaxDqPartialBytes;
  // [worker][kv head][token * group + head in group][D]
  std::vector<std::vector<Compute>> dq_partials(single_pass ? size_t(pass_one_workers) : 0);

  ok = ok && parallel_for_workers(int64_t(owned.size()), [&](int64_t index, int worker) {
    const OwnedKeyBlock& task = owned[size_t(index)];
    Compute* dq_partial = nullptr;
    if (single_pass) {
      std::vector<Compute>& partial = dq_partials[size_t(worker)];
      if (partial.empty()) partial.assign(size_t(dq_partial_elements), Compute(0));
      dq_partial = partial.data() + int64_t(task.kv_head) * rows_per_kv_head * head_dim;
    }
    const bool is_history = task.chunk_first_key < 0;
    const KeyBlock<Element> key_block = is_history ? problem.history_block(task.page, task.part, task.kv_head)
                                                   : problem.chunk_block(task.chunk_first_key, task.kv_head);
    const int n = key_block.rows;
    BackwardBuffers<Compute> buffers(max_rows, head_dim, problem.shape.logit_softcap > 0.f);
    // [n][D] each.
    std::vector<Compute> key_grads(size_t(n) * head_dim, Compute(0)), value_grads(size_t(n) * head_dim, Compute(0));
    load_backward_key_block(problem, key_block, buffers);

    std::vector<QueryBlock> blocks;
    // A sliding window ends the queries that see the block at its last key's position + W - 1.
    const int32_t query_end = problem.window_query_end(key_block.first_position + n - 1);
    if (!is_history) {
      problem.append_query_blocks(task.chunk_first_key, std::max(task.chunk_first_key, query_end), 0, task.kv_head, blocks);
    } else if (problem.selection.enabled()) {
      for (int32_t tile : tiles_of_page[size_t(task.page)]) {
        problem.append_query_blocks(tile * problem.tile_tokens,
                                    std::min(chunk_tokens, (tile + 1) * problem.tile_tokens), tile, task.kv_head,
                                    blocks);
      }
    } else {
      problem.append_query_blocks(0, query_end, 0, task.kv_head, blocks);
    }
    for (const QueryBlock& block : blocks) {
      const int rows = (block.query_end - block.query_begin) * problem.group;
      load_backward_query_block(problem, block, dout, lse, delta.data(), /*with_rows=*/true, buffers);
      recompute_probabilities_and_score_grads(problem, block, rows, key_block, buffers);
      // dV [n][D] += P^T [n][rows] x dO [rows][D];  dK [n][D] += dS^T [n][rows] x Q [rows][D].
      matmul(n, head_dim, rows, buffers.probabilities.data(), rows, buffers.output_grads.data(), head_dim,
             value_grads.data(), head_dim, true);
      matmul(n, head_dim, rows, buffers.score_grads.data(), rows, buffers.queries.data(), head_dim, key_grads.data(),
             head_dim, true);
      if (dq_partial) {
        // dQ [rows][D] += dS [rows][n] x K [n][D], with dS given transposed.
        matmul_transposed_a(rows, head_dim, n, buffers.score_grads.data(), rows, buffers.keys.data(), head_dim,
                            dq_partial + int64_t(block.query_begin) * problem.group * head_dim, head_dim, true);
      }
    }

    if (is_history) {
      const int64_t page_elements = int64_t(shape.page_tokens) * problem.kv_row_stride;
      const int64_t row_offset = int64_t(task.part) * kMaxKeyBlock * problem.kv_row_stride + int64_t(task.kv_head) * head_dim;
      char* dk_rows = static_cast<char*>(params.grad_history.dk_pool) +
                      (int64_t(params.grad_history.dk_page_index[task.page]) * page_elements + row_offset) * grad_page_element;
      char* dv_rows = static_cast<char*>(params.grad_history.dv_pool) +
                      (int64_t(params.grad_history.dv_page_index[task.page]) * page_elements + row_offset) * grad_page_element;
      add_into_grad_page(key_grads.data(), n, head_dim, problem.kv_row_stride, dk_rows, params.grad_page_dtype);
      add_into_grad_page(value_grads.data(), n, head_dim, problem.kv_row_stride, dv_rows, params.grad_page_dtype);
    } else {
      const int64_t offset = int64_t(task.chunk_first_key) * problem.kv_row_stride + int64_t(task.kv_head) * head_dim;
      Element* dk = static_cast<Element*>(params.dk_chunk) + offset;
      Element* dv = static_cast<Element*>(params.dv_chunk) + offset;
      for (int r = 0; r < n; ++r) {
        for (int32_t d = 0; d < head_dim; ++d) {
          dk[r * problem.kv_row_stride + d] = from_compute<Element>(key_grads[size_t(r) * head_dim + d]);
          dv[r * problem.kv_row_stride + d] = from_compute<Element>(value_grads[size_t(r) * head_dim + d]);
        }
      }
    }
  }, workers);

  if (single_pass) {
    // dq = the sum of the workers' copies, in worker order.
    Element* dq = static_cast<Element*>(params.dq);
    ok = ok && parallel_for(chunk_tokens, [&](int64_t token) {
      for (int32_t head = 0; head < shape.num_q_heads; ++head) {
        const int64_t row = (int64_t(head / problem.group) * rows_per_kv_head + token * problem.group + head % problem.group) *
                            head_dim;
        Element* to = problem.row_of(dq, int32_t(token), head);
        for (int32_t d = 0; d < head_dim; ++d) {
          Compute sum = 0;
          for (const std::vector<Compute>& partial : dq_partials) {
            if (!partial.empty()) sum += partial[size_t(row + d)];
          }
          to[d] = from_compute<Element>(sum);
        }
      }
    }, workers);
    return ok ? 0 : kCpuOutOfMemory;
  }

  // Pass 2: dQ, one task per query block.
  const std::vector<QueryBlock> query_blocks = problem.all_query_blocks();
  ok = ok && parallel_for(int64_t(query_blocks.size()), [&](int64_t index) {
    const QueryBlock& block = query_blocks[size_t(index)];
    const int rows = (block.query_end - block.query_begin) * problem.group;
    BackwardBuffers<Compute> buffers(max_rows, head_dim, problem.shape.logit_softcap > 0.f);
    std::vector<Compute> query_grads(size_t(rows) * head_dim, Compute(0));  // [rows][D]
    load_backward_query_block(problem, block, dout, lse, delta.data(), /*with_rows=*/false, buffers);
    problem.for_each_key_block(block, [&](const KeyBlock<Element>& key_block) {
      load_backward_key_block(problem, key_block, buffers);
      recompute_probabilities_and_score_grads(problem, block, rows, key_block, buffers);
      // dQ [rows][D] += dS [rows][n] x K [n][D], with dS given transposed.
      matmul_transposed_a(rows, head_dim, key_block.rows, buffers.score_grads.data(), rows, buffers.keys.data(),
                          head_dim, query_grads.data(), head_dim, true);
    });
    Element* dq = static_cast<Element*>(params.dq);
    int r = 0;
    for (int32_t token = block.query_begin; token < block.query_end; ++token) {
      for (int32_t head = 0; head < problem.group; ++head, ++r) {
        Element* to = problem.row_of(dq, token, block.kv_head * problem.group + head);
        for (int32_t d = 0; d < head_dim; ++d) to[d] = from_compute<Element>(query_grads[size_t(r) * head_dim + d]);
      }
    }
  }, workers);
  return ok ? 0 : kCpuOutOfMemory;
}

// ---------------------------------------------------------------------------------------------
// Page summaries and selection.

template <typename Element>
int page_summary_typed(const PageSummaryParams& params, int64_t thread_limit) {
  const PagedAttentionShape& shape = params.shape;
  const int32_t num_pages = shape.num_history_pages();
  const int32_t head_dim = shape.head_dim;
  const int64_t row_stride = int64_t(shape.num_kv_heads) * head_dim;
  const Element* pool = static_cast<const Element*>(params.k_pool);
  const bool ok = parallel_for(num_pages, [&](int64_t page) {
    const int32_t rows = std::min(shape.page_tokens, shape.history_tokens - int32_t(page) * shape.page_tokens);
    const Element* page_base = pool + int64_t(params.k_page_index[page]) * shape.page_tokens * row_stride;
    const size_t dims = static_cast<size_t>(head_dim);
    std::vector<double> sum(dims), low(dims), high(dims);
    for (int32_t kv_head = 0; kv_head < shape.num_kv_heads; ++kv_head) {
      std::fill(sum.begin(), sum.end(), 0.0);
      std::fill(low.begin(), low.end(), std::numeric_limits<double>::infinity());
      std::fill(high.begin(), high.end(), -std::numeric_limits<double>::infinity());
      for (int32_t row = 0; row < rows; ++row) {
        const Element* key = page_base + row * row_stride + int64_t(kv_head) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) {
          const double value = double(to_compute(key[d]));
          sum[size_t(d)] += value;
          low[size_t(d)] = std::min(low[size_t(d)], value);
          high[size_t(d)] = std::max(high[size_t(d)], value);
        }
      }
      const int64_t offset = (page * shape.num_kv_heads + kv_head) * int64_t(head_dim);
      for (int32_t d = 0; d < head_dim; ++d) {
        params.mean[offset + d] = float(sum[size_t(d)] / rows);
        if (params.min) params.min[offset + d] = float(low[size_t(d)]);
        if (params.max) params.max[offset + d] = float(high[size_t(d)]);
      }
    }
  }, thread_limit);
  return ok ? 0 : kCpuOutOfMemory;
}

template <typename Element>
int page_select_typed(const PageSelectParams& params, int64_t thread_limit) {
  const PagedAttentionShape& shape = params.shape;
  const int32_t num_pages = shape.num_history_pages();
  const int32_t head_dim = shape.head_dim;
  const int32_t group = shape.num_q_heads / shape.num_kv_heads;
  const int32_t num_tiles = num_query_tiles(shape.chunk_tokens, params.query_tile_tokens);
  const Element* q = static_cast<const Element*>(params.q);
  const bool ok = parallel_for(num_tiles, [&](int64_t tile) {
    const int32_t begin = int32_t(tile) * params.query_tile_tokens;
    const int32_t end = std::min(shape.chunk_tokens, begin + params.query_tile_tokens);
    // Mean query of the tile per q head: [Hq][D].
    std::vector<double> mean_query(size_t(shape.num_q_heads) * head_dim, 0.0);
    for (int32_t token = begin; token < end; ++token) {
      const Element* row = q + int64_t(token) * shape.num_q_heads * head_dim;
      for (int64_t i = 0; i < int64_t(shape.num_q_heads) * head_dim; ++i) mean_query[size_t(i)] += double(to_compute(row[i]));
    }
    for (double& value : mean_query) value /= double(end - begin);

    std::vector<double> scores(size_t(num_pages), 0.0);
    for (int32_t page = 0; page < num_pages; ++page) {
      double score = 0.0;
      for (int32_t head = 0; head < shape.num_q_heads; ++head) {
        const int64_t summary = (int64_t(page) * shape.num_kv_heads + head / group) * head_dim;
        const double* query = mean_query.data() + int64_t(head) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) {
          if (params.use_bounds) {
            score += std::max(query[d] * double(params.min[summary + d]), query[d] * double(params.max[summary + d]));
          } else {
            score += query[d] * double(params.mean[summary + d]);
          }
        }
      }
      // A NaN score (from NaN inputs) ranks last, so that the ordering below stays a strict one.
      scores[size_t(page)] = std::isnan(score) ? -std::numeric_limits<double>::infinity() : score;
    }

    int32_t* selected = params.selected_pages + tile * params.top_k;
    std::vector<int32_t> pages(static_cast<size_t>(num_pages));
    for (int32_t page = 0; page < num_pages; ++page) pages[size_t(page)] = page;
    const int32_t keep = std::min(params.top_k, num_pages);
    if (keep < num_pages) {
      // Highest score first; equal scores go to the lower page index.
      std::nth_element(pages.begin(), pages.begin() + keep, pages.end(), [&](int32_t a, int32_t b) {
        if (scores[size_t(a)] != scores[size_t(b)]) return scores[size_t(a)] > scores[size_t(b)];
        return a < b;
      });
      std::sort(pages.begin(), pages.begin() + keep);
    }
    for (int32_t slot = 0; slot < params.top_k; ++slot) selected[slot] = slot < keep ? pages[size_t(slot)] : -1;
  }, thread_limit);
  return ok ? 0 : kCpuOutOfMemory;
}

bool grad_page_dtype_supported(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat64;
}

}  // namespace

int paged_attention_forward(const PagedAttentionForwardParams& params, const CpuOptions& options) {
  if (paged_attention_check_shape(params.shape)[0] != '\0') return kCpuInvalidArgument;
  if (!params.q || !params.out || !params.lse) return kCpuInvalidArgument;
  if (params.shape.attend_chunk && (!params.k_chunk || !params.v_chunk)) return kCpuInvalidArgument;
  if (params.shape.history_tokens > 0 && (!params.history.k_pool || !params.history.k_page_index ||
                                          !params.history.v_pool || !params.history.v_page_index)) {
    return kCpuInvalidArgument;
  }
  try {
    if (page_selection_check(params.shape, params.selection)[0] != '\0') return kCpuInvalidArgument;
    switch (params.shape.dtype) {
      case DType::kFloat32: return forward_typed<float, float>(params, detail::worker_limit(options.max_threads));
      case DType::kBFloat16: return forward_typed<BFloat16, float>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat16: return forward_typed<Float16, float>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat64: return forward_typed<double, double>(params, detail::worker_limit(options.max_threads));
    }
  } catch (const std::bad_alloc&) {
    return kCpuOutOfMemory;
  }
  return kCpuInvalidArgument;
}

int paged_attention_backward(const PagedAttentionBackwardParams& params, const CpuOptions& options) {
  if (paged_attention_check_shape(params.shape)[0] != '\0') return kCpuInvalidArgument;
  if (!params.q || !params.out || !params.dout || !params.lse || !params.dq) return kCpuInvalidArgument;
  if (params.shape.attend_chunk &&
      (!params.k_chunk || !params.v_chunk || !params.dk_chunk || !params.dv_chunk)) {
    return kCpuInvalidArgument;
  }
  if (!grad_page_dtype_supported(params.grad_page_dtype)) return kCpuInvalidArgument;
  if (params.shape.history_tokens > 0 &&
      (!params.history.k_pool || !params.history.k_page_index || !params.history.v_pool ||
       !params.history.v_page_index || !params.grad_history.dk_pool || !params.grad_history.dk_page_index ||
       !params.grad_history.dv_pool || !params.grad_history.dv_page_index)) {
    return kCpuInvalidArgument;
  }
  try {
    if (page_selection_check(params.shape, params.selection)[0] != '\0') return kCpuInvalidArgument;
    switch (params.shape.dtype) {
      case DType::kFloat32: return backward_typed<float, float>(params, detail::worker_limit(options.max_threads));
      case DType::kBFloat16: return backward_typed<BFloat16, float>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat16: return backward_typed<Float16, float>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat64: return backward_typed<double, double>(params, detail::worker_limit(options.max_threads));
    }
  } catch (const std::bad_alloc&) {
    return kCpuOutOfMemory;
  }
  return kCpuInvalidArgument;
}

int page_summary(const PageSummaryParams& params, const CpuOptions& options) {
  const PagedAttentionShape& shape = params.shape;
  if (shape.history_tokens < 0 || shape.page_tokens < 1 || shape.num_kv_heads < 1 || shape.head_dim < 1 ||
      shape.head_dim > 256) {
    return kCpuInvalidArgument;
  }
  if (!params.mean || (shape.history_tokens > 0 && (!params.k_pool || !params.k_page_index))) return kCpuInvalidArgument;
  try {
    switch (shape.dtype) {
      case DType::kFloat32: return page_summary_typed<float>(params, detail::worker_limit(options.max_threads));
      case DType::kBFloat16: return page_summary_typed<BFloat16>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat16: return page_summary_typed<Float16>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat64: return page_summary_typed<double>(params, detail::worker_limit(options.max_threads));
    }
  } catch (const std::bad_alloc&) {
    return kCpuOutOfMemory;
  }
  return kCpuInvalidArgument;
}

int page_select(const PageSelectParams& params, const CpuOptions& options) {
  if (paged_attention_check_shape(params.shape)[0] != '\0') return kCpuInvalidArgument;
  if (params.top_k < 1 || params.query_tile_tokens < 1 || !params.q || !params.selected_pages) return kCpuInvalidArgument;
  if (params.shape.history_tokens > 0) {
    if (params.use_bounds ? (!params.min || !params.max) : !params.mean) return kCpuInvalidArgument;
  }
  try {
    switch (params.shape.dtype) {
      case DType::kFloat32: return page_select_typed<float>(params, detail::worker_limit(options.max_threads));
      case DType::kBFloat16: return page_select_typed<BFloat16>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat16: return page_select_typed<Float16>(params, detail::worker_limit(options.max_threads));
      case DType::kFloat64: return page_select_typed<double>(params, detail::worker_limit(options.max_threads));
    }
  } catch (const std::bad_alloc&) {
    return kCpuOutOfMemory;
  }
  return kCpuInvalidArgument;
}

}  // namespace membar::kernels::cpu
