// Tests of the CPU paged-attention kernels (kernels/cpu/attention_cpu.cpp) against a naive
// implementation written here: every score materialised, one (query, q head) at a time.
//
// Error bounds: fp64 inputs must match the fp64 naive implementation to ~1e-12. For fp32, bf16
// and fp16 inputs the kernel's error (against the fp64 naive implementation on the same rounded
// inputs) must be at most twice the error of a plain implementation in the same precision: the
// naive one computed in fp32 from the rounded inputs, with its outputs rounded to the element type.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "membar/kernels/attention.h"
#include "membar/kernels/half_types.h"

namespace membar::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Element types.

template <typename Element>
struct ElementTraits;
template <>
struct ElementTraits<double> {
  static constexpr DType dtype = DType::kFloat64;
  static double to_double(double value) { return value; }
  static double from_double(double value) { return value; }
};
template <>
struct ElementTraits<float> {
  static constexpr DType dtype = DType::kFloat32;
  static double to_double(float value) { return value; }
  static float from_double(double value) { return float(value); }
};
template <>
struct ElementTraits<BFloat16> {
  static constexpr DType dtype = DType::kBFloat16;
  static double to_double(BFloat16 value) { return bfloat16_to_float(value); }
  static BFloat16 from_double(double value) { return float_to_bfloat16(float(value)); }
};
template <>
struct ElementTraits<Float16> {
  static constexpr DType dtype = DType::kFloat16;
  static double to_double(Float16 value) { return float16_to_float(value); }
  static Float16 from_double(double value) { return float_to_float16(float(value)); }
};

template <typename Element>
double round_to(double value) {
  return ElementTraits<Element>::to_double(ElementTraits<Element>::from_double(value));
}

template <typename Element>
std::vector<Element> pack(const std::vector<double>& values) {
  std::vector<Element> packed(values.size());
  for (size_t i = 0; i < values.size(); ++i) packed[i] = ElementTraits<Element>::from_double(values[i]);
  return packed;
}

template <typename Element>
std::vector<double> unpack(const std::vector<Element>& values) {
  std::vector<double> unpacked(values.size());
  for (size_t i = 0; i < values.size(); ++i) unpacked[i] = ElementTraits<Element>::to_double(values[i]);
  return unpacked;
}

// ---------------------------------------------------------------------------------------------
// A test problem: random inputs, already rounded to the element type under test, with the
// history scattered over a pool in shuffled order and every pool row the kernel must not read
// (unused pages, rows past history_tokens) set to NaN.

struct Case {
  int32_t chunk_tokens = 0;
  int32_t history_tokens = 0;
  int32_t page_tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  bool sparse = false;
  int32_t query_tile_tokens = 0;
  int32_t selected_per_tile = 0;
  uint32_t seed = 0;
  float logit_softcap = 0.f;  // Note [Soft-capped scores] in attention.h
  int32_t sliding_window = 0;  // Note [Sliding window] in attention.h

  std::string name() const {
    return "Tc" + std::to_string(chunk_tokens) + "_hist" + std::to_string(history_tokens) + "_page" +
           std::to_string(page_tokens) + "_Hq" + std::to_string(num_q_heads) + "_Hkv" + std::to_string(num_kv_heads) +
           "_D" + std::to_string(head_dim) + (sparse ? "_sparse" + std::to_string(query_tile_tokens) : "_dense") +
           (logit_softcap > 0.f ? "_softcap" + std::to_string(int(logit_softcap * 10)) : "") +
           (sliding_window > 0 ? "_window" + std::to_string(sliding_window) : "");
  }
};

struct Problem {
  PagedAttentionShape shape;
  int32_t pool_pages = 0;
  std::vector<double> q, k_chunk, v_chunk, k_pool, v_pool, dout;  // values of the element type
  std::vector<double> dk_pool_initial, dv_pool_initial;          // values of the grad page type
  std::vector<int32_t> k_page_index, v_page_index, dk_page_index, dv_page_index;
  std::vector<int32_t> selected_pages;
  int32_t selected_per_tile = 0;
  int32_t query_tile_tokens = 0;

  int64_t pool_elements() const {
    return int64_t(pool_pages) * shape.page_tokens * shape.num_kv_heads * shape.head_dim;
  }
  // Element offset of history token `token`, kv head `kv_head` in a pool through `index`.
  int64_t history_offset(const std::vector<int32_t>& index, int32_t token, int32_t kv_head) const {
    const int32_t page = token / shape.page_tokens, row = token % shape.page_tokens;
    return ((int64_t(index[page]) * shape.page_tokens + row) * shape.num_kv_heads + kv_head) * shape.head_dim;
  }
  // The sliding window (Note [Sliding window] in attention.h): HF's kv_idx > q_idx - window, with
  // history token t at position t and chunk token i at history_tokens + i.
  bool in_window(int32_t query_position, int32_t key_position) const {
    return shape.sliding_window <= 0 || key_position > query_position - shape.sliding_window;
  }
  bool sees_history_token(int32_t query, int32_t token) const {
    if (!in_window(shape.history_tokens + query, token)) return false;
    if (selected_pages.empty()) return true;
    const int32_t tile = query / query_tile_tokens, page = token / shape.page_tokens;
    const int32_t* row = selected_pages.data() + int64_t(tile) * selected_per_tile;
    return std::find(row, row + selected_per_tile, page) != row + selected_per_tile;
  }
};

