// cuDNN frontend graphs for the attention of attention_cudnn.h. CUDA builds only: in a
// CPU-only build this file compiles to nothing. The frontend headers are heavy, so they are
// included here and nowhere else.
#if FP8TRAIN_WITH_CUDA

#include "ops/cuda/attention_cudnn.h"

// The frontend headers are not warning-clean under this project's flags.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wunused-function"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include <bit>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "core/device_buffer.h"
#include "core/error.h"
#include "core/phase_timer.h"

namespace fp8t::ops::cuda {

namespace {

namespace fe = cudnn_frontend;

// Fixed tensor uids, so that a cached graph is executed with a plain uid → pointer map. The FP8
// graphs' scalars take kScalarUid + their slot in the attention's float array.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScalarUid = 100 };

std::string describe(const AttentionShape& s, float scale) {
  return fmt::format("batch {} seq_len {} heads {} kv_heads {} head_dim {} {} scale {}", s.batch,
                     s.seq_len, s.heads, s.kv_heads, s.head_dim,
                     s.causal ? fmt::format("window {}", s.window) : std::string("no mask"), scale);
}

std::string last_cudnn_message() {
  char message[1024] = {};
  cudnnGetLastErrorString(message, sizeof(message));
  return message;
}

void check_cudnn(cudnnStatus_t status, const char* call, const std::string& context) {
  if (status != CUDNN_STATUS_SUCCESS) {
    throw Error(fmt::format("cuDNN call '{}' failed ({}): {} ({}) {}", call, context,
                            cudnnGetErrorString(status), static_cast<int>(status),
                            last_cudnn_message()));
  }
}

// A frontend step; GRAPH_NOT_SUPPORTED (from validate or check_support, say) reads as an
// unsupported configuration rather than a broken call.
void check_frontend(fe::error_t status, const char* call, const std::string& context) {
  if (status.is_good()) return;
  if (status.get_code() == fe::error_code_t::GRAPH_NOT_SUPPORTED) {
    throw Error(fmt::format("cuDNN {} SDPA: configuration not supported ({}: {}): {} {}",
                            CudnnAttention::cudnn_version(), call, context, status.get_message(),
                            last_cudnn_message()));
  }
  throw Error(fmt::format("cuDNN frontend call '{}' failed ({}): {} {}", call, context,
                          status.get_message(), last_cudnn_message()));
}

void check_shape(const AttentionShape& s, float scale) {
  FP8T_CHECK(s.batch > 0 && s.seq_len > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0,
             "expected positive sizes, found {}", describe(s, scale));
  FP8T_CHECK(s.heads % s.kv_heads == 0, "expected kv_heads to divide heads, found {}",
             describe(s, scale));
  FP8T_CHECK(s.window >= 0, "expected window >= 0, found {}", describe(s, scale));
}

// window >= seq_len - 1 is plain causal; a narrower one is cuDNN's diagonal band, which keeps
// key j for query t when j + left_bound > t, i.e. t - j <= left_bound - 1. Without the causal
// mask there is no window.
bool has_window(const AttentionShape& s) {
  return s.causal && s.window < s.seq_len - 1;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t>;

Key make_key(const AttentionShape& s, float scale) {
  // Every window past seq_len - 1 is the same full-causal graph; -1 marks no mask.
  const int64_t window = !s.causal ? -1 : has_window(s) ? s.window : s.seq_len - 1;
  return {
      s.batch, s.seq_len, s.heads, s.kv_heads, s.head_dim, window, std::bit_cast<uint32_t>(scale)};
}

fe::DataType_t cudnn_type(Fp8Format format) {
  switch (format) {
    case Fp8Format::E4M3:
      return fe::DataType_t::FP8_E4M3;
    case Fp8Format::E5M2:
      return fe::DataType_t::FP8_E5M2;
    default:
      throw Error(fmt::format("cuDNN FP8 attention reads and writes OCP E4M3 and E5M2 only, not {}",
                              format_name(format)));
  }
}

// Graphs of a shape, and for FP8 of its formats (-1: BF16).
using Fp8Key = std::tuple<Key, int, int>;

Fp8Key make_fp8_key(const AttentionShape& s, float scale, Fp8Format forward, Fp8Format backward) {
  return {make_key(s, scale), static_cast<int>(forward), static_cast<int>(backward)};
}

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
  std::vector<int> scalar_slots;  // FP8: the attention floats the graph reads or writes
};

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Graph> new_fp8_graph(Fp8Format forward_format) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(cudnn_type(forward_format))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

// The floats of the attention's array an FP8 graph reads and writes, each a [1, 1, 1, 1] fp32
// tensor; the slots used are remembered for the variant pack.
struct Fp8Scalars {
  fe::graph::Graph& graph;
  std::vector<int> slots;

