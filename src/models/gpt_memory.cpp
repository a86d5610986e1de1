#include "models/gpt_memory.h"

#include <algorithm>
#include <cstring>

namespace fp8t {

size_t ParameterSet::planned_bytes(const GptConfig& config, DType dtype) {
  size_t bytes = 0;
  for (const ParamSpec& spec : gpt_parameters(config))
    bytes += Arena::footprint(dtype, spec.numel());
  return bytes;
}

ParameterSet::ParameterSet(Arena& arena, const GptConfig& config, DType dtype)
    : specs_(gpt_parameters(config)) {
  for (const ParamSpec& spec : specs_) {
    TensorView view = spec.shape.size() == 1
                          ? arena.allocate(dtype, {spec.shape[0]})
                          : arena.allocate(dtype, {spec.shape[0], spec.shape[1]});
    tensors_.emplace(spec.name, view);
  }
}

TensorView& ParameterSet::operator[](const std::string& name) {
  const auto found = tensors_.find(name);
  FP8T_CHECK(found != tensors_.end(), "no parameter named '{}'", name);
  return found->second;
}

const TensorView& ParameterSet::operator[](const std::string& name) const {
  const auto found = tensors_.find(name);
  FP8T_CHECK(found != tensors_.end(), "no parameter named '{}'", name);
  return found->second;
}

void ParameterSet::fill_zero() {
  for (auto& [name, view] : tensors_)
    std::memset(view.raw(), 0, view.bytes());
}

template <typename Visit>
void GptActivations::visit(const GptConfig& config, int64_t batch, int64_t seq, DType dtype,
                           const RecomputeOptions& recompute, int tensor_parallel,
                           bool sequence_parallel, Visit&& visit_tensor) {
  const int64_t B = batch, T = seq, C = config.n_embd, D = config.head_dim();
  const int64_t H = config.n_head / tensor_parallel, Hkv = config.n_kv_head / tensor_parallel;
  const int64_t hidden = 4 * C / tensor_parallel;
  // A tensor of the residual stream's rows, `width` values each (1: one): [B, T, width], or
  // under sequence parallelism this rank's R rows, [R, width]. The embedding and the smear
  // before x0 run on every row.
  const int64_t R = B * T / tensor_parallel;
  const auto rows = [&](TensorView& view, DType type, int64_t width) {
    if (sequence_parallel && width == 1) {
      visit_tensor(view, type, {R});
    } else if (sequence_parallel) {
      visit_tensor(view, type, {R, width});
    } else if (width == 1) {
      visit_tensor(view, type, {B, T});
    } else {
      visit_tensor(view, type, {B, T, width});
    }
  };
  visit_tensor(embedding, dtype, {B, T, C});
  visit_tensor(embedding_rstd, dtype, {B, T});
  visit_tensor(embedding_norm, dtype, {B, T, C});
  visit_tensor(smear_gate, dtype, {B, T});
  rows(x0, dtype, C);
  const auto visit_block = [&](BlockActivations& block, bool temporaries, bool value_gate) {
    if (temporaries) rows(block.input, dtype, C);
    rows(block.attn_rstd, dtype, 1);
    rows(block.attn_norm, dtype, C);
    visit_tensor(block.q_rstd, dtype, {B, T, H});
    visit_tensor(block.k_rstd, dtype, {B, T, Hkv});
    visit_tensor(block.q, dtype, {B, T, H, D});
    visit_tensor(block.k, dtype, {B, T, Hkv, D});
    visit_tensor(block.v, dtype, {B, T, Hkv, D});
    if (value_gate) visit_tensor(block.value_gate, dtype, {B, T, Hkv});
    visit_tensor(block.logsumexp, dtype, {B, H, T});
    visit_tensor(block.attn_out, dtype, {B, T, H * D});
    if (temporaries) rows(block.mid, dtype, C);
    rows(block.mlp_rstd, dtype, 1);
    rows(block.mlp_norm, dtype, C);
    visit_tensor(block.fc, dtype, {B, T, hidden});
    if (temporaries) visit_tensor(block.fc_act, dtype, {B, T, hidden});
  };

  const bool selective = recompute.granularity == RecomputeGranularity::Selective;
  BlockActivations shared;  // selective: input, mid and fc_act of every block
  if (selective) {
    rows(shared.input, dtype, C);
    rows(shared.mid, dtype, C);
    visit_tensor(shared.fc_act, dtype, {B, T, hidden});
  }
  const std::vector<RecomputeGroup> groups = recompute_groups(recompute, config.n_layer);
  const std::vector<int> slots = recompute_slots(groups, config.n_layer);
  std::vector<BlockActivations> places(static_cast<size_t>(recompute_slot_count(groups)));
  for (BlockActivations& place : places) {
    // A value gate in every place: the last block has a value embedding at any depth.
    visit_block(place, true, true);
    rows(place.output, dtype, C);
  }
  blocks.resize(static_cast<size_t>(config.n_layer));
  for (int layer = 0; layer < config.n_layer; ++layer) {
    BlockActivations& block = blocks[static_cast<size_t>(layer)];
    const int slot = slots[static_cast<size_t>(layer)];
    if (slot < 0) {
      visit_block(block, !selective, config.has_value_embedding(layer));
      if (selective) {
        block.input = shared.input;
        block.mid = shared.mid;
        block.fc_act = shared.fc_act;
      }
      rows(block.output, dtype, C);
      continue;
    }
    block = places[static_cast<size_t>(slot)];
    if (!config.has_value_embedding(layer)) block.value_gate = TensorView();
    const bool last_of_group = recompute_group_ending_at(groups, layer) >= 0;
    if (last_of_group || layer == config.backout_layer()) rows(block.output, dtype, C);
  }
  rows(final_input, dtype, C);
  rows(final_rstd, dtype, 1);
  rows(final_norm, dtype, C);
  rows(logits, DType::F32, config.padded_vocab());
}

size_t GptActivations::planned_bytes(const GptConfig& config, int64_t batch, int64_t seq,
                                     DType dtype, const RecomputeOptions& recompute,
                                     int tensor_parallel, bool sequence_parallel) {
  GptActivations sizing;
  size_t bytes = 0;
  sizing.visit(config, batch, seq, dtype, recompute, tensor_parallel, sequence_parallel,
               [&](TensorView&, DType tensor_dtype, std::initializer_list<int64_t> shape) {
                 int64_t count = 1;
                 for (int64_t dim : shape)
                   count *= dim;
                 bytes += Arena::footprint(tensor_dtype, count);
               });
  return bytes;
}

GptActivations::GptActivations(Arena& arena, const GptConfig& config, int64_t batch, int64_t seq,
                               DType dtype, const RecomputeOptions& recompute, int tensor_parallel,
                               bool sequence_parallel) {
  visit(config, batch, seq, dtype, recompute, tensor_parallel, sequence_parallel,
        [&](TensorView& slot, DType tensor_dtype, std::initializer_list<int64_t> shape) {
          slot = arena.allocate(tensor_dtype, shape);
        });
}

template <typename Visit>
void GptWorkspace::visit(const GptConfig& config, int64_t tokens, int tensor_parallel,
                         bool sequence_parallel, Visit&& visit_tensor) {
  const int64_t N = tokens, C = config.n_embd, hidden = 4 * C / tensor_parallel;
  const int64_t R = sequence_parallel ? N / tensor_parallel : N;
  const int64_t q_width = int64_t{config.n_head} / tensor_parallel * config.head_dim();
  const int64_t kv_width = int64_t{config.n_kv_head} / tensor_parallel * config.head_dim();
  for (TensorView* view : {&q_lin, &dq, &dq_rot, &dq_lin})
    visit_tensor(*view, std::initializer_list<int64_t>{N, q_width});
  for (TensorView* view : {&k_lin, &value_embed, &dk, &dv, &dk_rot, &dk_lin, &dvalue_embed}) {
    visit_tensor(*view, std::initializer_list<int64_t>{N, kv_width});
  }
  for (TensorView* view : {&branch, &dnorm})
    visit_tensor(*view, std::initializer_list<int64_t>{N, C});
  for (TensorView* view : {&dx, &dx_next, &dx0, &dbackout, &dbranch})
    visit_tensor(*view, std::initializer_list<int64_t>{R, C});
  if (sequence_parallel) visit_tensor(gathered, std::initializer_list<int64_t>{N, C});
  visit_tensor(dattn_out, std::initializer_list<int64_t>{N, q_width});
  for (TensorView* view : {&dfc, &dfc_act})
    visit_tensor(*view, std::initializer_list<int64_t>{N, hidden});
}

size_t GptWorkspace::planned_bytes(const GptConfig& config, int64_t tokens, int tensor_parallel,
                                   bool sequence_parallel) {
  GptWorkspace sizing;
  size_t bytes = 0;
  sizing.visit(config, tokens, tensor_parallel, sequence_parallel,
               [&](TensorView&, std::initializer_list<int64_t> shape) {
                 bytes += Arena::footprint(DType::F32, shape.begin()[0] * shape.begin()[1]);
               });
  return bytes;
}

GptWorkspace::GptWorkspace(Arena& arena, const GptConfig& config, int64_t tokens,
                           int tensor_parallel, bool sequence_parallel) {
  visit(config, tokens, tensor_parallel, sequence_parallel,
        [&](TensorView& slot, std::initializer_list<int64_t> shape) {
          slot = arena.allocate(DType::F32, shape);
        });
}

GptMemoryPlan plan_gpt_memory(const GptConfig& config, int64_t batch, int64_t seq,
                              const RecomputeOptions& recompute, int tensor_parallel,
                              bool sequence_parallel) {
  GptMemoryPlan plan;
  plan.parameters = ParameterSet::planned_bytes(config, DType::F32);
  plan.gradients = plan.parameters;
  for (const ParamSpec& spec : gpt_parameters(config)) {
    const bool muon =
        spec.kind == ParamKind::BlockLinear || (spec.kind == ParamKind::Gate && spec.layer >= 0);
    if (muon) {
      plan.optimizer_state += Arena::footprint(DType::F32, spec.numel()) +
                              Arena::footprint(DType::F32, std::max(spec.shape[0], spec.shape[1]));
    } else {
      plan.optimizer_state += 2 * Arena::footprint(DType::F32, spec.numel());
    }
  }
  plan.activations = GptActivations::planned_bytes(config, batch, seq, DType::F32, recompute,
                                                   tensor_parallel, sequence_parallel);
  plan.workspace =
      GptWorkspace::planned_bytes(config, batch * seq, tensor_parallel, sequence_parallel);
  return plan;
}

}  // namespace fp8t