template <typename Element>
Problem make_problem(const Case& c, DType grad_page_dtype) {
  Problem problem;
  PagedAttentionShape& shape = problem.shape;
  shape.chunk_tokens = c.chunk_tokens;
  shape.history_tokens = c.history_tokens;
  shape.page_tokens = c.page_tokens;
  shape.num_q_heads = c.num_q_heads;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.softmax_scale = float(1.0 / std::sqrt(double(c.head_dim)));
  shape.logit_softcap = c.logit_softcap;
  shape.sliding_window = c.sliding_window;
  shape.dtype = ElementTraits<Element>::dtype;

  std::mt19937 generator(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto random_vector = [&](int64_t size) {
    std::vector<double> values(static_cast<size_t>(size));
    for (double& value : values) value = round_to<Element>(normal(generator));
    return values;
  };
  const int64_t q_size = int64_t(c.chunk_tokens) * c.num_q_heads * c.head_dim;
  const int64_t kv_size = int64_t(c.chunk_tokens) * c.num_kv_heads * c.head_dim;
  problem.q = random_vector(q_size);
  problem.k_chunk = random_vector(kv_size);
  problem.v_chunk = random_vector(kv_size);
  problem.dout = random_vector(q_size);

  const int32_t num_pages = shape.num_history_pages();
  problem.pool_pages = num_pages + 2;  // two pages nobody uses
  auto shuffled_index = [&]() {
    std::vector<int32_t> order(static_cast<size_t>(problem.pool_pages));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), generator);
    order.resize(size_t(num_pages));
    return order;
  };
  problem.k_page_index = shuffled_index();
  problem.v_page_index = shuffled_index();
  problem.dk_page_index = shuffled_index();
  problem.dv_page_index = shuffled_index();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  problem.k_pool.assign(size_t(problem.pool_elements()), nan);
  problem.v_pool.assign(size_t(problem.pool_elements()), nan);
  for (int32_t token = 0; token < c.history_tokens; ++token) {
    for (int32_t kv_head = 0; kv_head < c.num_kv_heads; ++kv_head) {
      for (int32_t d = 0; d < c.head_dim; ++d) {
        problem.k_pool[size_t(problem.history_offset(problem.k_page_index, token, kv_head) + d)] =
            round_to<Element>(normal(generator));
        problem.v_pool[size_t(problem.history_offset(problem.v_page_index, token, kv_head) + d)] =
            round_to<Element>(normal(generator));
      }
    }
  }
  // Grad pages start from random values (the in-place add must keep them), every row included.
  auto grad_pool = [&]() {
    std::vector<double> values(static_cast<size_t>(problem.pool_elements()));
    for (double& value : values) {
      const double x = 0.1 * normal(generator);
      value = grad_page_dtype == DType::kBFloat16 ? round_to<BFloat16>(x)
              : grad_page_dtype == DType::kFloat32 ? double(float(x))
                                                   : x;
    }
    return values;
  };
  problem.dk_pool_initial = grad_pool();
  problem.dv_pool_initial = grad_pool();

  if (c.sparse) {
    // Each tile selects a random subset of the pages (at most selected_per_tile), in random slot
    // order, with -1 padding in the remaining slots.
    problem.query_tile_tokens = c.query_tile_tokens;
    problem.selected_per_tile = c.selected_per_tile;
    const int32_t num_tiles = num_query_tiles(c.chunk_tokens, c.query_tile_tokens);
    problem.selected_pages.assign(size_t(num_tiles) * c.selected_per_tile, -1);
    for (int32_t tile = 0; tile < num_tiles; ++tile) {
      std::vector<int32_t> pages(static_cast<size_t>(num_pages));
      std::iota(pages.begin(), pages.end(), 0);
      std::shuffle(pages.begin(), pages.end(), generator);
      const int32_t count = std::min<int32_t>(num_pages, int32_t(generator() % (c.selected_per_tile + 1)));
      for (int32_t i = 0; i < count; ++i) problem.selected_pages[size_t(tile) * c.selected_per_tile + i] = pages[size_t(i)];
      std::shuffle(problem.selected_pages.begin() + tile * c.selected_per_tile,
                   problem.selected_pages.begin() + (tile + 1) * c.selected_per_tile, generator);
    }
  }
  return problem;
}

// ---------------------------------------------------------------------------------------------
// The naive implementation, in Compute precision, each output rounded by `round_output`.

struct Result {
  std::vector<double> out, lse, dq, dk_chunk, dv_chunk;
  std::vector<double> dk_pool, dv_pool;  // the grad pools after the backward
};

template <typename Compute>
Result naive_attention(const Problem& p, double (*round_output)(double), double (*round_grad_page)(double),
                       bool backward) {
  const PagedAttentionShape& s = p.shape;
  const int32_t group = s.num_q_heads / s.num_kv_heads, D = s.head_dim, Tc = s.chunk_tokens;
  const Compute scale = Compute(s.softmax_scale), cap = Compute(s.logit_softcap);
  Result result;
  result.out.assign(size_t(Tc) * s.num_q_heads * D, 0.0);
  result.lse.assign(size_t(s.num_q_heads) * Tc, 0.0);
  result.dq.assign(result.out.size(), 0.0);
  result.dk_chunk.assign(p.k_chunk.size(), 0.0);
  result.dv_chunk.assign(p.v_chunk.size(), 0.0);
  std::vector<Compute> dk_chunk(p.k_chunk.size(), 0), dv_chunk(p.v_chunk.size(), 0);
  std::vector<Compute> dk_history(size_t(s.history_tokens) * s.num_kv_heads * D, 0), dv_history(dk_history.size(), 0);

  for (int32_t head = 0; head < s.num_q_heads; ++head) {
    const int32_t kv_head = head / group;
    for (int32_t i = 0; i < Tc; ++i) {
      // Visible keys: (pointer to key, pointer to value, gradient slots).
      std::vector<const double*> keys, values;
      std::vector<Compute*> key_grads, value_grads;
      for (int32_t t = 0; t < s.history_tokens; ++t) {
        if (!p.sees_history_token(i, t)) continue;
        keys.push_back(p.k_pool.data() + p.history_offset(p.k_page_index, t, kv_head));
        values.push_back(p.v_pool.data() + p.history_offset(p.v_page_index, t, kv_head));
        key_grads.push_back(dk_history.data() + (int64_t(t) * s.num_kv_heads + kv_head) * D);
        value_grads.push_back(dv_history.data() + (int64_t(t) * s.num_kv_heads + kv_head) * D);
      }
      for (int32_t j = 0; j <= i; ++j) {
        if (!p.in_window(s.history_tokens + i, s.history_tokens + j)) continue;
        const int64_t offset = (int64_t(j) * s.num_kv_heads + kv_head) * D;
        keys.push_back(p.k_chunk.data() + offset);
        values.push_back(p.v_chunk.data() + offset);
        key_grads.push_back(dk_chunk.data() + offset);
        value_grads.push_back(dv_chunk.data() + offset);
      }
      const int64_t q_offset = (int64_t(i) * s.num_q_heads + head) * D;
      const double* query = p.q.data() + q_offset;
      std::vector<Compute> scores(keys.size()), slopes(keys.size(), Compute(1));
      Compute max_score = -std::numeric_limits<Compute>::infinity();
      for (size_t k = 0; k < keys.size(); ++k) {
        Compute dot = 0;
        for (int32_t d = 0; d < D; ++d) dot += Compute(query[d]) * Compute(keys[k][d]);
        scores[k] = scale * dot;
        if (cap > 0) {  // cap * tanh(s / cap), whose slope is 1 - tanh^2
          const Compute t = std::tanh(scores[k] / cap);
          scores[k] = cap * t;
          slopes[k] = 1 - t * t;
        }
        max_score = std::max(max_score, scores[k]);
      }
      Compute sum = 0;
      for (Compute score : scores) sum += std::exp(score - max_score);
      const Compute lse = max_score + std::log(sum);
      std::vector<Compute> out(size_t(D), 0), probabilities(keys.size());
      for (size_t k = 0; k < keys.size(); ++k) {
        probabilities[k] = std::exp(scores[k] - lse);
        for (int32_t d = 0; d < D; ++d) out[size_t(d)] += probabilities[k] * Compute(values[k][d]);
      }
      result.lse[size_t(head) * Tc + i] = double(lse);
      for (int32_t d = 0; d < D; ++d) result.out[size_t(q_offset + d)] = round_output(double(out[size_t(d)]));
      if (!backward) continue;
      const double* dout = p.dout.data() + q_offset;
      Compute delta = 0;  // from the output as stored (rounded), as a kernel would see it
      for (int32_t d = 0; d < D; ++d) delta += Compute(dout[d]) * Compute(result.out[size_t(q_offset + d)]);
      std::vector<Compute> dq(size_t(D), 0);
      for (size_t k = 0; k < keys.size(); ++k) {
        Compute dp = 0;
        for (int32_t d = 0; d < D; ++d) dp += Compute(dout[d]) * Compute(values[k][d]);
        const Compute ds = probabilities[k] * (dp - delta) * scale * slopes[k];
        for (int32_t d = 0; d < D; ++d) {
          dq[size_t(d)] += ds * Compute(keys[k][d]);
          key_grads[k][d] += ds * Compute(query[d]);
          value_grads[k][d] += probabilities[k] * Compute(dout[d]);
        }
      }
      for (int32_t d = 0; d < D; ++d) result.dq[size_t(q_offset + d)] = round_output(double(dq[size_t(d)]));
    }
  }
  if (!backward) return result;
  for (size_t i = 0; i < dk_chunk.size(); ++i) {
    result.dk_chunk[i] = round_output(double(dk_chunk[i]));
    result.dv_chunk[i] = round_output(double(dv_chunk[i]));
  }
  result.dk_pool = p.dk_pool_initial;
  result.dv_pool = p.dv_pool_initial;
  for (int32_t t = 0; t < s.history_tokens; ++t) {
    for (int32_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head) {
      for (int32_t d = 0; d < D; ++d) {
        const size_t from = size_t((int64_t(t) * s.num_kv_heads + kv_head) * D + d);
        double& dk = result.dk_pool[size_t(p.history_offset(p.dk_page_index, t, kv_head) + d)];
        double& dv = result.dv_pool[size_t(p.history_offset(p.dv_page_index, t, kv_head) + d)];
        dk = round_grad_page(double(Compute(dk) + dk_history[from]));
        dv = round_grad_page(double(Compute(dv) + dv_history[from]));
      }
    }
  }
  return result;
}

