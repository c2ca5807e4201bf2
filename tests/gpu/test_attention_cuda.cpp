// The CUDA paged-attention kernels (membar::kernels::cuda::*) against the CPU reference
// (membar::kernels::cpu::*) on fresh random inputs.
//
// Error bounds follow FlashAttention's rule: the CUDA result's error against an fp64 reference
// ("truth": the CPU kernel on the same, already rounded, inputs in float64) may be at most twice
// the error of the CPU kernel run in the same precision as the GPU (bf16/fp16 inputs, fp32
// accumulation), plus a small absolute slack for the bf16 rounding of P and dS that the tensor
// cores need and the CPU kernel does not do.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "membar/kernels/attention.h"
#include "membar/kernels/attention_cuda.h"
#include "membar/kernels/half_types.h"

namespace {

namespace mk = membar::kernels;
using mk::DType;

// ---------------------------------------------------------------------------------------------
// Host helpers.

uint16_t encode_16(float value, DType dtype) {
  return dtype == DType::kBFloat16 ? mk::float_to_bfloat16(value).bits : mk::float_to_float16(value).bits;
}
float decode_16(uint16_t bits, DType dtype) {
  if (dtype == DType::kBFloat16) return mk::bfloat16_to_float(mk::BFloat16{bits});
  return mk::float16_to_float(mk::Float16{bits});
}

// Random values rounded to `dtype` (kept as float so that every precision sees the same inputs).
std::vector<float> random_values(size_t count, DType dtype, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> values(count);
  for (float& value : values) value = decode_16(encode_16(normal(rng), dtype), dtype);
  return values;
}

std::vector<uint16_t> encode_all(const std::vector<float>& values, DType dtype) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = encode_16(values[i], dtype);
  return bits;
}
std::vector<double> widen(const std::vector<float>& values) { return {values.begin(), values.end()}; }

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (cudaMalloc(&pointer_, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) pointer_ = nullptr;
  }
  explicit DeviceBuffer(const std::vector<T>& values) : DeviceBuffer(values.size()) { upload(values); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(pointer_); }
  void upload(const std::vector<T>& values) {
    cudaMemcpy(pointer_, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> values(count_);
    cudaMemcpy(values.data(), pointer_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
    return values;
  }
  T* get() const { return pointer_; }

 private:
  T* pointer_ = nullptr;
  size_t count_ = 0;
};

double max_abs(const std::vector<double>& values) {
  double result = 0.0;
  for (double value : values) result = std::max(result, std::abs(value));
  return result;
}
double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double result = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double difference = std::abs(a[i] - b[i]);
    if (std::isnan(difference)) return INFINITY;
    result = std::max(result, difference);
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// One random problem.

struct Case {
  const char* name;
  int chunk_tokens;
  int history_tokens;
  int page_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int query_tile_tokens;  // 0: dense
  int top_k;
  DType grad_page_dtype;
  DType dtype;
  float logit_softcap = 0.f;  // Note [Soft-capped scores] in attention.h; 0: none
  float scale_factor = 1.f;   // softmax_scale = scale_factor / sqrt(head_dim): > 1 makes |s| >> cap
  bool attend_chunk = true;   // false: history only (Note [Blocked history])
  int32_t sliding_window = 0;  // Note [Sliding window] in attention.h; 0: none
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Problem {
  Case c;
  mk::PagedAttentionShape shape;
  int num_pages = 0;
  int pool_pages = 0;
  int num_tiles = 0;
  std::vector<float> q, k_chunk, v_chunk, dout;          // [Tc, H, D]
  std::vector<float> k_pool, v_pool;                      // [pool_pages, page, Hkv, D]
  std::vector<float> dk_pool_initial, dv_pool_initial;    // rounded to the grad page dtype
  std::vector<int32_t> k_index, v_index, dk_index, dv_index;
  std::vector<int32_t> selection;                         // [num_tiles, top_k]
};

// Pages land at random pool rows, K and V and their gradients each in their own order, so that
// a kernel mixing up the indices cannot pass.
std::vector<int32_t> random_page_index(int num_pages, int pool_pages, std::mt19937& rng) {
  std::vector<int32_t> rows(static_cast<size_t>(pool_pages));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(size_t(num_pages));
  return rows;
}

Problem make_problem(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.c = c;
  p.shape.chunk_tokens = c.chunk_tokens;
  p.shape.history_tokens = c.history_tokens;
  p.shape.page_tokens = c.page_tokens;
  p.shape.num_q_heads = c.num_q_heads;
  p.shape.num_kv_heads = c.num_kv_heads;
  p.shape.head_dim = c.head_dim;
  p.shape.softmax_scale = c.scale_factor / std::sqrt(float(c.head_dim));
  p.shape.dtype = c.dtype;
  p.shape.logit_softcap = c.logit_softcap;
  p.shape.attend_chunk = c.attend_chunk;
  p.shape.sliding_window = c.sliding_window;
  p.num_pages = p.shape.num_history_pages();
  p.pool_pages = p.num_pages + 3;
  const size_t q_elements = size_t(c.chunk_tokens) * c.num_q_heads * c.head_dim;
  const size_t kv_elements = size_t(c.chunk_tokens) * c.num_kv_heads * c.head_dim;
  const size_t pool_elements = size_t(p.pool_pages) * c.page_tokens * c.num_kv_heads * c.head_dim;
  // Scores of order 1-3 so that softmax is neither flat nor one-hot.
  p.q = random_values(q_elements, c.dtype, rng, 1.5f);
  p.k_chunk = random_values(kv_elements, c.dtype, rng);
  p.v_chunk = random_values(kv_elements, c.dtype, rng);
  p.dout = random_values(q_elements, c.dtype, rng);
  p.k_pool = random_values(pool_elements, c.dtype, rng);
  p.v_pool = random_values(pool_elements, c.dtype, rng);
  const DType grad_round = c.grad_page_dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  p.dk_pool_initial = random_values(pool_elements, grad_round, rng, 0.1f);
  p.dv_pool_initial = random_values(pool_elements, grad_round, rng, 0.1f);
  p.k_index = random_page_index(p.num_pages, p.pool_pages, rng);
  p.v_index = random_page_index(p.num_pages, p.pool_pages, rng);
  p.dk_index = random_page_index(p.num_pages, p.pool_pages, rng);
  p.dv_index = random_page_index(p.num_pages, p.pool_pages, rng);
  if (c.query_tile_tokens > 0) {
    p.num_tiles = mk::num_query_tiles(c.chunk_tokens, c.query_tile_tokens);
    p.selection.assign(size_t(p.num_tiles) * c.top_k, -1);
    for (int tile = 0; tile < p.num_tiles; ++tile) {
      // Up to top_k - 1 distinct pages (one slot stays padding), in random slot order.
      std::vector<int32_t> pages(static_cast<size_t>(p.num_pages));
      std::iota(pages.begin(), pages.end(), 0);
      std::shuffle(pages.begin(), pages.end(), rng);
      const int take = std::min(p.num_pages, c.top_k - 1);
      std::vector<int32_t> row(size_t(c.top_k), -1);
      for (int i = 0; i < take; ++i) row[size_t(i)] = pages[size_t(i)];
      std::shuffle(row.begin(), row.end(), rng);
      std::copy(row.begin(), row.end(), p.selection.begin() + int64_t(tile) * c.top_k);
    }
  }
  return p;
}

mk::PageSelection selection_of(const Problem& p, const int32_t* pages) {
  mk::PageSelection selection;
  if (p.c.query_tile_tokens > 0) {
    selection.selected_pages = pages;
    selection.selected_per_tile = p.c.top_k;
    selection.query_tile_tokens = p.c.query_tile_tokens;
  }
  return selection;
}

// All results as double: out, lse, dq, dk_chunk, dv_chunk, and the whole grad pools.
struct Results {
  std::vector<double> out, lse, dq, dk, dv, dk_pool, dv_pool;
};

// The CPU reference: in float64 (truth) or in the problem's own precision (baseline).
Results run_cpu(const Problem& p, bool float64) {
  Results r;
  const size_t q_elements = p.q.size(), kv_elements = p.k_chunk.size(), pool_elements = p.k_pool.size();
  const size_t lse_elements = size_t(p.c.num_q_heads) * p.c.chunk_tokens;
  mk::PagedAttentionShape shape = p.shape;
  mk::PagedAttentionForwardParams forward;
  mk::PagedAttentionBackwardParams backward;
  const mk::PageSelection selection = selection_of(p, p.selection.data());
  std::vector<double> q64, k64, v64, do64, kp64, vp64, out64(q_elements), lse64(lse_elements), dq64(q_elements),
      dk64(kv_elements), dv64(kv_elements), dkp64, dvp64;
  std::vector<uint16_t> q16, k16, v16, do16, kp16, vp16, out16(q_elements), dq16(q_elements), dk16(kv_elements),
      dv16(kv_elements), dkp16, dvp16;
  std::vector<float> lse32(lse_elements), dkp32, dvp32;
  const DType dtype = p.c.dtype;
  if (float64) {
    shape.dtype = DType::kFloat64;
    q64 = widen(p.q), k64 = widen(p.k_chunk), v64 = widen(p.v_chunk), do64 = widen(p.dout);
    kp64 = widen(p.k_pool), vp64 = widen(p.v_pool);
    dkp64 = widen(p.dk_pool_initial), dvp64 = widen(p.dv_pool_initial);
    forward.q = q64.data(), forward.k_chunk = k64.data(), forward.v_chunk = v64.data();
    forward.history.k_pool = kp64.data(), forward.history.v_pool = vp64.data();
    forward.out = out64.data(), forward.lse = lse64.data();
    backward.dout = do64.data(), backward.dq = dq64.data(), backward.dk_chunk = dk64.data();
    backward.dv_chunk = dv64.data();
    backward.grad_history.dk_pool = dkp64.data(), backward.grad_history.dv_pool = dvp64.data();
    backward.grad_page_dtype = DType::kFloat64;
  } else {
    q16 = encode_all(p.q, dtype), k16 = encode_all(p.k_chunk, dtype), v16 = encode_all(p.v_chunk, dtype);
    do16 = encode_all(p.dout, dtype), kp16 = encode_all(p.k_pool, dtype), vp16 = encode_all(p.v_pool, dtype);
    forward.q = q16.data(), forward.k_chunk = k16.data(), forward.v_chunk = v16.data();
    forward.history.k_pool = kp16.data(), forward.history.v_pool = vp16.data();
    forward.out = out16.data(), forward.lse = lse32.data();
    backward.dout = do16.data(), backward.dq = dq16.data(), backward.dk_chunk = dk16.data();
    backward.dv_chunk = dv16.data();
    backward.grad_page_dtype = p.c.grad_page_dtype;
    if (p.c.grad_page_dtype == DType::kFloat32) {
      dkp32 = p.dk_pool_initial, dvp32 = p.dv_pool_initial;
      backward.grad_history.dk_pool = dkp32.data(), backward.grad_history.dv_pool = dvp32.data();
    } else {
      dkp16 = encode_all(p.dk_pool_initial, DType::kBFloat16), dvp16 = encode_all(p.dv_pool_initial, DType::kBFloat16);
      backward.grad_history.dk_pool = dkp16.data(), backward.grad_history.dv_pool = dvp16.data();
    }
  }
  forward.shape = shape;
  forward.history.k_page_index = p.k_index.data(), forward.history.v_page_index = p.v_index.data();
  forward.selection = selection;
  EXPECT_EQ(0, mk::cpu::paged_attention_forward(forward));
  backward.shape = shape;
  backward.q = forward.q, backward.k_chunk = forward.k_chunk, backward.v_chunk = forward.v_chunk;
  backward.history = forward.history;
  backward.selection = selection;
  backward.out = forward.out, backward.lse = forward.lse;
  backward.grad_history.dk_page_index = p.dk_index.data(), backward.grad_history.dv_page_index = p.dv_index.data();
  EXPECT_EQ(0, mk::cpu::paged_attention_backward(backward));

  if (float64) {
    r.out = out64, r.lse = lse64, r.dq = dq64, r.dk = dk64, r.dv = dv64, r.dk_pool = dkp64, r.dv_pool = dvp64;
  } else {
    auto decode = [&](const std::vector<uint16_t>& bits, DType t) {
      std::vector<double> values(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) values[i] = decode_16(bits[i], t);
      return values;
    };
    r.out = decode(out16, dtype), r.dq = decode(dq16, dtype), r.dk = decode(dk16, dtype), r.dv = decode(dv16, dtype);
    r.lse = widen(lse32);
    if (p.c.grad_page_dtype == DType::kFloat32) {
      r.dk_pool = widen(dkp32), r.dv_pool = widen(dvp32);
    } else {
      r.dk_pool = decode(dkp16, DType::kBFloat16), r.dv_pool = decode(dvp16, DType::kBFloat16);
    }
  }
  (void)pool_elements;
  return r;
}

// The CUDA kernels; `raw` receives the bytes of dq, dk, dv and both grad pools (for bit checks).
struct RawBits {
  std::vector<uint16_t> dq, dk, dv;
  std::vector<uint8_t> dk_pool, dv_pool;
};

Results run_gpu(const Problem& p, bool deterministic, RawBits* raw = nullptr, const mk::CudaOptions& options = {}) {
  Results r;
  const DType dtype = p.c.dtype;
  const size_t q_elements = p.q.size(), kv_elements = p.k_chunk.size(), pool_elements = p.k_pool.size();
  const size_t lse_elements = size_t(p.c.num_q_heads) * p.c.chunk_tokens;
  DeviceBuffer<uint16_t> q(encode_all(p.q, dtype)), k(encode_all(p.k_chunk, dtype)), v(encode_all(p.v_chunk, dtype));
  DeviceBuffer<uint16_t> dout(encode_all(p.dout, dtype));
  DeviceBuffer<uint16_t> k_pool(encode_all(p.k_pool, dtype)), v_pool(encode_all(p.v_pool, dtype));
  DeviceBuffer<int32_t> k_index(p.k_index), v_index(p.v_index), dk_index(p.dk_index), dv_index(p.dv_index);
  DeviceBuffer<int32_t> selected(p.selection);
  // dk and dv start at zero: a call without attend_chunk must leave them so.
  DeviceBuffer<uint16_t> out(q_elements), dq(q_elements);
  DeviceBuffer<uint16_t> dk(std::vector<uint16_t>(kv_elements, 0)), dv(std::vector<uint16_t>(kv_elements, 0));
  DeviceBuffer<float> lse(lse_elements);
  const bool fp32_pages = p.c.grad_page_dtype == DType::kFloat32;
  const size_t page_bytes = pool_elements * (fp32_pages ? 4 : 2);
  std::vector<uint8_t> dk_initial(page_bytes), dv_initial(page_bytes);
  if (fp32_pages) {
    std::memcpy(dk_initial.data(), p.dk_pool_initial.data(), page_bytes);
    std::memcpy(dv_initial.data(), p.dv_pool_initial.data(), page_bytes);
  } else {
    const auto dk_bits = encode_all(p.dk_pool_initial, DType::kBFloat16);
    const auto dv_bits = encode_all(p.dv_pool_initial, DType::kBFloat16);
    std::memcpy(dk_initial.data(), dk_bits.data(), page_bytes);
    std::memcpy(dv_initial.data(), dv_bits.data(), page_bytes);
  }
  DeviceBuffer<uint8_t> dk_pool(dk_initial), dv_pool(dv_initial);
  DeviceBuffer<uint8_t> workspace(mk::cuda::paged_attention_backward_workspace_bytes(p.shape));
  const mk::PageSelection selection = selection_of(p, selected.get());

  mk::PagedAttentionForwardParams forward;
  forward.shape = p.shape;
  // Without attend_chunk the chunk's K and V may be null (Note [Blocked history]): pass null.
  const bool chunk = p.shape.attend_chunk;
  forward.q = q.get(), forward.k_chunk = chunk ? k.get() : nullptr, forward.v_chunk = chunk ? v.get() : nullptr;
  forward.history = {k_pool.get(), k_index.get(), v_pool.get(), v_index.get()};
  forward.selection = selection;
  forward.out = out.get(), forward.lse = lse.get();
  EXPECT_EQ(0, mk::cuda::paged_attention_forward(forward, nullptr, options));
  mk::PagedAttentionBackwardParams backward;
  backward.shape = p.shape;
  backward.q = q.get(), backward.k_chunk = forward.k_chunk, backward.v_chunk = forward.v_chunk;
  backward.history = forward.history;
  backward.selection = selection;
  backward.out = out.get(), backward.dout = dout.get(), backward.lse = lse.get();
  backward.dq = dq.get(), backward.dk_chunk = dk.get(), backward.dv_chunk = dv.get();
  backward.grad_history = {dk_pool.get(), dk_index.get(), dv_pool.get(), dv_index.get()};
  backward.grad_page_dtype = p.c.grad_page_dtype;
  backward.deterministic = deterministic;
  backward.workspace = workspace.get();
  EXPECT_EQ(0, mk::cuda::paged_attention_backward(backward, nullptr, options));
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());

  auto decode = [&](const std::vector<uint16_t>& bits, DType t) {
    std::vector<double> values(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) values[i] = decode_16(bits[i], t);
    return values;
  };
  const auto dq_bits = dq.download(), dk_bits = dk.download(), dv_bits = dv.download();
  r.out = decode(out.download(), dtype), r.dq = decode(dq_bits, dtype), r.dk = decode(dk_bits, dtype);
  r.dv = decode(dv_bits, dtype);
  r.lse = widen(lse.download());
  const auto dk_pool_bytes = dk_pool.download(), dv_pool_bytes = dv_pool.download();
  auto pool_values = [&](const std::vector<uint8_t>& bytes) {
    std::vector<double> values(pool_elements);
    for (size_t i = 0; i < pool_elements; ++i) {
      if (fp32_pages) {
        float value;
        std::memcpy(&value, bytes.data() + 4 * i, 4);
        values[i] = value;
      } else {
        uint16_t bits;
        std::memcpy(&bits, bytes.data() + 2 * i, 2);
        values[i] = decode_16(bits, DType::kBFloat16);
      }
    }
    return values;
  };
  r.dk_pool = pool_values(dk_pool_bytes), r.dv_pool = pool_values(dv_pool_bytes);
  if (raw != nullptr) *raw = {dq_bits, dk_bits, dv_bits, dk_pool_bytes, dv_pool_bytes};
  return r;
}

// Pool elements that belong to valid history rows (everything else must stay untouched).
std::vector<bool> used_pool_elements(const Problem& p, const std::vector<int32_t>& index) {
  const size_t row_elements = size_t(p.c.num_kv_heads) * p.c.head_dim;
  std::vector<bool> used(p.k_pool.size(), false);
  for (int token = 0; token < p.c.history_tokens; ++token) {
    const size_t row = size_t(index[size_t(token / p.c.page_tokens)]) * p.c.page_tokens + token % p.c.page_tokens;
    std::fill(used.begin() + row * row_elements, used.begin() + (row + 1) * row_elements, true);
  }
  return used;
}
std::vector<double> pick(const std::vector<double>& values, const std::vector<bool>& mask, bool keep) {
  std::vector<double> result;
  for (size_t i = 0; i < values.size(); ++i) {
    if (mask[i] == keep) result.push_back(values[i]);
  }
  return result;
}

void expect_close(const char* what, const std::vector<double>& gpu, const std::vector<double>& baseline,
                  const std::vector<double>& truth, double slack) {
  ASSERT_EQ(gpu.size(), truth.size()) << what;
  const double gpu_error = max_abs_difference(gpu, truth);
  const double baseline_error = max_abs_difference(baseline, truth);
  const double bound = 2.0 * baseline_error + slack * std::max(1.0, max_abs(truth));
  std::printf("  %-8s gpu error %.3e, cpu same-precision error %.3e, bound %.3e, max |truth| %.3e\n", what, gpu_error,
              baseline_error, bound, max_abs(truth));
  EXPECT_LE(gpu_error, bound) << what << ": CUDA error " << gpu_error << " vs CPU same-precision error "
                              << baseline_error;
}

class PagedAttentionCuda : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(PagedAttentionCuda, ForwardAndBackwardMatchReference) {
  const Case c = GetParam();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::printf("[%s] seed %u\n", c.name, seed);
  const Problem p = make_problem(c, seed);
  const Results truth = run_cpu(p, true);
  const Results baseline = run_cpu(p, false);
  // The tensor cores take P and dS in 16-bit: allow a rounding step of that size on top.
  const double slack = c.dtype == DType::kBFloat16 ? 4e-3 : 1e-3;
  const std::vector<bool> dk_used = used_pool_elements(p, p.dk_index);
  const std::vector<bool> dv_used = used_pool_elements(p, p.dv_index);
  if (c.logit_softcap > 0.f) {
    // A case whose cap bends no score would test nothing: without the cap the output differs.
    Problem uncapped = p;
    uncapped.shape.logit_softcap = 0.f;
    const Results plain = run_cpu(uncapped, true);
    EXPECT_GT(max_abs_difference(plain.out, truth.out), 0.02 * max_abs(truth.out)) << "the cap hardly matters here";
  }
  if (c.sliding_window > 0 && c.sliding_window < c.history_tokens + c.chunk_tokens) {
    // A window that hides keys must change the answer (else a kernel ignoring it would pass).
    Problem unwindowed = p;
    unwindowed.shape.sliding_window = 0;
    const Results plain = run_cpu(unwindowed, true);
    EXPECT_GT(max_abs_difference(plain.out, truth.out), 0.02 * max_abs(truth.out)) << "the window hardly matters here";
    EXPECT_GT(max_abs_difference(plain.dq, truth.dq), 0.02 * max_abs(truth.dq)) << "the window hardly matters here";
  }
  for (bool deterministic : {false, true}) {
    std::printf(" deterministic=%d\n", int(deterministic));
    const Results gpu = run_gpu(p, deterministic);
    expect_close("out", gpu.out, baseline.out, truth.out, slack);
    expect_close("lse", gpu.lse, baseline.lse, truth.lse, 1e-4);
    expect_close("dq", gpu.dq, baseline.dq, truth.dq, slack);
    expect_close("dk", gpu.dk, baseline.dk, truth.dk, slack);
    expect_close("dv", gpu.dv, baseline.dv, truth.dv, slack);
    if (c.history_tokens > 0) {
      expect_close("dk_pages", pick(gpu.dk_pool, dk_used, true), pick(baseline.dk_pool, dk_used, true),
                   pick(truth.dk_pool, dk_used, true), slack);
      expect_close("dv_pages", pick(gpu.dv_pool, dv_used, true), pick(baseline.dv_pool, dv_used, true),
                   pick(truth.dv_pool, dv_used, true), slack);
    }
    // Rows past the history (the partial last page, unused pool rows) are left untouched.
    const std::vector<double> initial_dk = widen(p.dk_pool_initial), initial_dv = widen(p.dv_pool_initial);
    EXPECT_EQ(pick(initial_dk, dk_used, false), pick(gpu.dk_pool, dk_used, false));
    EXPECT_EQ(pick(initial_dv, dv_used, false), pick(gpu.dv_pool, dv_used, false));
  }
  {
    // The dQ pass before the warp-specialised one (Note [Warp-specialised dQ pass]), which the
    // deterministic backward above ran where it fits: the other stays checked too.
    std::printf(" deterministic, warpgroup dQ pass\n");
    mk::CudaOptions options;
    options.dq_pass = mk::DqPass::kWarpgroup;
    const Results other = run_gpu(p, true, nullptr, options);
    expect_close("dq warpgroup pass", other.dq, baseline.dq, truth.dq, slack);
    expect_close("dk warpgroup pass", other.dk, baseline.dk, truth.dk, slack);
  }
  // Every other compiled layout that fits this call on this device (the layouts another GPU would
  // run, e.g. the mma.sync forward where Hopper runs the warpgroup one), asked for by name.
  const mk::cuda::CudaTarget target = mk::cuda::current_cuda_target();
  const mk::cuda::LayoutQuery query = mk::cuda::layout_query(p.shape, selection_of(p, p.selection.data()));
  for (mk::ForwardLayout layout : mk::cuda::kForwardLayouts) {
    if (mk::cuda::resolve_forward_layout(layout, target, query) != layout ||
        layout == mk::cuda::choose_forward_layout(target, query)) {
      continue;
    }
    const char* name = mk::cuda::forward_layout_name(layout);
    std::printf(" forward layout %s\n", name);
    mk::CudaOptions options;
    options.forward_layout = layout;
    const Results other = run_gpu(p, false, nullptr, options);
    expect_close((std::string("out ") + name).c_str(), other.out, baseline.out, truth.out, slack);
    expect_close((std::string("lse ") + name).c_str(), other.lse, baseline.lse, truth.lse, 1e-4);
  }
  for (mk::BackwardLayout layout : mk::cuda::kBackwardLayouts) {
    if (mk::cuda::resolve_backward_layout(layout, target, query) != layout ||
        layout == mk::cuda::choose_backward_layout(target, query)) {
      continue;
    }
    const char* name = mk::cuda::backward_layout_name(layout);
    std::printf(" backward layout %s\n", name);
    mk::CudaOptions options;
    options.backward_layout = layout;
    const Results other = run_gpu(p, false, nullptr, options);
    expect_close((std::string("dq ") + name).c_str(), other.dq, baseline.dq, truth.dq, slack);
    expect_close((std::string("dk ") + name).c_str(), other.dk, baseline.dk, truth.dk, slack);
    expect_close((std::string("dv ") + name).c_str(), other.dv, baseline.dv, truth.dv, slack);
    if (c.history_tokens > 0) {
      expect_close((std::string("dk_pages ") + name).c_str(), pick(other.dk_pool, dk_used, true),
                   pick(baseline.dk_pool, dk_used, true), pick(truth.dk_pool, dk_used, true), slack);
      expect_close((std::string("dv_pages ") + name).c_str(), pick(other.dv_pool, dv_used, true),
                   pick(baseline.dv_pool, dv_used, true), pick(truth.dv_pool, dv_used, true), slack);
    }
  }
}

TEST_P(PagedAttentionCuda, DeterministicModeGivesSameBitsTwice) {
  const Case c = GetParam();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem p = make_problem(c, seed);
  RawBits first, second;
  run_gpu(p, true, &first);
  run_gpu(p, true, &second);
  EXPECT_EQ(first.dq, second.dq);
  EXPECT_EQ(first.dk, second.dk);
  EXPECT_EQ(first.dv, second.dv);
  EXPECT_EQ(first.dk_pool, second.dk_pool);
  EXPECT_EQ(first.dv_pool, second.dv_pool);
}

// GQA groups 1/4/7/8, head_dim 64/96/128/256, pages 64/128, partial last pages, chunk lengths that
// are not a multiple of any tile, dense and sparse, fp32 and bf16 grad pages, bf16 and fp16.
const Case kCases[] = {
    {"gqa4_d128_p128_dense", 200, 300, 128, 8, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16},
    {"gqa7_d64_p64_dense_bf16pages", 77, 130, 64, 7, 1, 64, 0, 0, DType::kBFloat16, DType::kBFloat16},
    {"gqa1_d128_no_history", 256, 0, 128, 2, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16},
    {"gqa8_d128_p64_sparse_tile64", 130, 1000, 64, 8, 1, 128, 64, 6, DType::kFloat32, DType::kBFloat16},
    {"gqa4_d64_p128_sparse_tile128_bf16pages", 300, 1100, 128, 8, 2, 64, 128, 4, DType::kBFloat16, DType::kBFloat16},
    {"gqa1_d128_p128_sparse_tile256", 600, 2000, 128, 4, 4, 128, 256, 3, DType::kFloat32, DType::kBFloat16},
    {"gqa4_d128_p128_dense_fp16", 150, 200, 128, 4, 1, 128, 0, 0, DType::kFloat32, DType::kFloat16},
    {"gqa8_d64_p64_exact_tiles", 128, 128, 64, 8, 1, 64, 0, 0, DType::kBFloat16, DType::kBFloat16},
    {"gqa8_d64_p128_dense_fp16", 100, 500, 128, 8, 1, 64, 0, 0, DType::kFloat32, DType::kFloat16},
    // Head sizes 96 (padded tiles) and 256 (64-row forward CTAs; dK/dV by halves of pages of 128 and
    // halves of head_dim, the last page's second half past the history's end).
    {"gqa4_d96_p128_dense", 200, 300, 128, 8, 2, 96, 0, 0, DType::kFloat32, DType::kBFloat16},
    {"gqa2_d96_p64_sparse_tile64_fp16", 150, 700, 64, 4, 2, 96, 64, 4, DType::kFloat32, DType::kFloat16},
    {"gqa4_d256_p128_dense", 130, 300, 128, 8, 2, 256, 0, 0, DType::kFloat32, DType::kBFloat16},
    {"gqa1_d256_p64_sparse_tile128_fp16", 200, 1000, 64, 2, 2, 256, 128, 3, DType::kBFloat16, DType::kFloat16},
    {"gqa7_d256_p128_sparse_tile64_bf16pages", 90, 900, 128, 7, 1, 256, 64, 2, DType::kBFloat16, DType::kBFloat16},
    // Every page selected, the last one 30 tokens: on Hopper the 64-key warpgroup layouts (head sizes
    // 64 and 256) split pages of 128 in two blocks, and the last page's second block has no row.
    {"gqa2_d64_p128_sparse_short_last_page", 200, 2 * 128 + 30, 128, 4, 2, 64, 128, 4, DType::kFloat32,
     DType::kBFloat16},
    {"gqa2_d256_p128_sparse_short_last_page_fp16", 130, 2 * 128 + 30, 128, 4, 2, 256, 128, 4, DType::kFloat32,
     DType::kFloat16},
};

INSTANTIATE_TEST_SUITE_P(Shapes, PagedAttentionCuda, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Soft-capped scores (Note [Soft-capped scores] in attention.h), at Gemma 2's head sizes 128 and 256
// above all, with its cap of 50 and a cap of 5. softmax_scale is 6 or 10 times 1 / sqrt(head_dim),
// so that scores reach several times the cap (|s| ~ 9 for a cap of 5, ~15 and up to ~60 for 50)
// and the cap bends most of them. Dense with history and chunk, chunk only, blocked history
// (attend_chunk false, with and without a cap), sparse; bf16 and fp16; both grad page types.
const Case kSoftcapCases[] = {
    {"softcap50_gqa2_d256_p128_dense", 200, 300, 128, 16, 8, 256, 0, 0, DType::kFloat32, DType::kBFloat16, 50.f, 10.f},
    {"softcap5_gqa2_d256_p64_dense_fp16", 130, 260, 64, 8, 4, 256, 0, 0, DType::kFloat32, DType::kFloat16, 5.f, 6.f},
    {"softcap50_gqa2_d128_p128_dense_fp16_bf16pages", 150, 400, 128, 16, 8, 128, 0, 0, DType::kBFloat16,
     DType::kFloat16, 50.f, 10.f},
    {"softcap5_gqa2_d128_p64_dense", 200, 300, 64, 8, 4, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 5.f, 6.f},
    {"softcap5_gqa2_d128_no_history", 200, 0, 128, 8, 4, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 5.f, 6.f},
    {"softcap5_gqa2_d128_p128_blocked", 150, 500, 128, 16, 8, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 5.f, 6.f,
     false},
    {"softcap50_gqa2_d256_p128_blocked_fp16_bf16pages", 100, 300, 128, 8, 4, 256, 0, 0, DType::kBFloat16,
     DType::kFloat16, 50.f, 10.f, false},
    {"nocap_gqa2_d128_p64_blocked", 130, 200, 64, 8, 4, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, false},
    {"softcap5_gqa2_d128_p128_sparse_tile128", 300, 1100, 128, 8, 4, 128, 128, 4, DType::kFloat32, DType::kBFloat16,
     5.f, 6.f},
    {"softcap5_gqa2_d256_p64_sparse_tile64_fp16", 130, 1000, 64, 8, 4, 256, 64, 6, DType::kFloat32, DType::kFloat16,
     5.f, 6.f},
    // The other head sizes' capped layouts (head_dim 64: the two-CTA warpgroup forward and the split
    // backward; 96: padded tiles).
    {"softcap5_gqa4_d64_p128_dense", 100, 300, 128, 8, 2, 64, 0, 0, DType::kFloat32, DType::kBFloat16, 5.f, 6.f},
    {"softcap5_gqa2_d96_p64_sparse_tile64_fp16", 150, 700, 64, 4, 2, 96, 64, 4, DType::kFloat32, DType::kFloat16, 5.f,
     6.f},
};

INSTANTIATE_TEST_SUITE_P(SoftCapped, PagedAttentionCuda, ::testing::ValuesIn(kSoftcapCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Sliding windows (Note [Sliding window] in attention.h; Note [Sliding window in the kernels] in
// kernels/cuda/attention_common.cuh): every head size, bf16 and fp16, windows smaller than a key
// block (64 or 128), between the two, larger than a page and several pages long, of one position,
// past the whole history (hides nothing), with Gemma 2's soft-cap, without history, and chunks of
// several query tiles whose later tiles skip whole history pages and chunk blocks (the forward's
// first block, the dK/dV work lists' ends). Every other compiled layout runs them too.
const Case kWindowCases[] = {
    {"window30_gqa4_d128_p128", 300, 500, 128, 8, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, true, 30},
    {"window100_gqa2_d128_p64_fp16", 260, 400, 64, 8, 4, 128, 0, 0, DType::kFloat32, DType::kFloat16, 0.f, 1.f, true,
     100},
    {"window700_gqa4_d128_p128_bf16pages", 400, 1000, 128, 8, 2, 128, 0, 0, DType::kBFloat16, DType::kBFloat16, 0.f,
     1.f, true, 700},
    {"window150_gqa4_d128_p64_long_chunk", 700, 800, 64, 8, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f,
     true, 150},
    {"window200_gqa2_d64_p128", 300, 600, 128, 4, 2, 64, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, true, 200},
    {"window129_gqa4_d64_p64_fp16", 200, 300, 64, 8, 2, 64, 0, 0, DType::kFloat32, DType::kFloat16, 0.f, 1.f, true,
     129},
    {"window77_gqa2_d96_p128", 250, 300, 128, 4, 2, 96, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, true, 77},
    {"window300_gqa2_d96_p64_fp16", 300, 700, 64, 4, 2, 96, 0, 0, DType::kFloat32, DType::kFloat16, 0.f, 1.f, true,
     300},
    {"window64_gqa2_d256_p128", 200, 400, 128, 4, 2, 256, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, true, 64},
    {"window500_gqa2_d256_p64_fp16_bf16pages", 300, 900, 64, 4, 2, 256, 0, 0, DType::kBFloat16, DType::kFloat16, 0.f,
     1.f, true, 500},
    {"softcap50_window90_gqa2_d256_p128", 260, 600, 128, 8, 4, 256, 0, 0, DType::kFloat32, DType::kBFloat16, 50.f,
     10.f, true, 90},
    {"softcap5_window1000_gqa2_d128_p64_fp16", 400, 1500, 64, 8, 4, 128, 0, 0, DType::kFloat32, DType::kFloat16, 5.f,
     6.f, true, 1000},
    {"softcap5_window40_gqa4_d64_p128", 200, 300, 128, 8, 2, 64, 0, 0, DType::kFloat32, DType::kBFloat16, 5.f, 6.f,
     true, 40},
    {"window1_gqa1_d128_p128", 150, 200, 128, 2, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, true, 1},
    {"window50_gqa2_d128_no_history", 300, 0, 128, 4, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f, true,
     50},
    {"window5000_hides_nothing_d128_p128", 200, 300, 128, 4, 2, 128, 0, 0, DType::kFloat32, DType::kBFloat16, 0.f, 1.f,
     true, 5000},
};

INSTANTIATE_TEST_SUITE_P(Windowed, PagedAttentionCuda, ::testing::ValuesIn(kWindowCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Page summary and page select.

TEST(PageSelectionCuda, SummaryAndSelectMatchReference) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Case c{"select", 300, 5000, 128, 8, 2, 128, 128, 8, DType::kFloat32, DType::kBFloat16};
  const Problem p = make_problem(c, seed);
  const int num_pages = p.num_pages;
  const size_t summary_elements = size_t(num_pages) * c.num_kv_heads * c.head_dim;

  // Summary: CPU vs GPU on the same bf16 pool.
  std::vector<uint16_t> pool_bits = encode_all(p.k_pool, c.dtype);
  std::vector<float> mean(summary_elements), low(summary_elements), high(summary_elements);
  mk::PageSummaryParams summary;
  summary.shape = p.shape;
  summary.k_pool = pool_bits.data();
  summary.k_page_index = p.k_index.data();
  summary.mean = mean.data(), summary.min = low.data(), summary.max = high.data();
  ASSERT_EQ(0, mk::cpu::page_summary(summary));
  DeviceBuffer<uint16_t> pool(pool_bits);
  DeviceBuffer<int32_t> index(p.k_index);
  DeviceBuffer<float> gpu_mean(summary_elements), gpu_low(summary_elements), gpu_high(summary_elements);
  summary.k_pool = pool.get(), summary.k_page_index = index.get();
  summary.mean = gpu_mean.get(), summary.min = gpu_low.get(), summary.max = gpu_high.get();
  ASSERT_EQ(0, mk::cuda::page_summary(summary, nullptr));
  const auto mean_gpu = gpu_mean.download(), low_gpu = gpu_low.download(), high_gpu = gpu_high.download();
  for (size_t i = 0; i < summary_elements; ++i) {
    ASSERT_NEAR(mean[i], mean_gpu[i], 1e-5 * std::max(1.f, std::abs(mean[i]))) << i;
    ASSERT_EQ(low[i], low_gpu[i]) << i;
    ASSERT_EQ(high[i], high_gpu[i]) << i;
  }

  // Select: both from the CPU summaries; near-ties at the k-th score may break either way.
  std::vector<uint16_t> q_bits = encode_all(p.q, c.dtype);
  DeviceBuffer<uint16_t> q(q_bits);
  DeviceBuffer<float> mean_device(mean), low_device(low), high_device(high);
  for (bool use_bounds : {false, true}) {
    mk::PageSelectParams select;
    select.shape = p.shape;
    select.q = q_bits.data();
    select.mean = mean.data(), select.min = low.data(), select.max = high.data();
    select.use_bounds = use_bounds;
    select.top_k = c.top_k;
    select.query_tile_tokens = c.query_tile_tokens;
    std::vector<int32_t> cpu_selected(size_t(p.num_tiles) * c.top_k);
    select.selected_pages = cpu_selected.data();
    ASSERT_EQ(0, mk::cpu::page_select(select));
    DeviceBuffer<int32_t> gpu_selected(cpu_selected.size());
    select.q = q.get();
    select.mean = mean_device.get(), select.min = low_device.get(), select.max = high_device.get();
    select.selected_pages = gpu_selected.get();
    ASSERT_EQ(0, mk::cuda::page_select(select, nullptr));
    const auto gpu_pages = gpu_selected.download();
    int mismatched_tiles = 0;
    for (int tile = 0; tile < p.num_tiles; ++tile) {
      const auto begin = int64_t(tile) * c.top_k;
      std::vector<int32_t> a(cpu_selected.begin() + begin, cpu_selected.begin() + begin + c.top_k);
      std::vector<int32_t> b(gpu_pages.begin() + begin, gpu_pages.begin() + begin + c.top_k);
      EXPECT_TRUE(std::is_sorted(b.begin(), b.end())) << "tile " << tile;
      if (a != b) ++mismatched_tiles;
    }
    // fp32 scores summed in another order may swap two pages whose scores tie to ~1e-6 at the
    // k-th place; with 3 tiles of 8 picks among 40 pages, more than one such tile is a real bug.
    EXPECT_LE(mismatched_tiles, 1) << "use_bounds=" << use_bounds;
  }
}

// Unsupported shapes are refused with an error code, not run.
TEST(PagedAttentionCudaChecks, RejectsUnsupportedShapes) {
  mk::PagedAttentionShape shape;
  shape.chunk_tokens = 128, shape.history_tokens = 0, shape.page_tokens = 128;
  shape.num_q_heads = 4, shape.num_kv_heads = 2, shape.head_dim = 80, shape.softmax_scale = 0.1f;
  EXPECT_STREQ("the CUDA attention kernels support head_dim 64, 96, 128 or 256 (got 80).",
               mk::cuda::paged_attention_cuda_check(shape, {}));
  for (int32_t head_dim : {64, 96, 128, 256}) {
    shape.head_dim = head_dim;
    EXPECT_STREQ("", mk::cuda::paged_attention_cuda_check(shape, {}));
  }
  shape.page_tokens = 32;
  EXPECT_STRNE("", mk::cuda::paged_attention_cuda_check(shape, {}));
  shape.page_tokens = 128;
  mk::PageSelection selection{reinterpret_cast<const int32_t*>(16), 4, 96};
  EXPECT_STRNE("", mk::cuda::paged_attention_cuda_check(shape, selection));
  mk::PagedAttentionForwardParams forward;
  forward.shape = shape;
  forward.shape.head_dim = 80;
  EXPECT_NE(0, mk::cuda::paged_attention_forward(forward, nullptr));
  // A logit soft-cap must be 0 (none) or finite and positive (the shared check every launch runs).
  EXPECT_STREQ("", mk::paged_attention_check_shape(shape));
  for (float cap : {-1.f, NAN, INFINITY}) {
    shape.logit_softcap = cap;
    EXPECT_STRNE("", mk::paged_attention_check_shape(shape)) << cap;
  }
  shape.logit_softcap = 50.f;
  EXPECT_STREQ("", mk::paged_attention_check_shape(shape));
  EXPECT_STREQ("", mk::cuda::paged_attention_cuda_check(shape, {}));
  // A sliding window: >= 0, with the chunk in the call, and not with a sparse selection.
  shape.sliding_window = 64;
  EXPECT_STREQ("", mk::paged_attention_check_shape(shape));
  EXPECT_STREQ("", mk::cuda::paged_attention_cuda_check(shape, {}));
  mk::PageSelection tiles{reinterpret_cast<const int32_t*>(16), 4, 128};
  EXPECT_STRNE("", mk::cuda::paged_attention_cuda_check(shape, tiles));
  shape.attend_chunk = false;
  EXPECT_STRNE("", mk::paged_attention_check_shape(shape));
  shape.attend_chunk = true;
  shape.sliding_window = -1;
  EXPECT_STRNE("", mk::paged_attention_check_shape(shape));
}

}  // namespace
