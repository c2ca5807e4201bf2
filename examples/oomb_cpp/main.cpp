// Chunk-recurrent (OOMB) training of a small transformer written in LibTorch C++.
//
// The model (token embedding, a few pre-norm decoder layers with GQA attention and RoPE, an MLP,
// an output head) runs a sequence chunk by chunk through membar's paged-attention ops
// (membar::paged_attention_forward / paged_attention_backward, looked up in the c10 dispatcher):
//   stage 1 (no grad): chunks 0..C-1 forward; each layer writes its chunk's post-RoPE K/V into
//     page pools and attends to the pages of earlier chunks plus its own chunk (causal);
//   stage 2: chunks C-1..0: recompute with grad, loss, backward; the attention backward ADDS the
//     history's dK/dV into grad pages, and a chunk's own grad pages (complete once every later
//     chunk has run) are added to the gradient of its K/V.
// It first checks the gradients against plain full-sequence training of the same model (LibTorch
// attention with a causal mask), then trains a few steps with Adam and prints the loss.
//
// Usage: oomb_cpp_example [--ops PATH_TO_membar_C.so] [--tokens N] [--chunk N] [--steps N]
// Exit status: 0 when the gradients match (max relative error <= 1e-4), 1 otherwise.
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// -- The ops ---------------------------------------------------------------------------------------

using ForwardSignature = std::tuple<Tensor, Tensor>(
    const Tensor& q, const Tensor& k_chunk, const Tensor& v_chunk, const Tensor& k_pool, const Tensor& k_page_index,
    const Tensor& v_pool, const Tensor& v_page_index, int64_t history_tokens, double softmax_scale,
    const std::optional<Tensor>& selected_pages, int64_t query_tile_tokens, bool attend_chunk,
    const std::string& layout, double logit_softcap, int64_t sliding_window);
using BackwardSignature = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor& q, const Tensor& k_chunk, const Tensor& v_chunk, const Tensor& k_pool, const Tensor& k_page_index,
    const Tensor& v_pool, const Tensor& v_page_index, const Tensor& out, const Tensor& dout, const Tensor& lse,
    Tensor& dk_pool, const Tensor& dk_page_index, Tensor& dv_pool, const Tensor& dv_page_index,
    int64_t history_tokens, double softmax_scale, const std::optional<Tensor>& selected_pages,
    int64_t query_tile_tokens, bool deterministic, bool attend_chunk, const std::string& layout,
    double logit_softcap, int64_t sliding_window);

struct Ops {
  c10::TypedOperatorHandle<ForwardSignature> forward;
  c10::TypedOperatorHandle<BackwardSignature> backward;
};

const Ops& ops() {
  static const Ops handles{
      c10::Dispatcher::singleton().findSchemaOrThrow("membar::paged_attention_forward", "").typed<ForwardSignature>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("membar::paged_attention_backward", "").typed<BackwardSignature>()};
  return handles;
}

// -- Pages of one sequence ---------------------------------------------------------------------------

// Per layer: K, V (model dtype) and dK, dV (float32) pools, each [num_pages, page_tokens, Hkv, D].
// Chunk c owns pages [c * chunk / page_tokens, ...): chunk_tokens is a multiple of page_tokens.
struct SequencePages {
  int64_t page_tokens = 0;
  std::vector<Tensor> k, v, dk, dv;
  Tensor page_numbers;  // int32 [num_pages]: the kernels' page index (pool row p = page p)

  void open(int64_t layers, int64_t tokens, int64_t page_tokens_, int64_t kv_heads, int64_t head_dim) {
    page_tokens = page_tokens_;
    const int64_t pages = (tokens + page_tokens - 1) / page_tokens;
    k.clear(); v.clear(); dk.clear(); dv.clear();
    for (int64_t layer = 0; layer < layers; ++layer) {
      k.push_back(torch::zeros({pages, page_tokens, kv_heads, head_dim}));
      v.push_back(torch::zeros({pages, page_tokens, kv_heads, head_dim}));
      dk.push_back(torch::zeros({pages, page_tokens, kv_heads, head_dim}));
      dv.push_back(torch::zeros({pages, page_tokens, kv_heads, head_dim}));
    }
    page_numbers = torch::arange(pages, torch::kInt32);
  }