double identity(double value) { return value; }
template <typename Element>
double round_output(double value) { return round_to<Element>(value); }

double (*round_for_grad_page(DType dtype))(double) {
  if (dtype == DType::kBFloat16) return round_output<BFloat16>;
  if (dtype == DType::kFloat32) return round_output<float>;
  return identity;
}

// ---------------------------------------------------------------------------------------------
// Running the kernels.

template <typename GradElement>
std::vector<GradElement> pack_grad(const std::vector<double>& values) {
  return pack<GradElement>(values);
}

template <typename Element>
Result run_kernels(const Problem& p, DType grad_page_dtype, bool backward, bool deterministic = false) {
  std::vector<Element> q = pack<Element>(p.q), k_chunk = pack<Element>(p.k_chunk), v_chunk = pack<Element>(p.v_chunk);
  std::vector<Element> k_pool = pack<Element>(p.k_pool), v_pool = pack<Element>(p.v_pool), dout = pack<Element>(p.dout);
  using Lse = std::conditional_t<std::is_same_v<Element, double>, double, float>;
  std::vector<Element> out(q.size());
  std::vector<Lse> lse(size_t(p.shape.num_q_heads) * p.shape.chunk_tokens);

  PagedAttentionForwardParams forward;
  forward.shape = p.shape;
  forward.q = q.data();
  forward.k_chunk = k_chunk.data();
  forward.v_chunk = v_chunk.data();
  forward.history = HistoryPages{k_pool.data(), p.k_page_index.data(), v_pool.data(), p.v_page_index.data()};
  if (!p.selected_pages.empty()) {
    forward.selection = PageSelection{p.selected_pages.data(), p.selected_per_tile, p.query_tile_tokens};
  }
  forward.out = out.data();
  forward.lse = lse.data();
  EXPECT_EQ(cpu::paged_attention_forward(forward), 0);

  Result result;
  result.out = unpack(out);
  result.lse.assign(lse.begin(), lse.end());
  if (!backward) return result;

  std::vector<Element> dq(q.size()), dk_chunk(k_chunk.size()), dv_chunk(v_chunk.size());
  std::vector<float> dk_f32, dv_f32;
  std::vector<double> dk_f64, dv_f64;
  std::vector<BFloat16> dk_bf16, dv_bf16;
  PagedAttentionBackwardParams params;
  params.shape = p.shape;
  params.q = q.data();
  params.k_chunk = k_chunk.data();
  params.v_chunk = v_chunk.data();
  params.history = forward.history;
  params.selection = forward.selection;
  params.out = out.data();
  params.dout = dout.data();
  params.lse = lse.data();
  params.dq = dq.data();
  params.dk_chunk = dk_chunk.data();
  params.dv_chunk = dv_chunk.data();
  params.grad_page_dtype = grad_page_dtype;
  params.deterministic = deterministic;
  if (grad_page_dtype == DType::kFloat32) {
    dk_f32 = pack<float>(p.dk_pool_initial);
    dv_f32 = pack<float>(p.dv_pool_initial);
    params.grad_history = HistoryGradPages{dk_f32.data(), p.dk_page_index.data(), dv_f32.data(), p.dv_page_index.data()};
  } else if (grad_page_dtype == DType::kFloat64) {
    dk_f64 = p.dk_pool_initial;
    dv_f64 = p.dv_pool_initial;
    params.grad_history = HistoryGradPages{dk_f64.data(), p.dk_page_index.data(), dv_f64.data(), p.dv_page_index.data()};
  } else {
    dk_bf16 = pack<BFloat16>(p.dk_pool_initial);
    dv_bf16 = pack<BFloat16>(p.dv_pool_initial);
    params.grad_history = HistoryGradPages{dk_bf16.data(), p.dk_page_index.data(), dv_bf16.data(), p.dv_page_index.data()};
  }
  EXPECT_EQ(cpu::paged_attention_backward(params), 0);
  result.dq = unpack(dq);
  result.dk_chunk = unpack(dk_chunk);
  result.dv_chunk = unpack(dv_chunk);
  if (grad_page_dtype == DType::kFloat32) {
    result.dk_pool = unpack(dk_f32);
    result.dv_pool = unpack(dv_f32);
  } else if (grad_page_dtype == DType::kFloat64) {
    result.dk_pool = dk_f64;
    result.dv_pool = dv_f64;
  } else {
    result.dk_pool = unpack(dk_bf16);
    result.dv_pool = unpack(dv_bf16);
  }
  return result;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

double max_abs(const std::vector<double>& a) {
  double worst = 0.0;
  for (double value : a) worst = std::max(worst, std::fabs(value));
  return worst;
}

// ---------------------------------------------------------------------------------------------
// The shape grid.

std::vector<Case> shape_grid() {
  // (Hq, Hkv): GQA ratios 1, 4, 7, 8.
  const int32_t heads[][2] = {{2, 2}, {4, 1}, {7, 1}, {16, 2}};
  std::vector<Case> cases;
  uint32_t seed = 1;
  for (int32_t page_tokens : {64, 128, 37}) {
    for (int32_t head_dim : {64, 128}) {
      for (int32_t history_kind = 0; history_kind < 3; ++history_kind) {
        // Rotate the GQA ratio and chunk length through the grid instead of taking the full
        // product, so that the whole grid stays a few seconds.
        const auto& h = heads[(page_tokens + head_dim / 64 + history_kind) % 4];
        const int32_t chunk_tokens = (history_kind == 0) ? 150 : (history_kind == 1 ? 77 : 33);
        const int32_t history = history_kind == 0 ? 0 : (history_kind == 1 ? page_tokens / 2 + 3 : 3 * page_tokens + 5);
        for (bool sparse : {false, true}) {
          if (sparse && history == 0) continue;
          Case c;
          c.chunk_tokens = chunk_tokens;
          c.history_tokens = history;
          c.page_tokens = page_tokens;
          c.num_q_heads = h[0];
          c.num_kv_heads = h[1];
          c.head_dim = head_dim;
          c.sparse = sparse;
          c.query_tile_tokens = sparse ? 16 + int32_t(seed % 3) * 9 : 0;
          c.selected_per_tile = sparse ? 3 : 0;
          c.seed = seed++;
          cases.push_back(c);
        }
      }
    }
  }
  // Chunks of one token, and of exactly one key block plus one.
  cases.push_back(Case{1, 70, 64, 8, 1, 64, false, 0, 0, 100});
  cases.push_back(Case{65, 0, 64, 4, 4, 128, false, 0, 0, 101});
  // A page longer than a key block (split into parts) and head_dim 256.
  cases.push_back(Case{20, 300, 200, 4, 2, 256, false, 0, 0, 102});
  cases.push_back(Case{20, 300, 200, 4, 2, 64, true, 8, 1, 103});
  // Every head size the CUDA kernels take (96 and 256 besides the grid's), and sizes that are not a
  // multiple of the matmul micro-kernel's tile: the reference takes any head size.
  cases.push_back(Case{70, 150, 64, 8, 2, 96, false, 0, 0, 104});
  cases.push_back(Case{70, 300, 128, 4, 1, 96, true, 32, 2, 105});
  cases.push_back(Case{33, 200, 128, 4, 2, 256, true, 16, 2, 106});
  cases.push_back(Case{45, 90, 32, 6, 3, 40, false, 0, 0, 107});
  cases.push_back(Case{45, 90, 32, 4, 2, 3, true, 16, 2, 108});
  // Soft-capped scores (Gemma 2): a cap of 1.5 bends most of these N(0, 1) scores; dense, sparse
  // and the head sizes Gemma 2 uses.
  cases.push_back(Case{70, 150, 64, 8, 4, 256, false, 0, 0, 109, 1.5f});
  cases.push_back(Case{40, 200, 37, 4, 2, 128, true, 16, 2, 110, 1.5f});
  cases.push_back(Case{33, 0, 64, 2, 1, 64, false, 0, 0, 111, 50.f});
  // Sliding windows (Note [Sliding window] in attention.h): smaller than a page, not a multiple of
  // the page, larger than a key block, larger than the whole history (no effect), a page split in
  // key blocks, a chunk only with a window below the chunk's key block, a window of one (each query
  // sees itself), and with a soft-cap.
  cases.push_back(Case{70, 150, 64, 8, 4, 128, false, 0, 0, 120, 0.f, 40});
  cases.push_back(Case{77, 200, 64, 4, 2, 64, false, 0, 0, 121, 0.f, 100});
  cases.push_back(Case{90, 260, 32, 4, 1, 96, false, 0, 0, 122, 0.f, 150});
  cases.push_back(Case{40, 90, 32, 4, 1, 64, false, 0, 0, 123, 0.f, 500});
  cases.push_back(Case{45, 300, 200, 4, 2, 256, false, 0, 0, 124, 0.f, 170});
  cases.push_back(Case{150, 0, 64, 2, 1, 64, false, 0, 0, 125, 0.f, 17});
  cases.push_back(Case{20, 30, 16, 2, 1, 32, false, 0, 0, 126, 0.f, 1});
  cases.push_back(Case{70, 150, 64, 8, 4, 256, false, 0, 0, 127, 1.5f, 90});
  cases.push_back(Case{33, 129, 64, 4, 2, 40, false, 0, 0, 128, 0.f, 33});
  return cases;
}

class AttentionGrid : public ::testing::TestWithParam<Case> {};

// Checks one element type: the error of each output against the fp64 naive implementation,
// against `allowed(plain_error)`.
template <typename Element>
void check_against_naive(const Case& c, DType grad_page_dtype, bool fp64, bool deterministic) {
  const Problem problem = make_problem<Element>(c, grad_page_dtype);
  const Result exact = naive_attention<double>(problem, identity, identity, true);
  const Result kernel = run_kernels<Element>(problem, grad_page_dtype, true, deterministic);
  Result plain;
  if (!fp64) plain = naive_attention<float>(problem, round_output<Element>, round_for_grad_page(grad_page_dtype), true);

  struct Output {
    const char* name;
    const std::vector<double>& exact;
    const std::vector<double>& kernel;
    const std::vector<double>* plain;
  };
  const Output outputs[] = {
      {"out", exact.out, kernel.out, fp64 ? nullptr : &plain.out},
      {"lse", exact.lse, kernel.lse, fp64 ? nullptr : &plain.lse},
      {"dq", exact.dq, kernel.dq, fp64 ? nullptr : &plain.dq},
      {"dk_chunk", exact.dk_chunk, kernel.dk_chunk, fp64 ? nullptr : &plain.dk_chunk},
      {"dv_chunk", exact.dv_chunk, kernel.dv_chunk, fp64 ? nullptr : &plain.dv_chunk},
      {"dk_pool", exact.dk_pool, kernel.dk_pool, fp64 ? nullptr : &plain.dk_pool},
      {"dv_pool", exact.dv_pool, kernel.dv_pool, fp64 ? nullptr : &plain.dv_pool},
  };
  for (const Output& output : outputs) {
    const double kernel_error = max_abs_difference(output.kernel, output.exact);
    if (fp64) {
      EXPECT_LE(kernel_error, 1e-12 * std::max(1.0, max_abs(output.exact))) << output.name;
    } else {
      const double plain_error = max_abs_difference(*output.plain, output.exact);
      // The small absolute floor covers outputs whose plain error happens to be exactly 0.
      const double floor = 1e-6 * std::max(1.0, max_abs(output.exact));
      EXPECT_LE(kernel_error, 2.0 * plain_error + floor)
          << output.name << ": kernel error " << kernel_error << ", plain error " << plain_error;
    }
  }
}

// Both dq strategies of the backward (Note [CPU paged attention]) on every shape.
TEST_P(AttentionGrid, Float64MatchesNaive) { check_against_naive<double>(GetParam(), DType::kFloat64, true, false); }

TEST_P(AttentionGrid, Float64DeterministicMatchesNaive) {
  check_against_naive<double>(GetParam(), DType::kFloat64, true, true);
}

TEST_P(AttentionGrid, BFloat16WithinTwicePlainError) {
  check_against_naive<BFloat16>(GetParam(), DType::kFloat32, false, false);
}

TEST_P(AttentionGrid, BFloat16DeterministicWithinTwicePlainError) {
  check_against_naive<BFloat16>(GetParam(), DType::kFloat32, false, true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionGrid, ::testing::ValuesIn(shape_grid()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name(); });

// Fewer shapes for the other element / grad page types.
TEST(AttentionCpu, Float32WithinTwicePlainError) {
  check_against_naive<float>(Case{77, 150, 64, 8, 2, 128, false, 0, 0, 7}, DType::kFloat32, false, false);
  check_against_naive<float>(Case{40, 200, 37, 7, 1, 64, true, 16, 4, 8}, DType::kFloat32, false, true);
}

TEST(AttentionCpu, Float16WithinTwicePlainError) {
  check_against_naive<Float16>(Case{77, 150, 64, 8, 2, 128, false, 0, 0, 9}, DType::kFloat32, false, false);
  check_against_naive<Float16>(Case{60, 130, 64, 4, 2, 96, false, 0, 0, 12}, DType::kFloat32, false, false);
  check_against_naive<Float16>(Case{30, 140, 128, 4, 1, 256, true, 16, 2, 13}, DType::kFloat32, false, true);
  check_against_naive<Float16>(Case{60, 130, 64, 8, 4, 256, false, 0, 0, 14, 2.f}, DType::kFloat32, false, false);
  check_against_naive<Float16>(Case{60, 130, 64, 8, 4, 128, false, 0, 0, 15, 0.f, 50}, DType::kFloat32, false, true);
  check_against_naive<Float16>(Case{60, 130, 64, 8, 4, 256, false, 0, 0, 16, 2.f, 100}, DType::kFloat32, false, false);
}

TEST(AttentionCpu, BFloat16GradPagesWithinTwicePlainError) {
  check_against_naive<BFloat16>(Case{50, 200, 64, 4, 1, 64, false, 0, 0, 10}, DType::kBFloat16, false, false);
  check_against_naive<BFloat16>(Case{50, 200, 37, 8, 1, 128, true, 16, 3, 11}, DType::kBFloat16, false, true);
  check_against_naive<BFloat16>(Case{50, 200, 64, 4, 1, 64, false, 0, 0, 17, 0.f, 90}, DType::kBFloat16, false, false);
}

// ---------------------------------------------------------------------------------------------
// Finite differences (fp64): the gradients are those of L = sum(out * dout).

TEST(AttentionCpu, BackwardMatchesFiniteDifferences) {
  for (const Case& c : {Case{5, 3, 2, 2, 1, 4, false, 0, 0, 21}, Case{6, 7, 2, 4, 2, 3, true, 2, 2, 22},
                        Case{3, 0, 4, 3, 3, 5, false, 0, 0, 23}, Case{5, 6, 4, 2, 1, 6, false, 0, 0, 24, 0.7f},
                        Case{6, 7, 2, 4, 2, 3, true, 2, 2, 25, 0.5f}, Case{5, 6, 4, 2, 1, 6, false, 0, 0, 26, 0.f, 4},
                        Case{6, 7, 2, 4, 2, 3, false, 0, 0, 27, 0.5f, 3}}) {
    SCOPED_TRACE(c.name());
    Problem problem = make_problem<double>(c, DType::kFloat64);
    const Result analytic = run_kernels<double>(problem, DType::kFloat64, true, /*deterministic=*/c.seed % 2 == 0);
    auto loss = [&]() {
      const Result forward = run_kernels<double>(problem, DType::kFloat64, false);
      double sum = 0.0;
      for (size_t i = 0; i < forward.out.size(); ++i) sum += forward.out[i] * problem.dout[i];
      return sum;
    };
    const double step = 1e-6;
    auto check = [&](std::vector<double>& inputs, const std::vector<double>& gradient, const char* name,
                     const std::vector<double>* initial, const std::vector<int32_t>* index_for_grad,
                     const std::vector<int32_t>* index_for_input) {
      // For history pages, element (token, head, d) of the input pool maps to the same element
      // of the grad pool through the respective page indices.
      auto visit = [&](int64_t input_offset, int64_t grad_offset) {
        const double saved = inputs[size_t(input_offset)];
        inputs[size_t(input_offset)] = saved + step;
        const double plus = loss();
        inputs[size_t(input_offset)] = saved - step;
        const double minus = loss();
        inputs[size_t(input_offset)] = saved;
        const double numeric = (plus - minus) / (2 * step);
        double value = gradient[size_t(grad_offset)];
        if (initial) value -= (*initial)[size_t(grad_offset)];
        EXPECT_NEAR(value, numeric, 1e-7 * std::max(1.0, std::fabs(numeric))) << name << " at " << input_offset;
      };
      if (!index_for_grad) {
        for (int64_t i = 0; i < int64_t(inputs.size()); ++i) visit(i, i);
        return;
      }
      for (int32_t t = 0; t < c.history_tokens; ++t) {
        for (int32_t kv_head = 0; kv_head < c.num_kv_heads; ++kv_head) {
          for (int32_t d = 0; d < c.head_dim; ++d) {
            visit(problem.history_offset(*index_for_input, t, kv_head) + d,
                  problem.history_offset(*index_for_grad, t, kv_head) + d);
          }
        }
      }
    };
    check(problem.q, analytic.dq, "dq", nullptr, nullptr, nullptr);
    check(problem.k_chunk, analytic.dk_chunk, "dk_chunk", nullptr, nullptr, nullptr);
    check(problem.v_chunk, analytic.dv_chunk, "dv_chunk", nullptr, nullptr, nullptr);
    check(problem.k_pool, analytic.dk_pool, "dk_pool", &problem.dk_pool_initial, &problem.dk_page_index,
          &problem.k_page_index);
    check(problem.v_pool, analytic.dv_pool, "dv_pool", &problem.dv_pool_initial, &problem.dv_page_index,
          &problem.v_page_index);
  }
}

// ---------------------------------------------------------------------------------------------
// In-place accumulation and untouched memory.

TEST(AttentionCpu, BackwardTwiceDoublesPageGrads) {
  Problem problem = make_problem<float>(Case{30, 100, 32, 4, 2, 64, false, 0, 0, 31}, DType::kFloat32);
  std::fill(problem.dk_pool_initial.begin(), problem.dk_pool_initial.end(), 0.0);
  std::fill(problem.dv_pool_initial.begin(), problem.dv_pool_initial.end(), 0.0);
  // Deterministic, so that the chunk's own gradients can be compared bit for bit below.
  const Result once = run_kernels<float>(problem, DType::kFloat32, true, /*deterministic=*/true);
  Problem again = problem;
  again.dk_pool_initial = once.dk_pool;
  again.dv_pool_initial = once.dv_pool;
  const Result twice = run_kernels<float>(again, DType::kFloat32, true, /*deterministic=*/true);
  ASSERT_GT(max_abs(once.dk_pool), 0.0);
  for (size_t i = 0; i < once.dk_pool.size(); ++i) {
    // Doubling is exact in floating point: g + g == 2 g bit for bit.
    EXPECT_EQ(twice.dk_pool[i], 2.0 * once.dk_pool[i]);
    EXPECT_EQ(twice.dv_pool[i], 2.0 * once.dv_pool[i]);
  }
  // The chunk's own gradients are overwritten, not accumulated.
  EXPECT_EQ(twice.dk_chunk, once.dk_chunk);
  EXPECT_EQ(twice.dq, once.dq);
}

TEST(AttentionCpu, UnselectedPagesAndRowsPastHistoryStayUntouched) {
  for (DType grad_type : {DType::kFloat32, DType::kBFloat16}) {
    // 5 pages of 16 (the last holds 9 rows); tile 0 selects page 3 only, tile 1 nothing.
    Problem problem = make_problem<BFloat16>(Case{20, 73, 16, 4, 2, 64, true, 10, 2, 41}, grad_type);
    problem.selected_pages = {3, -1, -1, -1};
    const Result result = run_kernels<BFloat16>(problem, grad_type, true);
    const PagedAttentionShape& s = problem.shape;
    std::vector<bool> touched(result.dk_pool.size(), false);
    for (int32_t t = 3 * 16; t < 4 * 16; ++t) {
      for (int32_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head) {
        for (int32_t d = 0; d < s.head_dim; ++d) touched[size_t(problem.history_offset(problem.dk_page_index, t, kv_head) + d)] = true;
      }
    }
    size_t changed = 0;
    for (size_t i = 0; i < touched.size(); ++i) {
      if (!touched[i]) {
        EXPECT_EQ(result.dk_pool[i], problem.dk_pool_initial[i]) << i;
      } else {
        changed += result.dk_pool[i] != problem.dk_pool_initial[i];
      }
    }
    EXPECT_GT(changed, 0u);
    // Dense: every row past history_tokens in the last page, and the unused pages, stay as they were.
    problem.selected_pages.clear();
    const Result dense = run_kernels<BFloat16>(problem, grad_type, true);
    std::vector<bool> history_row(result.dv_pool.size(), false);
    for (int32_t t = 0; t < s.history_tokens; ++t) {
      for (int32_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head) {
        for (int32_t d = 0; d < s.head_dim; ++d) history_row[size_t(problem.history_offset(problem.dv_page_index, t, kv_head) + d)] = true;
      }
    }
    for (size_t i = 0; i < history_row.size(); ++i) {
      if (!history_row[i]) {
        EXPECT_EQ(dense.dv_pool[i], problem.dv_pool_initial[i]) << i;
      }
    }
  }
}

// Note [Blocked history] in attention.h: the history in two blocks of pages (attend_chunk false,
// with null chunk pointers, which the kernels must neither read nor write) plus a chunk-only call,
// merged by lse, gives the single call's out and lse; the blocks' backwards, given the single
// call's out and lse, add the same dK/dV into the grad pages and sum to the same dq.
class BlockedHistory : public ::testing::TestWithParam<float> {};

TEST_P(BlockedHistory, MatchesOneCall) {
  // GetParam(): the logit soft-cap (0: none).
  const Problem p = make_problem<double>(Case{24, 70, 16, 4, 2, 32, false, 0, 0, 61, GetParam()}, DType::kFloat64);
  const PagedAttentionShape& s = p.shape;
  const Result whole = run_kernels<double>(p, DType::kFloat64, true);
  const size_t rows = size_t(s.num_q_heads) * s.chunk_tokens;
  const int32_t D = s.head_dim;

  // Blocks: pages [0, 2) (32 tokens), pages [2, 5) (38 tokens, the last page partial), the chunk.
  struct Part {
    int32_t first_page, end_page, history_tokens;
  };
  const Part parts[] = {{0, 2, 32}, {2, 5, 38}, {0, 0, 0}};
  std::vector<std::vector<double>> outs, lses;
  for (const Part& part : parts) {
    const bool chunk_only = part.end_page == 0;
    PagedAttentionForwardParams forward;
    forward.shape = s;
    forward.shape.history_tokens = part.history_tokens;
    forward.shape.attend_chunk = chunk_only;
    forward.q = p.q.data();
    forward.k_chunk = chunk_only ? p.k_chunk.data() : nullptr;
    forward.v_chunk = chunk_only ? p.v_chunk.data() : nullptr;
    forward.history = HistoryPages{p.k_pool.data(), p.k_page_index.data() + part.first_page, p.v_pool.data(),
                                   p.v_page_index.data() + part.first_page};
    outs.emplace_back(p.q.size());
    lses.emplace_back(rows);
    forward.out = outs.back().data();
    forward.lse = lses.back().data();
    ASSERT_EQ(cpu::paged_attention_forward(forward), 0);
  }
  for (size_t row = 0; row < rows; ++row) {
    const int32_t head = int32_t(row / s.chunk_tokens), token = int32_t(row % s.chunk_tokens);
    double top = -INFINITY;
    for (const auto& lse : lses) top = std::max(top, lse[row]);
    double sum = 0.0;
    for (const auto& lse : lses) sum += std::exp(lse[row] - top);
    const double merged_lse = top + std::log(sum);
    EXPECT_NEAR(merged_lse, whole.lse[row], 1e-12);
    for (int32_t d = 0; d < D; ++d) {
      const size_t index = (size_t(token) * s.num_q_heads + head) * D + d;
      double merged = 0.0;
      for (size_t part = 0; part < outs.size(); ++part) merged += std::exp(lses[part][row] - merged_lse) * outs[part][index];
      EXPECT_NEAR(merged, whole.out[index], 1e-12);
    }
  }

  // Backward of every part with the whole call's out and lse, into one pair of grad pools.
  std::vector<double> dk_pool = p.dk_pool_initial, dv_pool = p.dv_pool_initial;
  std::vector<double> dq_sum(p.q.size(), 0.0), dk_chunk(p.k_chunk.size(), NAN), dv_chunk(p.v_chunk.size(), NAN);
  for (const Part& part : parts) {
    const bool chunk_only = part.end_page == 0;
    PagedAttentionBackwardParams backward;
    backward.shape = s;
    backward.shape.history_tokens = part.history_tokens;
    backward.shape.attend_chunk = chunk_only;
    backward.q = p.q.data();
    backward.k_chunk = chunk_only ? p.k_chunk.data() : nullptr;
    backward.v_chunk = chunk_only ? p.v_chunk.data() : nullptr;
    backward.history = HistoryPages{p.k_pool.data(), p.k_page_index.data() + part.first_page, p.v_pool.data(),
                                    p.v_page_index.data() + part.first_page};
    backward.out = whole.out.data();
    backward.dout = p.dout.data();
    backward.lse = whole.lse.data();
    std::vector<double> dq(p.q.size(), NAN);
    backward.dq = dq.data();
    backward.dk_chunk = chunk_only ? dk_chunk.data() : nullptr;
    backward.dv_chunk = chunk_only ? dv_chunk.data() : nullptr;
    backward.grad_history = HistoryGradPages{dk_pool.data(), p.dk_page_index.data() + part.first_page, dv_pool.data(),
                                             p.dv_page_index.data() + part.first_page};
    backward.grad_page_dtype = DType::kFloat64;
    ASSERT_EQ(cpu::paged_attention_backward(backward), 0);
    for (size_t i = 0; i < dq.size(); ++i) dq_sum[i] += dq[i];
  }
  EXPECT_LE(max_abs_difference(dq_sum, whole.dq), 1e-12);
  EXPECT_LE(max_abs_difference(dk_chunk, whole.dk_chunk), 1e-12);
  EXPECT_LE(max_abs_difference(dv_chunk, whole.dv_chunk), 1e-12);
  EXPECT_LE(max_abs_difference(dk_pool, whole.dk_pool), 1e-12);
  EXPECT_LE(max_abs_difference(dv_pool, whole.dv_pool), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(SoftCaps, BlockedHistory, ::testing::Values(0.f, 0.8f),
                         [](const ::testing::TestParamInfo<float>& info) {
                           return info.param > 0.f ? std::string("softcap") : std::string("plain");
                         });

// A call without the chunk's keys and without history sees no key: out 0, lse -inf, and a
// backward that writes dq = 0 and touches nothing else.
TEST(AttentionCpu, RowsWithoutKeysGetZeroAndMinusInfinity) {
  const Problem p = make_problem<float>(Case{10, 0, 16, 4, 2, 32, false, 0, 0, 62}, DType::kFloat32);
  PagedAttentionForwardParams forward;
  forward.shape = p.shape;
  forward.shape.attend_chunk = false;
  const std::vector<float> q = pack<float>(p.q), dout = pack<float>(p.dout);
  std::vector<float> out(q.size(), NAN), lse(size_t(p.shape.num_q_heads) * p.shape.chunk_tokens, NAN);
  forward.q = q.data();
  forward.out = out.data();
  forward.lse = lse.data();
  ASSERT_EQ(cpu::paged_attention_forward(forward), 0);
  for (float value : out) EXPECT_EQ(value, 0.f);
  for (float value : lse) EXPECT_EQ(value, -INFINITY);
  PagedAttentionBackwardParams backward;
  backward.shape = forward.shape;
  backward.q = q.data();
  backward.out = out.data();
  backward.dout = dout.data();
  backward.lse = lse.data();
  std::vector<float> dq(q.size(), NAN);
  backward.dq = dq.data();
  ASSERT_EQ(cpu::paged_attention_backward(backward), 0);
  for (float value : dq) EXPECT_EQ(value, 0.f);
  // With the chunk's keys, null chunk pointers are an error.
  forward.shape.attend_chunk = true;
  EXPECT_EQ(cpu::paged_attention_forward(forward), kCpuInvalidArgument);
}

TEST(AttentionCpu, BackwardIsDeterministic) {
  const Problem problem = make_problem<BFloat16>(Case{100, 300, 64, 8, 2, 64, false, 0, 0, 51}, DType::kFloat32);
  const Result first = run_kernels<BFloat16>(problem, DType::kFloat32, true, /*deterministic=*/true);
  const Result second = run_kernels<BFloat16>(problem, DType::kFloat32, true, /*deterministic=*/true);
  EXPECT_EQ(first.dq, second.dq);
  EXPECT_EQ(first.dk_chunk, second.dk_chunk);
  EXPECT_EQ(first.dk_pool, second.dk_pool);
  EXPECT_EQ(first.dv_pool, second.dv_pool);
  // The two dq strategies agree to rounding.
  const Result fast = run_kernels<BFloat16>(problem, DType::kFloat32, true, /*deterministic=*/false);
  EXPECT_EQ(fast.dk_pool, first.dk_pool);
  EXPECT_EQ(fast.dk_chunk, first.dk_chunk);
  EXPECT_LE(max_abs_difference(fast.dq, first.dq), 1e-2 * max_abs(first.dq));
}

// ---------------------------------------------------------------------------------------------
// Parameter checks.

PagedAttentionShape good_shape() {
  PagedAttentionShape shape;
  shape.chunk_tokens = 16;
  shape.history_tokens = 40;
  shape.page_tokens = 16;
  shape.num_q_heads = 8;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  shape.softmax_scale = 0.125f;
  shape.dtype = DType::kBFloat16;
  return shape;
}

TEST(AttentionCpu, CheckShapeRejectsBadShapes) {
  EXPECT_STREQ(paged_attention_check_shape(good_shape()), "");
  auto rejected = [](auto change) {
    PagedAttentionShape shape = good_shape();
    change(shape);
    return std::string(paged_attention_check_shape(shape));
  };
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.chunk_tokens = 0; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.history_tokens = -1; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.page_tokens = 0; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.num_kv_heads = 0; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.num_q_heads = 7; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.head_dim = 0; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.head_dim = 512; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.softmax_scale = 0.f; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.logit_softcap = -1.f; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.logit_softcap = std::numeric_limits<float>::infinity(); }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.logit_softcap = std::numeric_limits<float>::quiet_NaN(); }), "");
  EXPECT_EQ(rejected([](PagedAttentionShape& s) { s.logit_softcap = 30.f; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.softmax_scale = std::numeric_limits<float>::infinity(); }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.softmax_scale = std::numeric_limits<float>::quiet_NaN(); }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.dtype = static_cast<DType>(9); }), "");
  // Note [Sliding window] in attention.h: W >= 0, and a window needs the chunk in the call.
  EXPECT_NE(rejected([](PagedAttentionShape& s) { s.sliding_window = -1; }), "");
  EXPECT_EQ(rejected([](PagedAttentionShape& s) { s.sliding_window = 1; }), "");
  EXPECT_EQ(rejected([](PagedAttentionShape& s) { s.attend_chunk = false; }), "");
  EXPECT_NE(rejected([](PagedAttentionShape& s) {
              s.sliding_window = 4096;
              s.attend_chunk = false;
            }),
            "");
}

