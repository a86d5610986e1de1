#if FP8TRAIN_WITH_NCCL

#include "train/cuda_rank_sums.h"

#include "core/error.h"

namespace fp8t::train {

namespace {

// Each parameter of the layout, where it lives (fp32, or bf16 from bf16_offset on), and the
// rank that updates it.
std::vector<distributed::NcclGroup::Piece> parameter_pieces(
    const optim::DeviceParameterLayout& layout, float* parameters, bf16* bf16_parameters,
    const optim::OptimizerShard& shard) {
  std::vector<distributed::NcclGroup::Piece> pieces;
  for (const optim::DeviceParameter& parameter : layout.parameters) {
    void* data = parameter.bf16
                     ? static_cast<void*>(bf16_parameters + (parameter.offset - layout.bf16_offset))
                     : static_cast<void*>(parameters + parameter.offset);
    const size_t element_bytes = parameter.bf16 ? sizeof(bf16) : sizeof(float);
    pieces.push_back(
        {data, static_cast<size_t>(parameter.numel) * element_bytes, shard.owner(parameter.name)});
  }
  return pieces;
}

}  // namespace

GptRankSums::GptRankSums(distributed::Communicator& host, CudaGptModel& model,
                         const distributed::ParallelLayout& layout, bool overlap_grad_reduce,
                         const optim::OptimizerShard* shard)
    : model_(model),
      overlap_(overlap_grad_reduce),
      delayed_(!model.delayed_scalings().empty()),
      nccl_(std::make_unique<distributed::NcclGroup>(host)) {
  FP8T_CHECK(layout.tensor == 1 || !overlap_grad_reduce,
             "overlapped gradient sums would reduce the gradients before the tensor-parallel "
             "group's sums of them");
  // A split linear's amax is the group's already; a replicated one's is the same on every rank.
  if (layout.tensor > 1) nccl_ = nccl_->data_parallel_group(layout);
  if (shard != nullptr) {
    parameter_pieces_ =
        parameter_pieces(model.layout(), model.parameters(), model.bf16_parameters(), *shard);
  }
}

void GptRankSums::last_backward() {
  if (!overlap_) return model_.backward();
  model_.set_gradients_ready([this](int64_t offset, int64_t count) {
    nccl_->sum_after(model_.gradients() + offset, static_cast<size_t>(count), model_.stream());
  });
  model_.backward();
  model_.set_gradients_ready(nullptr);
}

void GptRankSums::sum_gradients() {
  if (overlap_) return nccl_->join(model_.stream());
  nccl_->sum(model_.gradients(), static_cast<size_t>(model_.layout().total_elements),
             model_.stream());
}

void GptRankSums::after_update() {
  if (!parameter_pieces_.empty()) nccl_->broadcast(parameter_pieces_, model_.stream());
  if (!delayed_) return;
  CudaLinearScalings& scalings = model_.scalings();
  nccl_->max(scalings.device_floats(), scalings.float_count(), model_.stream());
}

FluxRankSums::FluxRankSums(distributed::Communicator& host, CudaFluxModel& model,
                           const distributed::ParallelLayout& layout,
                           const optim::OptimizerShard* shard)
    : model_(model),
      delayed_(!model.delayed_scalings().empty()),
      nccl_(std::make_unique<distributed::NcclGroup>(host)) {
  // A split linear's amax is the group's already; a replicated one's is the same on every rank.
  if (layout.tensor > 1) nccl_ = nccl_->data_parallel_group(layout);
  if (shard != nullptr) {
    parameter_pieces_ = parameter_pieces(model.layout(), model.parameters(), nullptr, *shard);
  }
}

void FluxRankSums::sum_gradients() {
  nccl_->sum(model_.gradients(), static_cast<size_t>(model_.layout().total_elements),
             model_.stream());
}

void FluxRankSums::after_update() {
  if (!parameter_pieces_.empty()) nccl_->broadcast(parameter_pieces_, model_.stream());
  if (!delayed_) return;
  CudaLinearScalings& scalings = model_.scalings();
  nccl_->max(scalings.device_floats(), scalings.float_count(), model_.stream());
}

}  // namespace fp8t::train

#endif  // FP8TRAIN_WITH_NCCL