  std::shared_ptr<fe::graph::Tensor_attributes> input(int slot) {
    slots.push_back(slot);
    return graph.tensor(scalar_attributes(fe::graph::Tensor_attributes(), slot));
  }
  std::shared_ptr<fe::graph::Tensor_attributes> scale(AttentionFp8Tensor t) {
    return input(attention_fp8_scale_slot(t));
  }
  std::shared_ptr<fe::graph::Tensor_attributes> descale(AttentionFp8Tensor t) {
    return input(attention_fp8_descale_slot(t));
  }
  void amax_output(fe::graph::Tensor_attributes& tensor, AttentionFp8Tensor t) {
    const int slot = attention_fp8_amax_slot(t);
    slots.push_back(slot);
    scalar_attributes(tensor, slot).set_output(true);
  }

 private:
  static fe::graph::Tensor_attributes& scalar_attributes(fe::graph::Tensor_attributes& tensor,
                                                         int slot) {
    return tensor.set_name(fmt::format("scalar_{}", slot))
        .set_uid(kScalarUid + slot)
        .set_dim({1, 1, 1, 1})
        .set_stride({1, 1, 1, 1})
        .set_data_type(fe::DataType_t::FLOAT);
  }
  static fe::graph::Tensor_attributes scalar_attributes(fe::graph::Tensor_attributes&& tensor,
                                                        int slot) {
    return scalar_attributes(tensor, slot);
  }
};

// [batch, heads, seq_len, head_dim] dims over the [batch, seq_len, heads, head_dim] memory.
std::shared_ptr<fe::graph::Tensor_attributes> bshd_tensor(fe::graph::Graph& graph, const char* name,
                                                          int64_t uid, const AttentionShape& s,
                                                          int64_t heads) {
  return graph.tensor(
      fe::graph::Tensor_attributes()
          .set_name(name)
          .set_uid(uid)
          .set_dim({s.batch, heads, s.seq_len, s.head_dim})
          .set_stride({s.seq_len * heads * s.head_dim, s.head_dim, heads * s.head_dim, 1}));
}

void set_output_bshd(fe::graph::Tensor_attributes& tensor, const char* name, int64_t uid,
                     const AttentionShape& s, int64_t heads) {
  tensor.set_output(true)
      .set_name(name)
      .set_uid(uid)
      .set_dim({s.batch, heads, s.seq_len, s.head_dim})
      .set_stride({s.seq_len * heads * s.head_dim, s.head_dim, heads * s.head_dim, 1});
}

// Stats: [batch, heads, seq_len, 1] fp32, contiguous as [batch, heads, seq_len].
std::vector<int64_t> stats_dim(const AttentionShape& s) {
  return {s.batch, s.heads, s.seq_len, 1};
}
std::vector<int64_t> stats_stride(const AttentionShape& s) {
  return {s.heads * s.seq_len, s.seq_len, 1, 1};
}

// The inputs of a graph: q, k and v, and for a backward the output, its gradient and the stats.
struct SdpaInputs {
  std::shared_ptr<fe::graph::Tensor_attributes> q, k, v, out, dout, stats;
};

SdpaInputs sdpa_inputs(fe::graph::Graph& graph, const AttentionShape& s, bool backward) {
  SdpaInputs inputs;
  inputs.q = bshd_tensor(graph, "q", kQ, s, s.heads);
  inputs.k = bshd_tensor(graph, "k", kK, s, s.kv_heads);
  inputs.v = bshd_tensor(graph, "v", kV, s, s.kv_heads);
  if (!backward) return inputs;
  inputs.out = bshd_tensor(graph, "out", kO, s, s.heads);
  inputs.dout = bshd_tensor(graph, "dout", kDO, s, s.heads);
  inputs.stats = graph.tensor(fe::graph::Tensor_attributes()
                                  .set_name("stats")
                                  .set_uid(kStats)
                                  .set_data_type(fe::DataType_t::FLOAT)
                                  .set_dim(stats_dim(s))
                                  .set_stride(stats_stride(s)));
  return inputs;
}

// The mask and the scale, on any of the SDPA attribute types.
template <typename Attributes>
Attributes masked(Attributes attributes, const AttentionShape& s, float scale) {
  attributes.set_causal_mask(s.causal).set_attn_scale(scale);
  if (has_window(s)) attributes.set_diagonal_band_left_bound(static_cast<int>(s.window + 1));
  return attributes;
}

void set_forward_outputs(fe::graph::Tensor_attributes& out, fe::graph::Tensor_attributes& stats,
                         const AttentionShape& s) {
  set_output_bshd(out, "out", kO, s, s.heads);
  stats.set_output(true)
      .set_name("stats")
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dim(s))
      .set_stride(stats_stride(s));
}

void set_gradient_outputs(fe::graph::Tensor_attributes& dq, fe::graph::Tensor_attributes& dk,
                          fe::graph::Tensor_attributes& dv, const AttentionShape& s) {
  set_output_bshd(dq, "dq", kDQ, s, s.heads);
  set_output_bshd(dk, "dk", kDK, s, s.kv_heads);
  set_output_bshd(dv, "dv", kDV, s, s.kv_heads);
}

Built finish(std::shared_ptr<fe::graph::Graph> graph, cudnnHandle_t handle,
             const std::string& context) {
  check_frontend(graph->validate(), "validate", context);
  check_frontend(graph->build_operation_graph(handle), "build_operation_graph", context);
  check_frontend(graph->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans",
                 context);
  fe::error_t support = graph->check_support(handle);
  if (support.is_bad()) {
    throw Error(fmt::format("cuDNN {} SDPA: configuration not supported (check_support: {}): {} {}",
                            CudnnAttention::cudnn_version(), context, support.get_message(),
                            last_cudnn_message()));
  }
  check_frontend(graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE),
                 "build_plans", context);
  Built built;
  check_frontend(graph->get_workspace_size(built.workspace_bytes), "get_workspace_size", context);
  built.graph = std::move(graph);
  return built;
}

}  // namespace

