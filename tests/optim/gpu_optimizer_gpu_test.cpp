// CudaGptOptimizer against GptOptimizer (MuonPrecision::Bf16) on the CPU, step for step, for a
// small GPT whose Muon groups are square, tall, wide and a 1x12 gate, with the embedding tables
// in fp32 and in bf16 (the GPU model's storage); the gradient norm and the
// clipping against optim/clip.h; the state's download, upload and round trip; the device
// parameter layout the model and the optimizer share. Inputs are fresh random draws (replay with
// the FP8T_TEST_SEED a failure prints); the device parameters start poisoned, and the gaps between
// tensors must stay so. FP8T_TEST_VERBOSE=1 prints every comparison's error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/arena.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "gemm/cublaslt_gemm.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "models/host_parameters.h"
#include "numerics/test_util.h"
#include "ops/gpu_compare.h"
#include "optim/clip.h"
#include "optim/cuda/device_parameters.h"
#include "optim/cuda/gpu_optimizer.h"
#include "optim/gpt_optimizer.h"

namespace fp8t::optim {
namespace {

// Tensors in gpt_parameters() order, each at a 256-byte boundary: the layout CudaGptModel's
// DeviceArena gives its parameters, so both agree on every offset.
TEST(DeviceParameterLayout, AlignsEveryTensorIn256BytesInModelOrder) {
  GptConfig config = GptConfig::from_depth(2);
  config.vocab_size = 100;
  const std::vector<ParamSpec> specs = gpt_parameters(config);
  const DeviceParameterLayout layout = device_parameter_layout(config);
  ASSERT_EQ(layout.parameters.size(), specs.size());
  int64_t next = 0;
  for (size_t index = 0; index < specs.size(); ++index) {
    const DeviceParameter& parameter = layout.parameters[index];
    EXPECT_EQ(parameter.name, specs[index].name);
    EXPECT_EQ(parameter.shape, specs[index].shape);
    EXPECT_EQ(parameter.numel, specs[index].numel());
    EXPECT_EQ(parameter.offset, next) << parameter.name;
    next += (parameter.numel + 63) / 64 * 64;
  }
  EXPECT_EQ(layout.total_elements, next);
  EXPECT_EQ(layout.total_bytes(), static_cast<size_t>(next) * 4);
  EXPECT_EQ(layout["smear_lambda"].numel, 1);
  EXPECT_EQ(device_parameter_layout(specs, 2)["smear_lambda"].offset % 128, 0);
  EXPECT_THROW(static_cast<void>(layout["no.such.weight"]), Error);
  EXPECT_EQ(layout.bf16_offset, layout.total_elements);
  EXPECT_EQ(layout.bf16_parameter_elements(), 0);
}

// With the embedding tables in bf16 they come last, in model order: every other tensor keeps
// one offset for its fp32 value and its gradient, inside the first bf16_offset elements.
TEST(DeviceParameterLayout, PutsBf16EmbeddingTablesLast) {
  GptConfig config = GptConfig::from_depth(2);
  config.vocab_size = 100;
  const DeviceParameterLayout layout = device_parameter_layout(config, /*bf16_embeddings=*/true);
  std::vector<std::string> order, expected_fp32, expected_bf16;
  for (const ParamSpec& spec : gpt_parameters(config))
    (spec.kind == ParamKind::Embedding ? expected_bf16 : expected_fp32).push_back(spec.name);
  ASSERT_EQ(expected_bf16.size(), 2u);  // wte and layer 1's value embedding
  int64_t next = 0;
  for (const DeviceParameter& parameter : layout.parameters) {
    order.push_back(parameter.name);
    EXPECT_EQ(parameter.offset, next) << parameter.name;
    EXPECT_EQ(parameter.bf16, parameter.offset >= layout.bf16_offset) << parameter.name;
    next += (parameter.numel + 63) / 64 * 64;
  }
  expected_fp32.insert(expected_fp32.end(), expected_bf16.begin(), expected_bf16.end());
  EXPECT_EQ(order, expected_fp32);
  EXPECT_EQ(layout.total_elements, next);
  EXPECT_EQ(layout.bf16_offset, layout["transformer.wte.weight"].offset);
  EXPECT_EQ(layout.bf16_parameter_elements(), layout.total_elements - layout.bf16_offset);
}

// A tensor-parallel rank's layout holds its shares of the split tensors: a run of whole rows
// (q, k, v, the MLP's first linear, the value gates) or of each row's columns (the output
// projections, the value embeddings), at the rank's place in the whole tensor; the rest whole.
TEST(DeviceParameterLayout, HoldsATensorParallelRanksShares) {
  GptConfig config = GptConfig::from_depth(2);
  config.vocab_size = 100;
  config.n_head = config.n_kv_head = 2;  // a pair splits the heads, and the value gates' rows
  const DeviceParameterLayout whole = device_parameter_layout(config, /*bf16_embeddings=*/true);
  const DeviceParameterLayout rank = device_parameter_layout(config, true, 2, 1);
  EXPECT_EQ(rank.tensor_parallel, 2);
  EXPECT_EQ(rank.tensor_rank, 1);
  ASSERT_EQ(rank.parameters.size(), whole.parameters.size());
  const int64_t C = config.n_embd;
  const DeviceParameter& q = rank["transformer.h.0.attn.c_q.weight"];
  EXPECT_EQ(q.split, TensorSplit::Outputs);
  EXPECT_EQ(q.shape, (std::vector<int64_t>{C / 2, C}));
  EXPECT_EQ(q.whole_shape, (std::vector<int64_t>{C, C}));
  EXPECT_EQ(q.whole_numel(), C * C);
  const ShareRows q_rows = rank.share_rows(q);
  EXPECT_EQ(q_rows.whole_first, C / 2 * C);
  EXPECT_EQ(q_rows.whole_cols, C);
  const DeviceParameter& proj = rank["transformer.h.0.mlp.c_proj.weight"];
  EXPECT_EQ(proj.split, TensorSplit::Inputs);
  EXPECT_EQ(proj.shape, (std::vector<int64_t>{C, 2 * C}));
  const ShareRows proj_rows = rank.share_rows(proj);
  EXPECT_EQ(proj_rows.whole_first, 2 * C);
  EXPECT_EQ(proj_rows.whole_cols, 4 * C);
  const DeviceParameter& table = rank["value_embeds.1.weight"];
  EXPECT_EQ(table.split, TensorSplit::Inputs);
  EXPECT_TRUE(table.bf16);
  EXPECT_EQ(table.shape[1], config.kv_dim() / 2);
  EXPECT_EQ(rank["transformer.h.1.attn.ve_gate.weight"].split, TensorSplit::Outputs);
  for (const std::string name : {"transformer.wte.weight", "lm_head.weight", "resid_lambdas"}) {
    EXPECT_EQ(rank[name].split, TensorSplit::None) << name;
    EXPECT_EQ(rank[name].shape, whole[name].shape) << name;
    EXPECT_EQ(rank[name].whole_numel(), whole[name].numel) << name;
  }
  // The share of a whole host tensor: rank 1's columns of each row.
  std::vector<float> values(static_cast<size_t>(C * 4 * C));
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = static_cast<float>(i);
  const std::vector<float> share = host_share(rank, proj, values.data());
  ASSERT_EQ(std::ssize(share), proj.numel);
  EXPECT_EQ(share[0], static_cast<float>(2 * C));
  EXPECT_EQ(share[size_t(2 * C)], static_cast<float>(4 * C + 2 * C));  // row 1's first
  EXPECT_THROW(device_parameter_layout(config, true, 2, 2), Error);
  config.n_head = config.n_kv_head = 1;  // one value gate row: no pair splits it
  EXPECT_THROW(device_parameter_layout(config, true, 2, 0), Error);
}

using test::expect_close;
using test::TestRng;
using test::Tolerance;

// AdamW runs the CPU's fp32 operations in the CPU's order (no FMA contraction on either side):
// equal bit for bit, so any bound above fp32 rounding catches a wrong formula. Nesterov's
// momentum is the same plain fp32 arithmetic.
constexpr Tolerance kExact{1e-6, 1e-6, 0.0};

// nanochat_muon_weight_decay scales nanochat's 0.28 by D_ref / D to about 16 for this small
// model, a decay ten times Muon's step: the comparison would then measure the cautious mask, which
// the bf16 noise toggles on every update element near zero, instead of the update. At this value
// the decay is a quarter to a half of the step, large enough that a mask left out still shows.
constexpr double kMuonWeightDecay = 0.005;

// Muon orthogonalizes in bf16: where the GPU's fp32 GEMM sums and OpenBLAS's round a bf16
// result differently, Polar Express carries the flip on and amplifies it, and one flip is as good
// as many. A CPU emulation of that (the reference against a copy that rounds a random 0.5 % or
// 5 % of every Polar Express GEMM output to its other bf16 neighbour; this test's shapes,
// gradients and weight decay, 4 steps side by side and 1 step from a shared state, 3 or 4 seeds)
// moved a group's displacement by up to 5.3 % (norm) and one element by 37 % of the largest,
// NorMuon's second moment by up to 4.2 % (the 1x12 gate; 0.6 % elsewhere) and one of its values
// by 12 %. The mistakes this test must catch move them more, in the same emulation: without
// NorMuon on the non-square groups the displacement by 15 to 53 % and the second moment by 29 %
// (one step) to 100 %; without MuonEq 26 to 51 % (groups of more than one row); with the
// update's sign flipped 196 %; with the lr's shape scaling left out or swapped 42 to 246 % (the
// groups it changes); with the cautious mask left out 13 to 28 %.
constexpr Tolerance kMuonDisplacement{0.1, 0.0, 0.6};
constexpr Tolerance kSecondMoment{0.12, 0.0, 0.2};

// Two layers of width 256 with grouped attention (2 query heads, 1 kv head): Muon groups
// [1, 12] (the value-embedding gate), [128, 256] (c_k, c_v: wide), [256, 256], [256, 1024]
// (wide) and [1024, 256] (tall).
GptConfig test_config() {
  GptConfig config = GptConfig::from_depth(2);
  config.n_embd = 256;
  config.n_head = 2;
  config.n_kv_head = 1;
  config.vocab_size = 100;
  config.sequence_len = 64;
  config.validate();
  return config;
}

OptimizerSettings optimizer_settings(OptimizerKind kind, bool bf16_embeddings) {
  OptimizerSettings settings;
  settings.kind = kind;
  settings.muon_precision = MuonPrecision::Bf16;
  settings.weight_decay = kMuonWeightDecay;
  settings.bf16_embeddings = bf16_embeddings;
  return settings;
}

StepSchedule schedule_at(int step) {
  return {.lr_multiplier = 1.0 - 0.05 * step,
          .muon_momentum = 0.85 + 0.03 * step,
          .weight_decay_multiplier = 1.0 - 0.1 * step};
}

using HostSet = testing::HostParameters;  // fp32 parameters (or gradients)

// A Muon gradient that gives every step of muon.h work: rows of magnitudes 2^-3 to 2^3 (which
// MuonEq evens out) and, along the longer side, a first half of lines that share an eighth as
// many directions (so that the orthogonalized lines differ in norm and NorMuon rescales them).
void fill_muon_gradient(TestRng& rng, float* grad, int64_t rows, int64_t cols) {
  std::normal_distribution<float> normal;
  const bool by_rows = rows >= cols;
  const int64_t lines = by_rows ? rows : cols, width = by_rows ? cols : rows;
  const int64_t directions = std::max<int64_t>(1, lines / 16);
  std::vector<float> base(static_cast<size_t>(lines * width));
  for (float& value : base)
    value = normal(rng.engine());
  for (int64_t line = 0; line < lines; ++line) {
    const int64_t source = line < lines / 2 ? line % directions : line;
    for (int64_t t = 0; t < width; ++t) {
      const float value =
          base[static_cast<size_t>(source * width + t)] + 0.3f * normal(rng.engine());
      grad[by_rows ? line * cols + t : t * cols + line] = value;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = std::ldexp(1.0f, rng.uniform_int(-3, 3));
    for (int64_t c = 0; c < cols; ++c)
      grad[r * cols + c] *= scale;
  }
}

void fill_gradients(TestRng& rng, const GptOptimizer& optimizer, HostSet& grads) {
  std::normal_distribution<float> normal;
  for (const ParamSpec& spec : grads.set.specs()) {
    float* grad = grads[spec.name];
    if (optimizer.group_of(spec.name).rule == UpdateRule::Muon) {
      fill_muon_gradient(rng, grad, spec.shape[0], spec.shape[1]);
      continue;
    }
    const float scale = std::ldexp(1.0f, rng.uniform_int(-4, 2));
    for (int64_t i = 0; i < spec.numel(); ++i)
      grad[i] = scale * normal(rng.engine());
  }
}

void fill_parameters(TestRng& rng, HostSet& params) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (const ParamSpec& spec : params.set.specs()) {
    float* param = params[spec.name];
    for (int64_t i = 0; i < spec.numel(); ++i)
      param[i] = normal(rng.engine());
  }
}

// Copies every tensor to its place in the device buffer, the layout's bf16 tensors rounded into
// `device_bf16` when given (parameters; gradients are all fp32); the gaps keep what they hold.
void upload(const ParameterSet& set, const DeviceParameterLayout& layout, float* device,
            bf16* device_bf16 = nullptr) {
  for (const DeviceParameter& parameter : layout.parameters) {
    const float* values = set[parameter.name].data<float>();
    if (device_bf16 != nullptr && parameter.bf16) {
      std::vector<bf16> rounded(static_cast<size_t>(parameter.numel));
      std::transform(values, values + parameter.numel, rounded.begin(), float_to_bf16);
      FP8T_CUDA_CHECK(cudaMemcpy(device_bf16 + (parameter.offset - layout.bf16_offset),
                                 rounded.data(), rounded.size() * sizeof(bf16),
                                 cudaMemcpyHostToDevice));
      continue;
    }
    FP8T_CUDA_CHECK(cudaMemcpy(device + parameter.offset, values,
                               static_cast<size_t>(parameter.numel) * sizeof(float),
                               cudaMemcpyHostToDevice));
  }
}

std::vector<double> values_of(const float* data, int64_t count) {
  return std::vector<double>(data, data + count);
}

// The device side of a run: parameters (the gaps between tensors poisoned; the bf16 ones in
// their own buffer) and gradients in the layout, and the parameters' starting values, from which
// Muon's displacement is measured.
struct DeviceRun {
  std::map<std::string, std::vector<float>> start;
  DeviceBuffer<float> params, grads;
  DeviceBuffer<bf16> bf16_params;