TEST(AttentionCpu, SelectionCheckRejectsBadSelections) {
  const PagedAttentionShape shape = good_shape();  // 3 history pages, tiles of 8 -> 2 tiles
  std::vector<int32_t> pages = {0, 2, -1, 1, -1, -1};
  EXPECT_STREQ(page_selection_check(shape, PageSelection{pages.data(), 3, 8}), "");
  EXPECT_STREQ(page_selection_check(shape, PageSelection{}), "");
  std::vector<int32_t> past_end = {0, 3, -1, 1, -1, -1};
  EXPECT_STRNE(page_selection_check(shape, PageSelection{past_end.data(), 3, 8}), "");
  std::vector<int32_t> twice = {1, 1, -1, 1, -1, -1};
  EXPECT_STRNE(page_selection_check(shape, PageSelection{twice.data(), 3, 8}), "");
  std::vector<int32_t> negative = {0, -2, -1, 1, -1, -1};
  EXPECT_STRNE(page_selection_check(shape, PageSelection{negative.data(), 3, 8}), "");
  EXPECT_STRNE(page_selection_check(shape, PageSelection{pages.data(), 0, 8}), "");
  EXPECT_STRNE(page_selection_check(shape, PageSelection{pages.data(), 3, 0}), "");
  // A sliding window with a sparse selection is refused (Note [Sliding window] in attention.h).
  PagedAttentionShape windowed = shape;
  windowed.sliding_window = 16;
  EXPECT_STRNE(page_selection_check(windowed, PageSelection{pages.data(), 3, 8}), "");
  EXPECT_STREQ(page_selection_check(windowed, PageSelection{}), "");
}