struct CudnnAttention::State {
  cudnnHandle_t handle = nullptr;
  std::map<Key, Built> forward_graphs;
  std::map<Key, Built> backward_graphs;
  std::map<Fp8Key, Built> fp8_forward_graphs;
  std::map<Fp8Key, Built> fp8_backward_graphs;
  std::unique_ptr<DeviceBuffer<unsigned char>> workspace;
  int64_t graphs_built = 0;

  State() { check_cudnn(cudnnCreate(&handle), "cudnnCreate", "CudnnAttention"); }
  ~State() {
    // The plans hold descriptors made with the handle: release them first.
    forward_graphs.clear();
    backward_graphs.clear();
    fp8_forward_graphs.clear();
    fp8_backward_graphs.clear();
    cudnnDestroy(handle);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Freeing the old buffer (cudaFree) waits for the device, so no queued graph still uses it.
  void* workspace_for(int64_t bytes) {
    if (bytes <= 0) return nullptr;
    if (!workspace || workspace->bytes() < static_cast<size_t>(bytes)) {
      workspace.reset();
      workspace = std::make_unique<DeviceBuffer<unsigned char>>(static_cast<size_t>(bytes));
    }
    return workspace->get();
  }

  void execute(const Built& built, std::unordered_map<int64_t, void*>& pointers,
               cudaStream_t stream, const std::string& context) {
    check_cudnn(cudnnSetStream(handle, stream), "cudnnSetStream", context);
    void* scratch = workspace_for(built.workspace_bytes);
    check_frontend(built.graph->execute(handle, pointers, scratch), "execute", context);
  }
};

CudnnAttention::CudnnAttention() : state_(std::make_unique<State>()) {}
CudnnAttention::~CudnnAttention() = default;

int64_t CudnnAttention::graphs_built() const {
  return state_->graphs_built;
}

int64_t CudnnAttention::cudnn_version() {
  return static_cast<int64_t>(cudnnGetVersion());
}

void CudnnAttention::forward(bf16* out, float* stats, const bf16* q, const bf16* k, const bf16* v,
                             const AttentionShape& shape, float scale, cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Attention, stream);
  check_shape(shape, scale);
  FP8T_CHECK(out && stats && q && k && v, "expected non-null pointers ({})",
             describe(shape, scale));
  const std::string context = "SDPA forward, " + describe(shape, scale);
  const Key key = make_key(shape, scale);
  auto found = state_->forward_graphs.find(key);
  if (found == state_->forward_graphs.end()) {
    auto graph = new_graph();
    const SdpaInputs in = sdpa_inputs(*graph, shape, false);
    const auto attributes =
        masked(fe::graph::SDPA_attributes().set_name("sdpa_forward").set_generate_stats(true),
               shape, scale);
    auto [o_tensor, stats_tensor] = graph->sdpa(in.q, in.k, in.v, attributes);
    set_forward_outputs(*o_tensor, *stats_tensor, shape);
    found = state_->forward_graphs.emplace(key, finish(graph, state_->handle, context)).first;
    ++state_->graphs_built;
  }
  std::unordered_map<int64_t, void*> pointers = {{kQ, const_cast<bf16*>(q)},
                                                 {kK, const_cast<bf16*>(k)},
                                                 {kV, const_cast<bf16*>(v)},
                                                 {kO, out},
                                                 {kStats, stats}};
  state_->execute(found->second, pointers, stream, context);
}