  DeviceRun(HostSet& host, const DeviceParameterLayout& layout)
      : params(static_cast<size_t>(layout.total_elements)),
        grads(static_cast<size_t>(layout.total_elements)),
        bf16_params(static_cast<size_t>(std::max<int64_t>(1, layout.bf16_parameter_elements()))) {
    for (const ParamSpec& spec : host.set.specs()) {
      const float* data = host[spec.name];
      start[spec.name].assign(data, data + spec.numel());
    }
    upload(host.set, layout, params.get(), bf16_params.get());
  }
};

bool is_poison(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits == 0xA5A5A5A5u;
}

// The parameter: whether the embedding tables are stored in bf16.
class CudaGptOptimizerTest : public ::testing::TestWithParam<bool> {
 protected:
  OptimizerSettings settings_of(OptimizerKind kind) const {
    return optimizer_settings(kind, GetParam());
  }

  void SetUp() override { FP8T_CUDA_CHECK(cudaStreamCreate(&stream_)); }
  void TearDown() override { cudaStreamDestroy(stream_); }

  // The device parameters against the host's, group by group: AdamW tensors as they are, Muon
  // matrices as their displacement from the start (the parameters themselves hide a wrong
  // update behind the parameter's size). The gaps between tensors must still hold the poison.
  void compare_parameters(const GptOptimizer& reference, const HostSet& params,
                          const DeviceRun& run, const std::string& when) {
    const std::vector<float> gpu = run.params.download();
    const std::vector<bf16> gpu_bf16 = run.bf16_params.download();
    for (const OptimizerGroup& group : reference.groups()) {
      const bool muon = group.rule == UpdateRule::Muon;
      std::vector<double> gpu_values, cpu_values;
      for (const std::string& name : group.parameters) {
        const DeviceParameter& parameter = layout_[name];
        const float* cpu = params.set[name].data<float>();
        for (int64_t i = 0; i < parameter.numel; ++i) {
          const double origin = muon ? run.start.at(name)[static_cast<size_t>(i)] : 0.0;
          const float value =
              parameter.bf16
                  ? bf16_to_float(
                        gpu_bf16[static_cast<size_t>(parameter.offset - layout_.bf16_offset + i)])
                  : gpu[static_cast<size_t>(parameter.offset + i)];
          gpu_values.push_back(value - origin);
          cpu_values.push_back(cpu[i] - origin);
        }
      }
      expect_close(gpu_values, cpu_values, muon ? kMuonDisplacement : kExact,
                   when + ", group '" + group.name + (muon ? "' (displacement)" : "'"));
    }
    int64_t overwritten = 0, tensor_end = 0;
    for (const DeviceParameter& parameter : layout_.parameters) {
      for (int64_t i = tensor_end; i < parameter.offset; ++i)
        overwritten += is_poison(gpu[static_cast<size_t>(i)]) ? 0 : 1;
      tensor_end = parameter.offset + parameter.numel;
    }
    EXPECT_EQ(overwritten, 0) << when << ": the step wrote between tensors";
  }