TEST(AttentionCpu, KernelsRejectBadParamsWithoutWriting) {
  const Problem problem = make_problem<float>(Case{16, 40, 16, 8, 2, 64, false, 0, 0, 61}, DType::kFloat32);
  std::vector<float> q = pack<float>(problem.q), k = pack<float>(problem.k_chunk), v = pack<float>(problem.v_chunk);
  std::vector<float> pool_k = pack<float>(problem.k_pool), pool_v = pack<float>(problem.v_pool);
  std::vector<float> out(q.size(), 7.f), lse(size_t(8 * 16), 7.f);
  PagedAttentionForwardParams params;
  params.shape = problem.shape;
  params.shape.num_q_heads = 6;  // six q heads cannot share four kv heads evenly
  params.shape.num_kv_heads = 4;
  params.q = q.data();
  params.k_chunk = k.data();
  params.v_chunk = v.data();
  params.history = HistoryPages{pool_k.data(), problem.k_page_index.data(), pool_v.data(), problem.v_page_index.data()};
  params.out = out.data();
  params.lse = lse.data();
  EXPECT_EQ(cpu::paged_attention_forward(params), kCpuInvalidArgument);
  params.shape = problem.shape;
  std::vector<int32_t> selection = {0, 5, 1, 2};  // page 5 does not exist
  params.selection = PageSelection{selection.data(), 2, 8};
  EXPECT_EQ(cpu::paged_attention_forward(params), kCpuInvalidArgument);
  params.selection = PageSelection{};
  params.history.k_pool = nullptr;
  EXPECT_EQ(cpu::paged_attention_forward(params), kCpuInvalidArgument);
  for (float value : out) ASSERT_EQ(value, 7.f);
  for (float value : lse) ASSERT_EQ(value, 7.f);
}