void CudnnAttention::backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                              const bf16* k, const bf16* v, const bf16* out, const float* stats,
                              const AttentionShape& shape, float scale, cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Attention, stream);
  check_shape(shape, scale);
  FP8T_CHECK(dq && dk && dv && dout && q && k && v && out && stats,
             "expected non-null pointers ({})", describe(shape, scale));
  const std::string context = "SDPA backward, " + describe(shape, scale);
  const Key key = make_key(shape, scale);
  auto found = state_->backward_graphs.find(key);
  if (found == state_->backward_graphs.end()) {
    auto graph = new_graph();
    const SdpaInputs in = sdpa_inputs(*graph, shape, true);
    const auto attributes =
        masked(fe::graph::SDPA_backward_attributes().set_name("sdpa_backward"), shape, scale);
    auto [dq_tensor, dk_tensor, dv_tensor] =
        graph->sdpa_backward(in.q, in.k, in.v, in.out, in.dout, in.stats, attributes);
    set_gradient_outputs(*dq_tensor, *dk_tensor, *dv_tensor, shape);
    found = state_->backward_graphs.emplace(key, finish(graph, state_->handle, context)).first;
    ++state_->graphs_built;
  }
  std::unordered_map<int64_t, void*> pointers = {{kQ, const_cast<bf16*>(q)},
                                                 {kK, const_cast<bf16*>(k)},
                                                 {kV, const_cast<bf16*>(v)},
                                                 {kO, const_cast<bf16*>(out)},
                                                 {kDO, const_cast<bf16*>(dout)},
                                                 {kStats, const_cast<float*>(stats)},
                                                 {kDQ, dq},
                                                 {kDK, dk},
                                                 {kDV, dv}};
  state_->execute(found->second, pointers, stream, context);
}

namespace {

void add_fp8_scalars(std::unordered_map<int64_t, void*>& pointers, const Built& built,
                     float* floats) {
  for (int slot : built.scalar_slots)
    pointers[kScalarUid + slot] = floats + slot;
}

}  // namespace

void CudnnAttention::forward_fp8(uint8_t* out, float* stats, const uint8_t* q, const uint8_t* k,
                                 const uint8_t* v, float* floats, const AttentionShape& shape,
                                 float scale, Fp8Format forward_format, cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Attention, stream);
  check_shape(shape, scale);
  FP8T_CHECK(out && stats && q && k && v && floats, "expected non-null pointers ({})",
             describe(shape, scale));
  const std::string context =
      fmt::format("FP8 SDPA forward ({}), {}", format_name(forward_format), describe(shape, scale));
  const Fp8Key key = make_fp8_key(shape, scale, forward_format, forward_format);
  auto found = state_->fp8_forward_graphs.find(key);
  if (found == state_->fp8_forward_graphs.end()) {
    auto graph = new_fp8_graph(forward_format);
    fe::graph::Graph& g = *graph;
    Fp8Scalars scalars{g, {}};
    const SdpaInputs in = sdpa_inputs(g, shape, false);
    const auto attributes = masked(
        fe::graph::SDPA_fp8_attributes().set_name("sdpa_fp8_forward").set_generate_stats(true),
        shape, scale);
    auto [o_tensor, stats_tensor, amax_p, amax_o] = g.sdpa_fp8(
        in.q, in.k, in.v, scalars.descale(kFp8Q), scalars.descale(kFp8K), scalars.descale(kFp8V),
        scalars.descale(kFp8P), scalars.scale(kFp8P), scalars.scale(kFp8O), attributes);
    set_forward_outputs(*o_tensor, *stats_tensor, shape);
    scalars.amax_output(*amax_p, kFp8P);
    scalars.amax_output(*amax_o, kFp8O);
    Built built = finish(graph, state_->handle, context);
    built.scalar_slots = std::move(scalars.slots);
    found = state_->fp8_forward_graphs.emplace(key, std::move(built)).first;
    ++state_->graphs_built;
  }
  std::unordered_map<int64_t, void*> pointers = {{kQ, const_cast<uint8_t*>(q)},
                                                 {kK, const_cast<uint8_t*>(k)},
                                                 {kV, const_cast<uint8_t*>(v)},
                                                 {kO, out},
                                                 {kStats, stats}};
  add_fp8_scalars(pointers, found->second, floats);
  state_->execute(found->second, pointers, stream, context);
}