  // The device state, downloaded into `staging`, against the host optimizer's own (with a
  // sharded `staging`, the buffers of its rank's parameters).
  void compare_state(CudaGptOptimizer& gpu, GptOptimizer& staging, GptOptimizer& reference,
                     const std::string& when) {
    gpu.download_state(staging);
    std::map<std::string, TensorView> expected;
    for (const NamedTensor& buffer : reference.state())
      expected.emplace(buffer.name, buffer.view);
    for (const NamedTensor& buffer : staging.state()) {
      if (buffer.view.dtype() == DType::F32 &&
          !staging.shard().owns(parameter_of_state(buffer.name))) {
        continue;
      }
      const TensorView& cpu = expected.at(buffer.name);
      if (buffer.view.dtype() == DType::I64) {
        EXPECT_EQ(*buffer.view.data<int64_t>(), *cpu.data<int64_t>())
            << when << ": " << buffer.name;
        continue;
      }
      const bool second_moment = buffer.name.ends_with(".second_moment");
      expect_close(values_of(buffer.view.data<float>(), buffer.view.numel()),
                   values_of(cpu.data<float>(), cpu.numel()),
                   second_moment ? kSecondMoment : kExact, when + ", state " + buffer.name);
    }
  }

  // Steps the CPU and the GPU optimizer of `kind` side by side and compares after each step.
  void run_side_by_side(OptimizerKind kind, int steps) {
    SCOPED_TRACE(rng_.trace());
    const OptimizerSettings settings = settings_of(kind);
    GptOptimizer reference(config_, settings, kReferenceBatchTokens);
    GptOptimizer staging(config_, settings, kReferenceBatchTokens);
    CudaGptOptimizer gpu(staging, layout_, gemm_);
    std::printf("[ memory   ] state %zu bytes (CPU %zu), workspace %zu bytes\n",
                gpu.device_state_bytes(), reference.state_bytes(), gpu.device_workspace_bytes());

    HostSet params(config_), grads(config_);
    fill_parameters(rng_, params);
    DeviceRun run(params, layout_);
    for (int step = 0; step < steps; ++step) {
      fill_gradients(rng_, reference, grads);
      upload(grads.set, layout_, run.grads.get());
      const StepSchedule schedule = schedule_at(step);
      reference.step(params.set, grads.set, schedule);
      gpu.step(run.params.get(), run.bf16_params.get(), run.grads.get(), schedule, stream_);
      const std::string when = "step " + std::to_string(step + 1);
      compare_parameters(reference, params, run, when);
      ASSERT_EQ(gpu.steps_taken(), reference.steps_taken());
      for (size_t group = 0; group < reference.groups().size(); ++group)
        EXPECT_EQ(gpu.groups()[group].lr, reference.groups()[group].lr) << when;
    }
    compare_state(gpu, staging, reference, "after " + std::to_string(steps) + " steps");
  }