// ---------------------------------------------------------------------------------------------
// Page summaries and selection.

TEST(AttentionCpu, PageSummaryMatchesNaive) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Case c{4, 75, 16, 4, 2, 8, false, 0, 0, 71};
    const Problem problem = dtype == DType::kFloat32 ? make_problem<float>(c, DType::kFloat32)
                                                     : make_problem<BFloat16>(c, DType::kFloat32);
    std::vector<float> pool_f32 = pack<float>(problem.k_pool);
    std::vector<BFloat16> pool_bf16 = pack<BFloat16>(problem.k_pool);
    const int32_t num_pages = problem.shape.num_history_pages();
    const size_t size = size_t(num_pages) * c.num_kv_heads * c.head_dim;
    std::vector<float> mean(size), low(size), high(size);
    PageSummaryParams params;
    params.shape = problem.shape;
    params.shape.dtype = dtype;
    params.k_pool = dtype == DType::kFloat32 ? static_cast<const void*>(pool_f32.data()) : pool_bf16.data();
    params.k_page_index = problem.k_page_index.data();
    params.mean = mean.data();
    params.min = low.data();
    params.max = high.data();
    ASSERT_EQ(cpu::page_summary(params), 0);
    for (int32_t page = 0; page < num_pages; ++page) {
      const int32_t rows = std::min(16, 75 - page * 16);
      for (int32_t kv_head = 0; kv_head < c.num_kv_heads; ++kv_head) {
        for (int32_t d = 0; d < c.head_dim; ++d) {
          double sum = 0, lowest = 1e300, highest = -1e300;
          for (int32_t row = 0; row < rows; ++row) {
            const double value = problem.k_pool[size_t(problem.history_offset(problem.k_page_index, page * 16 + row, kv_head) + d)];
            sum += value;
            lowest = std::min(lowest, value);
            highest = std::max(highest, value);
          }
          const size_t at = size_t((page * c.num_kv_heads + kv_head) * c.head_dim + d);
          EXPECT_NEAR(mean[at], sum / rows, 1e-6);
          EXPECT_EQ(low[at], float(lowest));
          EXPECT_EQ(high[at], float(highest));
        }
      }
    }
  }
}