  // Rows of `pages` pages from first_page on, as [tokens, Hkv, D] (a view into the pool).
  static Tensor rows(const Tensor& pool, int64_t first_page, int64_t tokens) {
    const int64_t pages = (tokens + pool.size(1) - 1) / pool.size(1);
    return pool.narrow(0, first_page, pages).reshape({pages * pool.size(1), pool.size(2), pool.size(3)}).narrow(0, 0, tokens);
  }
};

// What a layer's attention needs to know about the chunk being run.
struct ChunkState {
  SequencePages* pages = nullptr;
  int64_t history_tokens = 0;  // tokens (and, / page_tokens, pages) of all earlier chunks
  int64_t first_page = 0;
  bool later_chunks = false;
  double scale = 1.0;
};

// History views for the kernels; chunk 0 gets a one-page placeholder that is never read.
std::tuple<Tensor, Tensor, Tensor> history_of(const ChunkState& state, const std::vector<Tensor>& k_pools,
                                              const std::vector<Tensor>& v_pools, int64_t layer) {
  const int64_t pages = state.history_tokens / state.pages->page_tokens;
  if (pages == 0) {
    Tensor placeholder = torch::zeros_like(k_pools[layer].narrow(0, 0, 1));
    return {placeholder, placeholder.clone(), torch::zeros({0}, torch::kInt32)};
  }
  return {k_pools[layer], v_pools[layer], state.pages->page_numbers.narrow(0, 0, pages)};
}