  // ZeRO-1 on `ranks` ranks, emulated on one GPU: each rank's optimizer (state for its own
  // parameters only) steps its own copy of the parameters, then every parameter is copied from
  // its owner to the others, as GptRankSums::gather_parameters broadcasts it. Every copy must
  // follow the CPU's unsharded steps, and each rank's state the CPU's for its parameters.
  void run_sharded(OptimizerKind kind, int ranks, int steps) {
    SCOPED_TRACE(rng_.trace());
    const OptimizerSettings settings = settings_of(kind);
    GptOptimizer reference(config_, settings, kReferenceBatchTokens);
    const CudaGptOptimizer whole(reference, layout_, gemm_);
    std::vector<std::unique_ptr<GptOptimizer>> staging;
    std::vector<std::unique_ptr<CudaGptOptimizer>> gpus;
    size_t state_bytes = 0;
    for (int rank = 0; rank < ranks; ++rank) {
      staging.push_back(
          std::make_unique<GptOptimizer>(config_, settings, kReferenceBatchTokens, rank, ranks));
      gpus.push_back(std::make_unique<CudaGptOptimizer>(*staging.back(), layout_, gemm_));
      EXPECT_LT(gpus.back()->device_state_bytes(), whole.device_state_bytes()) << "rank " << rank;
      state_bytes += gpus.back()->device_state_bytes();
    }
    std::printf("[ memory   ] state %zu bytes whole, %zu on %d ranks together\n",
                whole.device_state_bytes(), state_bytes, ranks);

    HostSet params(config_), grads(config_);
    fill_parameters(rng_, params);
    std::vector<std::unique_ptr<DeviceRun>> runs;
    for (int rank = 0; rank < ranks; ++rank)
      runs.push_back(std::make_unique<DeviceRun>(params, layout_));
    for (int step = 0; step < steps; ++step) {
      fill_gradients(rng_, reference, grads);
      const StepSchedule schedule = schedule_at(step);
      reference.step(params.set, grads.set, schedule);
      for (int rank = 0; rank < ranks; ++rank) {
        DeviceRun& run = *runs[size_t(rank)];
        upload(grads.set, layout_, run.grads.get());
        gpus[size_t(rank)]->step(run.params.get(), run.bf16_params.get(), run.grads.get(), schedule,
                                 stream_);
      }
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      for (const DeviceParameter& parameter : layout_.parameters) {
        const DeviceRun& owner = *runs[size_t(staging[0]->shard().owner(parameter.name))];
        for (const auto& run : runs) {
          if (run.get() == &owner) continue;
          const int64_t at = parameter.offset - layout_.bf16_offset;
          FP8T_CUDA_CHECK(
              parameter.bf16
                  ? cudaMemcpy(run->bf16_params.get() + at, owner.bf16_params.get() + at,
                               size_t(parameter.numel) * sizeof(bf16), cudaMemcpyDeviceToDevice)
                  : cudaMemcpy(run->params.get() + parameter.offset,
                               owner.params.get() + parameter.offset,
                               size_t(parameter.numel) * sizeof(float), cudaMemcpyDeviceToDevice));
        }
      }
      for (int rank = 0; rank < ranks; ++rank) {
        compare_parameters(reference, params, *runs[size_t(rank)],
                           "step " + std::to_string(step + 1) + ", rank " + std::to_string(rank));
      }
    }
    for (int rank = 0; rank < ranks; ++rank) {
      compare_state(*gpus[size_t(rank)], *staging[size_t(rank)], reference,
                    "rank " + std::to_string(rank) + " after " + std::to_string(steps) + " steps");
    }
  }