TEST(AttentionCpu, PageSelectMatchesNaive) {
  const Case c{45, 200, 16, 8, 2, 16, false, 0, 0, 81};
  const Problem problem = make_problem<float>(c, DType::kFloat32);
  const int32_t num_pages = problem.shape.num_history_pages();  // 13
  std::mt19937 generator(5);
  std::normal_distribution<float> normal;
  const size_t size = size_t(num_pages) * c.num_kv_heads * c.head_dim;
  std::vector<float> mean(size), low(size), high(size);
  for (size_t i = 0; i < size; ++i) {
    mean[i] = normal(generator);
    const float a = normal(generator), b = normal(generator);
    low[i] = std::min(a, b);
    high[i] = std::max(a, b);
  }
  std::vector<float> q = pack<float>(problem.q);
  for (bool use_bounds : {false, true}) {
    for (int32_t top_k : {1, 4, 13, 20}) {
      const int32_t tile_tokens = 20, num_tiles = 3;
      std::vector<int32_t> selected(size_t(num_tiles) * top_k, 99);
      PageSelectParams params;
      params.shape = problem.shape;
      params.q = q.data();
      params.mean = mean.data();
      params.min = low.data();
      params.max = high.data();
      params.use_bounds = use_bounds;
      params.top_k = top_k;
      params.query_tile_tokens = tile_tokens;
      params.selected_pages = selected.data();
      ASSERT_EQ(cpu::page_select(params), 0);
      for (int32_t tile = 0; tile < num_tiles; ++tile) {
        const int32_t begin = tile * tile_tokens, end = std::min(c.chunk_tokens, begin + tile_tokens);
        std::vector<std::pair<double, int32_t>> scored;
        for (int32_t page = 0; page < num_pages; ++page) {
          double score = 0;
          for (int32_t head = 0; head < c.num_q_heads; ++head) {
            for (int32_t d = 0; d < c.head_dim; ++d) {
              double query = 0;
              for (int32_t t = begin; t < end; ++t) query += problem.q[size_t((t * c.num_q_heads + head) * c.head_dim + d)];
              query /= (end - begin);
              const size_t at = size_t((page * c.num_kv_heads + head / 4) * c.head_dim + d);
              score += use_bounds ? std::max(query * low[at], query * high[at]) : query * mean[at];
            }
          }
          scored.push_back({-score, page});
        }
        std::sort(scored.begin(), scored.end());
        std::vector<int32_t> expected;
        for (int32_t i = 0; i < std::min(top_k, num_pages); ++i) expected.push_back(scored[size_t(i)].second);
        std::sort(expected.begin(), expected.end());
        expected.resize(size_t(top_k), -1);
        const std::vector<int32_t> got(selected.begin() + tile * top_k, selected.begin() + (tile + 1) * top_k);
        EXPECT_EQ(got, expected) << "tile " << tile << " top_k " << top_k << " bounds " << use_bounds;
      }
    }
  }
}

}  // namespace
}  // namespace membar::kernels