void CudnnAttention::backward_fp8(uint8_t* dq, uint8_t* dk, uint8_t* dv, const uint8_t* dout,
                                  const uint8_t* q, const uint8_t* k, const uint8_t* v,
                                  const uint8_t* out, const float* stats, float* floats,
                                  const AttentionShape& shape, float scale,
                                  Fp8Format forward_format, Fp8Format backward_format,
                                  cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Attention, stream);
  check_shape(shape, scale);
  FP8T_CHECK(dq && dk && dv && dout && q && k && v && out && stats && floats,
             "expected non-null pointers ({})", describe(shape, scale));
  const std::string context =
      fmt::format("FP8 SDPA backward ({} / {}), {}", format_name(forward_format),
                  format_name(backward_format), describe(shape, scale));
  const Fp8Key key = make_fp8_key(shape, scale, forward_format, backward_format);
  auto found = state_->fp8_backward_graphs.find(key);
  if (found == state_->fp8_backward_graphs.end()) {
    auto graph = new_fp8_graph(forward_format);
    fe::graph::Graph& g = *graph;
    Fp8Scalars scalars{g, {}};
    const fe::DataType_t gradient_type = cudnn_type(backward_format);
    const SdpaInputs in = sdpa_inputs(g, shape, true);
    in.dout->set_data_type(gradient_type);
    const auto attributes = masked(
        fe::graph::SDPA_fp8_backward_attributes().set_name("sdpa_fp8_backward"), shape, scale);
    auto [dq_tensor, dk_tensor, dv_tensor, amax_dq, amax_dk, amax_dv, amax_ds] =
        g.sdpa_fp8_backward(in.q, in.k, in.v, in.out, in.dout, in.stats, scalars.descale(kFp8Q),
                            scalars.descale(kFp8K), scalars.descale(kFp8V), scalars.descale(kFp8O),
                            scalars.descale(kFp8Dout), scalars.descale(kFp8P),
                            scalars.descale(kFp8Ds), scalars.scale(kFp8P), scalars.scale(kFp8Dq),
                            scalars.scale(kFp8Dk), scalars.scale(kFp8Dv), scalars.scale(kFp8Ds),
                            attributes);
    set_gradient_outputs(*dq_tensor, *dk_tensor, *dv_tensor, shape);
    dq_tensor->set_data_type(gradient_type);
    dk_tensor->set_data_type(gradient_type);
    dv_tensor->set_data_type(gradient_type);
    scalars.amax_output(*amax_dq, kFp8Dq);
    scalars.amax_output(*amax_dk, kFp8Dk);
    scalars.amax_output(*amax_dv, kFp8Dv);
    scalars.amax_output(*amax_ds, kFp8Ds);
    Built built = finish(graph, state_->handle, context);
    built.scalar_slots = std::move(scalars.slots);
    found = state_->fp8_backward_graphs.emplace(key, std::move(built)).first;
    ++state_->graphs_built;
  }
  std::unordered_map<int64_t, void*> pointers = {{kQ, const_cast<uint8_t*>(q)},
                                                 {kK, const_cast<uint8_t*>(k)},
                                                 {kV, const_cast<uint8_t*>(v)},
                                                 {kO, const_cast<uint8_t*>(out)},
                                                 {kDO, const_cast<uint8_t*>(dout)},
                                                 {kStats, const_cast<float*>(stats)},
                                                 {kDQ, dq},
                                                 {kDK, dk},
                                                 {kDV, dv}};
  add_fp8_scalars(pointers, found->second, floats);
  state_->execute(found->second, pointers, stream, context);
}

}  // namespace fp8t::ops::cuda

#endif  // FP8TRAIN_WITH_CUDA
