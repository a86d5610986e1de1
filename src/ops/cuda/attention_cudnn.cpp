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

// Fixed tensor uids, so that a cached graph is executed with a plain uid → pointer map.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

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

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

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
  std::unique_ptr<DeviceBuffer<unsigned char>> workspace;
  int64_t graphs_built = 0;

  State() { check_cudnn(cudnnCreate(&handle), "cudnnCreate", "CudnnAttention"); }
  ~State() {
    // The plans hold descriptors made with the handle: release them first.
    forward_graphs.clear();
    backward_graphs.clear();
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
    auto q_tensor = bshd_tensor(*graph, "q", kQ, shape, shape.heads);
    auto k_tensor = bshd_tensor(*graph, "k", kK, shape, shape.kv_heads);
    auto v_tensor = bshd_tensor(*graph, "v", kV, shape, shape.kv_heads);
    auto attributes = fe::graph::SDPA_attributes()
                          .set_name("sdpa_forward")
                          .set_generate_stats(true)
                          .set_causal_mask(shape.causal)
                          .set_attn_scale(scale);
    if (has_window(shape))
      attributes.set_diagonal_band_left_bound(static_cast<int>(shape.window + 1));
    auto [o_tensor, stats_tensor] = graph->sdpa(q_tensor, k_tensor, v_tensor, attributes);
    set_output_bshd(*o_tensor, "out", kO, shape, shape.heads);
    stats_tensor->set_output(true)
        .set_name("stats")
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim(shape))
        .set_stride(stats_stride(shape));
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
    auto q_tensor = bshd_tensor(*graph, "q", kQ, shape, shape.heads);
    auto k_tensor = bshd_tensor(*graph, "k", kK, shape, shape.kv_heads);
    auto v_tensor = bshd_tensor(*graph, "v", kV, shape, shape.kv_heads);
    auto o_tensor = bshd_tensor(*graph, "out", kO, shape, shape.heads);
    auto do_tensor = bshd_tensor(*graph, "dout", kDO, shape, shape.heads);
    auto stats_tensor = graph->tensor(fe::graph::Tensor_attributes()
                                          .set_name("stats")
                                          .set_uid(kStats)
                                          .set_data_type(fe::DataType_t::FLOAT)
                                          .set_dim(stats_dim(shape))
                                          .set_stride(stats_stride(shape)));
    auto attributes = fe::graph::SDPA_backward_attributes()
                          .set_name("sdpa_backward")
                          .set_causal_mask(shape.causal)
                          .set_attn_scale(scale);
    if (has_window(shape))
      attributes.set_diagonal_band_left_bound(static_cast<int>(shape.window + 1));
    auto [dq_tensor, dk_tensor, dv_tensor] = graph->sdpa_backward(
        q_tensor, k_tensor, v_tensor, o_tensor, do_tensor, stats_tensor, attributes);
    set_output_bshd(*dq_tensor, "dq", kDQ, shape, shape.heads);
    set_output_bshd(*dk_tensor, "dk", kDK, shape, shape.kv_heads);
    set_output_bshd(*dv_tensor, "dv", kDV, shape, shape.kv_heads);
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

}  // namespace fp8t::ops::cuda

#endif  // FP8TRAIN_WITH_CUDA