  TestRng rng_;
  GptConfig config_ = test_config();
  DeviceParameterLayout layout_ = device_parameter_layout(config_, GetParam());
  cudaStream_t stream_ = nullptr;
  gemm::CublasLtGemm gemm_;
};

TEST_P(CudaGptOptimizerTest, MuonStepsMatchCpuBf16) {
  run_side_by_side(OptimizerKind::Muon, 4);
}

TEST_P(CudaGptOptimizerTest, AdamWStepsMatchCpu) {
  run_side_by_side(OptimizerKind::AdamW, 4);
}

// 3 ranks: each Muon group of 2 matrices leaves one rank without a matrix of it.
TEST_P(CudaGptOptimizerTest, ShardedMuonStepsMatchCpuBf16) {
  run_sharded(OptimizerKind::Muon, 3, 3);
}

TEST_P(CudaGptOptimizerTest, ShardedAdamWStepsMatchCpu) {
  run_sharded(OptimizerKind::AdamW, 2, 3);
}

// A borrowed workspace (poisoned: DeviceBuffer starts so) gives the same steps and norms, bit
// for bit, as one of the optimizer's own, which it then does not allocate; a span too small
// for the workspace is not used.
TEST_P(CudaGptOptimizerTest, BorrowedWorkspaceGivesTheSameSteps) {
  SCOPED_TRACE(rng_.trace());
  const OptimizerSettings settings = settings_of(OptimizerKind::Muon);
  GptOptimizer host(config_, settings, kReferenceBatchTokens);
  CudaGptOptimizer own(host, layout_, gemm_);
  DeviceBuffer<uint8_t> lent(own.device_workspace_bytes());  // the tables' bytes to spare
  CudaGptOptimizer borrowing(host, layout_, gemm_, lent.get(), lent.count());
  EXPECT_FALSE(own.workspace_borrowed());
  EXPECT_TRUE(borrowing.workspace_borrowed());
  EXPECT_LT(borrowing.device_workspace_bytes(), own.device_workspace_bytes() / 2);
  DeviceBuffer<uint8_t> small(lent.count() / 2);
  const CudaGptOptimizer refused(host, layout_, gemm_, small.get(), small.count());
  EXPECT_FALSE(refused.workspace_borrowed());
  // planned_workspace_bytes is the least a lender must hold.
  const size_t workspace = CudaGptOptimizer::planned_workspace_bytes(host, layout_);
  const CudaGptOptimizer exact(host, layout_, gemm_, lent.get(), workspace);
  const CudaGptOptimizer short_by_one(host, layout_, gemm_, lent.get(), workspace - 1);
  EXPECT_TRUE(exact.workspace_borrowed());
  EXPECT_FALSE(short_by_one.workspace_borrowed());
  // The plan an engine checks before allocating is what each one took.
  for (const auto& [optimizer, lendable] : {std::pair<const CudaGptOptimizer*, size_t>{&own, 0},
                                            {&borrowing, lent.count()},
                                            {&refused, small.count()}}) {
    EXPECT_EQ(CudaGptOptimizer::planned_device_bytes(host, layout_, lendable),
              optimizer->device_state_bytes() + optimizer->device_workspace_bytes())
        << "lending " << lendable << " bytes";
  }

  HostSet params(config_), grads(config_);
  fill_parameters(rng_, params);
  DeviceRun with_own(params, layout_), with_borrowed(params, layout_);
  DeviceBuffer<float> norms(2);
  for (int step = 0; step < 3; ++step) {
    fill_gradients(rng_, host, grads);
    upload(grads.set, layout_, with_own.grads.get());
    upload(grads.set, layout_, with_borrowed.grads.get());
    own.global_norm(with_own.grads.get(), layout_.total_elements, norms.get(), stream_);
    borrowing.global_norm(with_borrowed.grads.get(), layout_.total_elements, norms.get() + 1,
                          stream_);
    own.step(with_own.params.get(), with_own.bf16_params.get(), with_own.grads.get(),
             schedule_at(step), stream_);
    borrowing.step(with_borrowed.params.get(), with_borrowed.bf16_params.get(),
                   with_borrowed.grads.get(), schedule_at(step), stream_);
    const std::vector<float> expected = with_own.params.download();
    const std::vector<float> actual = with_borrowed.params.download();
    ASSERT_EQ(std::memcmp(actual.data(), expected.data(), expected.size() * sizeof(float)), 0)
        << "step " << step + 1 << ": the parameters differ";
    const std::vector<bf16> expected_bf16 = with_own.bf16_params.download();
    const std::vector<bf16> actual_bf16 = with_borrowed.bf16_params.download();
    ASSERT_EQ(
        std::memcmp(actual_bf16.data(), expected_bf16.data(), expected_bf16.size() * sizeof(bf16)),
        0)
        << "step " << step + 1 << ": the bf16 parameters differ";
    const std::vector<float> norm = norms.download();
    EXPECT_EQ(norm[0], norm[1]) << "step " << step + 1;
  }
}

// A checkpoint's state continues on the GPU as on the CPU: two CPU steps, the state uploaded
// (after a round trip through the device that must give it back bit for bit), then one more
// step on both.
TEST_P(CudaGptOptimizerTest, UploadedStateContinuesLikeTheCpu) {
  SCOPED_TRACE(rng_.trace());
  const OptimizerSettings settings = settings_of(OptimizerKind::Muon);
  GptOptimizer reference(config_, settings, kReferenceBatchTokens);
  GptOptimizer staging(config_, settings, kReferenceBatchTokens);
  GptOptimizer returned(config_, settings, kReferenceBatchTokens);
  CudaGptOptimizer gpu(staging, layout_, gemm_);
  HostSet params(config_), grads(config_);
  fill_parameters(rng_, params);
  for (int step = 0; step < 2; ++step) {
    fill_gradients(rng_, reference, grads);
    reference.step(params.set, grads.set, schedule_at(step));
  }

  staging.load_state(reference.state());
  gpu.upload_state(staging);
  EXPECT_EQ(gpu.steps_taken(), 2);
  gpu.download_state(returned);
  std::map<std::string, TensorView> uploaded;
  for (const NamedTensor& buffer : staging.state())
    uploaded.emplace(buffer.name, buffer.view);
  for (const NamedTensor& buffer : returned.state()) {
    const TensorView& sent = uploaded.at(buffer.name);
    ASSERT_EQ(buffer.view.bytes(), sent.bytes()) << buffer.name;
    EXPECT_EQ(std::memcmp(buffer.view.raw(), sent.raw(), sent.bytes()), 0)
        << buffer.name << " changed on the round trip";
  }

  DeviceRun run(params, layout_);
  fill_gradients(rng_, reference, grads);
  upload(grads.set, layout_, run.grads.get());
  reference.step(params.set, grads.set, schedule_at(2));
  gpu.step(run.params.get(), run.bf16_params.get(), run.grads.get(), schedule_at(2), stream_);
  compare_parameters(reference, params, run, "step 3 from the uploaded state");
  compare_state(gpu, staging, reference, "step 3 from the uploaded state");
}

// The norm against clip.h's (double, then rounded to fp32 here), the same bits on a second
// run, and clipping: scaled when above max_norm, untouched at or below it and for a NaN norm.
TEST_P(CudaGptOptimizerTest, GlobalNormAndClipMatchCpu) {
  SCOPED_TRACE(rng_.trace());
  const OptimizerSettings settings = settings_of(OptimizerKind::Muon);
  GptOptimizer host(config_, settings, kReferenceBatchTokens);
  CudaGptOptimizer gpu(host, layout_, gemm_);
  HostSet grads(config_);
  fill_gradients(rng_, host, grads);
  std::vector<GradientSpan> spans;
  for (const ParamSpec& spec : grads.set.specs())
    spans.push_back({grads[spec.name], spec.numel()});
  const double cpu_norm = global_norm(spans);

  DeviceBuffer<float> device_grads(static_cast<size_t>(layout_.total_elements));
  device_grads.zero();  // the gaps count in the norm over the whole buffer
  upload(grads.set, layout_, device_grads.get());
  DeviceBuffer<float> norm(1), again(1);
  gpu.global_norm(device_grads.get(), layout_.total_elements, norm.get(), stream_);
  gpu.global_norm(device_grads.get(), layout_.total_elements, again.get(), stream_);
  const float gpu_norm = norm.download()[0];
  EXPECT_NEAR(gpu_norm, cpu_norm, 1e-6 * cpu_norm);
  EXPECT_EQ(std::memcmp(&gpu_norm, again.download().data(), sizeof gpu_norm), 0)
      << "two runs of the norm differ";

  const std::vector<float> before = device_grads.download();
  for (const float max_norm : {static_cast<float>(2.0 * cpu_norm), gpu_norm}) {
    gpu.clip(device_grads.get(), layout_.total_elements, norm.get(), max_norm, stream_);
    EXPECT_EQ(device_grads.download(), before) << "clipped at max_norm " << max_norm;
  }
  DeviceBuffer<float> nan_norm(std::vector<float>{std::nanf("")});
  gpu.clip(device_grads.get(), layout_.total_elements, nan_norm.get(), 1.0f, stream_);
  EXPECT_EQ(device_grads.download(), before) << "clipped by a NaN norm";

  const auto max_norm = static_cast<float>(0.25 * cpu_norm);
  gpu.clip(device_grads.get(), layout_.total_elements, norm.get(), max_norm, stream_);
  EXPECT_EQ(clip_gradients(spans, max_norm), cpu_norm);
  const std::vector<float> clipped = device_grads.download();
  for (const DeviceParameter& parameter : layout_.parameters) {
    expect_close(values_of(clipped.data() + parameter.offset, parameter.numel),
                 values_of(grads[parameter.name], parameter.numel), kExact,
                 "clipped " + parameter.name);
  }
}

// A layout or a host optimizer of another model or kind is refused, naming what differs.
TEST_P(CudaGptOptimizerTest, RejectsMismatchedLayoutAndHost) {
  GptOptimizer muon(config_, settings_of(OptimizerKind::Muon), kReferenceBatchTokens);
  GptOptimizer adamw(config_, settings_of(OptimizerKind::AdamW), kReferenceBatchTokens);
  const auto expect_error = [](const auto& call, const std::string& expected) {
    try {
      call();
      ADD_FAILURE() << "expected an error mentioning '" << expected << "'";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
  };
  DeviceParameterLayout missing = layout_;
  missing.parameters.pop_back();
  expect_error([&] { CudaGptOptimizer gpu(muon, missing, gemm_); },
               "holds no tensor named '" + layout_.parameters.back().name + "'");
  DeviceParameterLayout extra = layout_;
  DeviceParameter& added = extra.parameters.emplace_back();
  added.name = "extra.weight";
  added.shape = {4, 4};
  added.numel = 16;
  added.offset = layout_.total_elements;
  expect_error([&] { CudaGptOptimizer gpu(muon, extra, gemm_); },
               "expected the parameter 'extra.weight' in one optimizer group, found it in 0");
  CudaGptOptimizer gpu(muon, layout_, gemm_);
  expect_error([&] { gpu.download_state(adamw); }, "has no buffer 'transformer.h.0.attn.c_q");
}

INSTANTIATE_TEST_SUITE_P(EmbeddingStorage, CudaGptOptimizerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "Bf16Embeddings" : "Fp32Embeddings";
                         });

}  // namespace
}  // namespace fp8t::optim