// Attention of a chunk over its paged history, with grad: q [Tc, Hq, D], k, v [Tc, Hkv, D].
class PagedAttention : public torch::autograd::Function<PagedAttention> {
 public:
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor k, Tensor v, ChunkState* state, int64_t layer) {
    auto [k_pool, v_pool, index] = history_of(*state, state->pages->k, state->pages->v, layer);
    auto [out, lse] = ops().forward.call(q, k, v, k_pool, index, v_pool, index, state->history_tokens, state->scale,
                                         std::nullopt, 128, /*attend_chunk=*/true, /*layout=*/"",
                                         /*logit_softcap=*/0.0, /*sliding_window=*/0);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["state"] = reinterpret_cast<int64_t>(state);
    ctx->saved_data["layer"] = layer;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    auto* state = reinterpret_cast<ChunkState*>(ctx->saved_data["state"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    auto [k_pool, v_pool, index] = history_of(*state, state->pages->k, state->pages->v, layer);
    auto [dk_pool, dv_pool, grad_index] = history_of(*state, state->pages->dk, state->pages->dv, layer);
    auto [dq, dk, dv] = ops().backward.call(saved[0], saved[1], saved[2], k_pool, index, v_pool, index, saved[3],
                                            grad_outputs[0].contiguous(), saved[4], dk_pool, grad_index, dv_pool,
                                            grad_index, state->history_tokens, state->scale, std::nullopt, 128,
                                            /*deterministic=*/true, /*attend_chunk=*/true, /*layout=*/"",
                                            /*logit_softcap=*/0.0, /*sliding_window=*/0);
    return {dq, dk, dv, Tensor(), Tensor()};
  }
};

// Identity on a chunk's (k, v) whose backward adds what later chunks left in the chunk's grad pages.
class InjectPageGrads : public torch::autograd::Function<InjectPageGrads> {
 public:
  static variable_list forward(AutogradContext* ctx, Tensor k, Tensor v, ChunkState* state, int64_t layer) {
    ctx->saved_data["state"] = reinterpret_cast<int64_t>(state);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["tokens"] = k.size(0);
    return {k.view_as(k), v.view_as(v)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* state = reinterpret_cast<ChunkState*>(ctx->saved_data["state"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const int64_t tokens = ctx->saved_data["tokens"].toInt();
    Tensor page_dk = SequencePages::rows(state->pages->dk[layer], state->first_page, tokens);
    Tensor page_dv = SequencePages::rows(state->pages->dv[layer], state->first_page, tokens);
    return {grads[0] + page_dk, grads[1] + page_dv, Tensor(), Tensor()};
  }
};

// -- The model ----------------------------------------------------------------------------------------

struct Shape {
  int64_t vocab = 64, hidden = 64, layers = 2, q_heads = 4, kv_heads = 2, head_dim = 16, mlp = 128;
};

enum class Mode { kFullSequence, kStage1, kStage2 };

Tensor rms_norm(const Tensor& x, const Tensor& weight) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6) * weight;
}

// Rotary position embedding of x [T, H, D] at absolute positions [T].
Tensor rope(const Tensor& x, const Tensor& positions) {
  const int64_t half = x.size(-1) / 2;
  Tensor inverse_frequency = torch::pow(10000.0, -torch::arange(half, torch::kFloat32) / double(half));
  Tensor angles = positions.to(torch::kFloat32).unsqueeze(1) * inverse_frequency.unsqueeze(0);  // [T, D/2]
  Tensor cos = torch::cat({angles.cos(), angles.cos()}, -1).unsqueeze(1);                       // [T, 1, D]
  Tensor sin = torch::cat({angles.sin(), angles.sin()}, -1).unsqueeze(1);
  Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct TinyLMImpl : torch::nn::Module {
  Shape shape;
  torch::nn::Embedding embed{nullptr};
  std::vector<torch::nn::Linear> q, k, v, o, up, down;
  std::vector<Tensor> norm_attention, norm_mlp;
  Tensor norm_final;
  torch::nn::Linear head{nullptr};

  explicit TinyLMImpl(const Shape& s) : shape(s) {
    embed = register_module("embed", torch::nn::Embedding(s.vocab, s.hidden));
    auto linear = [&](const std::string& name, int64_t in, int64_t out) {
      return register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
    };
    for (int64_t layer = 0; layer < s.layers; ++layer) {
      const std::string p = "layer" + std::to_string(layer) + "_";
      q.push_back(linear(p + "q", s.hidden, s.q_heads * s.head_dim));
      k.push_back(linear(p + "k", s.hidden, s.kv_heads * s.head_dim));
      v.push_back(linear(p + "v", s.hidden, s.kv_heads * s.head_dim));
      o.push_back(linear(p + "o", s.q_heads * s.head_dim, s.hidden));
      up.push_back(linear(p + "up", s.hidden, s.mlp));
      down.push_back(linear(p + "down", s.mlp, s.hidden));
      norm_attention.push_back(register_parameter(p + "norm_attention", torch::ones({s.hidden}) + 0.1 * torch::randn({s.hidden})));
      norm_mlp.push_back(register_parameter(p + "norm_mlp", torch::ones({s.hidden}) + 0.1 * torch::randn({s.hidden})));
    }
    norm_final = register_parameter("norm_final", torch::ones({s.hidden}));
    head = linear("head", s.hidden, s.vocab);
  }

  // Plain causal attention over the whole sequence (the reference): q [T, Hq, D], k, v [T, Hkv, D].
  Tensor full_attention(const Tensor& q_, const Tensor& k_, const Tensor& v_) const {
    const int64_t group = shape.q_heads / shape.kv_heads;
    Tensor keys = k_.repeat_interleave(group, 1).transpose(0, 1);    // [Hq, T, D]
    Tensor values = v_.repeat_interleave(group, 1).transpose(0, 1);
    Tensor scores = torch::matmul(q_.transpose(0, 1), keys.transpose(1, 2)) / std::sqrt(double(shape.head_dim));
    const int64_t tokens = q_.size(0);
    Tensor future = torch::ones({tokens, tokens}, torch::kBool).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    return torch::matmul(scores.softmax(-1), values).transpose(0, 1);  // [T, Hq, D]
  }

  // Hidden states [T, hidden] of tokens ids [T] at positions first_position.. under `mode`.
  Tensor forward_chunk(const Tensor& ids, int64_t first_position, Mode mode, ChunkState* state) {
    const int64_t tokens = ids.size(0);
    Tensor positions = torch::arange(first_position, first_position + tokens);
    Tensor x = embed->forward(ids);
    for (int64_t layer = 0; layer < shape.layers; ++layer) {
      Tensor h = rms_norm(x, norm_attention[layer]);
      Tensor queries = rope(q[layer]->forward(h).view({tokens, shape.q_heads, shape.head_dim}), positions).contiguous();
      Tensor keys = rope(k[layer]->forward(h).view({tokens, shape.kv_heads, shape.head_dim}), positions).contiguous();
      Tensor values = v[layer]->forward(h).view({tokens, shape.kv_heads, shape.head_dim}).contiguous();
      Tensor attended;
      if (mode == Mode::kFullSequence) {
        attended = full_attention(queries, keys, values);
      } else if (mode == Mode::kStage1) {
        auto [k_pool, v_pool, index] = history_of(*state, state->pages->k, state->pages->v, layer);
        attended = std::get<0>(ops().forward.call(queries, keys, values, k_pool, index, v_pool, index,
                                                  state->history_tokens, state->scale, std::nullopt, 128,
                                                  /*attend_chunk=*/true, /*layout=*/"", /*logit_softcap=*/0.0,
                                                  /*sliding_window=*/0));
        SequencePages::rows(state->pages->k[layer], state->first_page, tokens).copy_(keys);
        SequencePages::rows(state->pages->v[layer], state->first_page, tokens).copy_(values);
      } else {
        if (state->later_chunks) {
          auto injected = InjectPageGrads::apply(keys, values, state, layer);
          keys = injected[0];
          values = injected[1];
        }
        attended = PagedAttention::apply(queries, keys, values, state, layer);
      }
      x = x + o[layer]->forward(attended.reshape({tokens, shape.q_heads * shape.head_dim}));
      x = x + down[layer]->forward(torch::silu(up[layer]->forward(rms_norm(x, norm_mlp[layer]))));
    }
    return rms_norm(x, norm_final);
  }
};
TORCH_MODULE(TinyLM);

// Summed cross-entropy of hidden [T, hidden] against targets [T] (-100 = no target).
Tensor summed_loss(TinyLM& model, const Tensor& hidden, const Tensor& targets) {
  namespace F = torch::nn::functional;
  return F::cross_entropy(model->head->forward(hidden), targets,
                          F::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
}

Tensor targets_of(const Tensor& ids) {
  return torch::cat({ids.narrow(0, 1, ids.size(0) - 1), torch::full({1}, -100, torch::kLong)});
}

double full_sequence_step(TinyLM& model, const Tensor& ids) {
  Tensor loss = summed_loss(model, model->forward_chunk(ids, 0, Mode::kFullSequence, nullptr), targets_of(ids)) /
                double(ids.size(0) - 1);
  loss.backward();
  return loss.item<double>();
}

double oomb_step(TinyLM& model, const Tensor& ids, int64_t chunk_tokens, int64_t page_tokens, SequencePages& pages) {
  const Shape& s = model->shape;
  const int64_t tokens = ids.size(0);
  const int64_t chunks = (tokens + chunk_tokens - 1) / chunk_tokens;
  const Tensor targets = targets_of(ids);
  pages.open(s.layers, tokens, page_tokens, s.kv_heads, s.head_dim);
  auto state_of = [&](int64_t chunk) {
    ChunkState state;
    state.pages = &pages;
    state.history_tokens = chunk * chunk_tokens;
    state.first_page = chunk * chunk_tokens / page_tokens;
    state.later_chunks = chunk + 1 < chunks;
    state.scale = 1.0 / std::sqrt(double(s.head_dim));
    return state;
  };
  {
    torch::NoGradGuard no_grad;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      ChunkState state = state_of(chunk);
      const int64_t first = chunk * chunk_tokens, length = std::min(chunk_tokens, tokens - first);
      model->forward_chunk(ids.narrow(0, first, length), first, Mode::kStage1, &state);
    }
  }
  double total = 0;
  for (int64_t chunk = chunks - 1; chunk >= 0; --chunk) {
    ChunkState state = state_of(chunk);
    const int64_t first = chunk * chunk_tokens, length = std::min(chunk_tokens, tokens - first);
    Tensor hidden = model->forward_chunk(ids.narrow(0, first, length), first, Mode::kStage2, &state);
    Tensor loss = summed_loss(model, hidden, targets.narrow(0, first, length)) / double(tokens - 1);
    loss.backward();
    total += loss.item<double>();
  }
  return total;
}

std::vector<Tensor> take_grads(TinyLM& model) {
  std::vector<Tensor> grads;
  for (auto& parameter : model->parameters()) {
    grads.push_back(parameter.grad().clone());
    parameter.mutable_grad().zero_();
  }
  return grads;
}

}  // namespace

int main(int argc, char** argv) {
  std::string library = std::getenv("MEMBAR_LIBRARY") ? std::getenv("MEMBAR_LIBRARY") : MEMBAR_OPS_LIBRARY;
  int64_t tokens = 300, chunk_tokens = 64, page_tokens = 16, steps = 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--ops") library = argv[i + 1];
    else if (flag == "--tokens") tokens = std::atoll(argv[i + 1]);
    else if (flag == "--chunk") chunk_tokens = std::atoll(argv[i + 1]);
    else if (flag == "--steps") steps = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s (known: --ops, --tokens, --chunk, --steps)\n", flag.c_str());
      return 2;
    }
  }
  if (chunk_tokens % page_tokens != 0 || tokens < 2) {
    std::fprintf(stderr, "--chunk must be a multiple of %lld and --tokens at least 2\n", (long long)page_tokens);
    return 2;
  }
  if (!dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
    std::fprintf(stderr, "could not load membar's ops library %s: %s (build the membar_C target)\n",
                 library.c_str(), dlerror());
    return 2;
  }
  torch::manual_seed(0);
  TinyLM model(Shape{});
  // The sequence: a random block of 32 tokens repeated, so that attention far back pays off.
  Tensor block = torch::randint(0, model->shape.vocab, {32});
  Tensor ids = block.repeat({(tokens + 31) / 32}).narrow(0, 0, tokens);

  // 1. Gradients: chunk-recurrent vs full sequence.
  for (auto& parameter : model->parameters()) parameter.mutable_grad() = torch::zeros_like(parameter);
  const double loss_full = full_sequence_step(model, ids);
  std::vector<Tensor> reference = take_grads(model);
  SequencePages pages;
  const double loss_oomb = oomb_step(model, ids, chunk_tokens, page_tokens, pages);
  std::vector<Tensor> chunked = take_grads(model);
  double worst = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double scale = reference[i].abs().max().item<double>();
    worst = std::max(worst, (chunked[i] - reference[i]).abs().max().item<double>() / std::max(scale, 1e-30));
  }
  std::printf("%lld tokens in chunks of %lld: loss full %.6f, chunk-recurrent %.6f; max relative gradient error %.3g\n",
              (long long)tokens, (long long)chunk_tokens, loss_full, loss_oomb, worst);

  // 2. Training, chunk-recurrently.
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  for (int64_t step = 1; step <= steps; ++step) {
    optimizer.zero_grad();
    const double loss = oomb_step(model, ids, chunk_tokens, page_tokens, pages);
    optimizer.step();
    if (step == 1 || step % 10 == 0 || step == steps) std::printf("step %lld: loss %.4f\n", (long long)step, loss);
  }
  const bool ok = worst <= 1e-4;
  std::printf("%s\n", ok ? "gradients match" : "GRADIENTS DIFFER");
  return ok ? 0 : 1;
}
