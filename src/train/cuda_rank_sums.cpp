#if FP8TRAIN_WITH_NCCL

#include "train/cuda_rank_sums.h"

namespace fp8t::train {

GptRankSums::GptRankSums(distributed::Communicator& host, CudaGptModel& model,
                         bool overlap_grad_reduce)
    : model_(model),
      overlap_(overlap_grad_reduce),
      delayed_(!model.delayed_scalings().empty()),
      nccl_(std::make_unique<distributed::NcclGroup>(host)) {}

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

void GptRankSums::reduce_amaxes() {
  if (!delayed_) return;
  CudaLinearScalings& scalings = model_.scalings();
  nccl_->max(scalings.device_floats(), scalings.float_count(), model_.stream());
}

FluxRankSums::FluxRankSums(distributed::Communicator& host, CudaFluxModel& model)
    : model_(model),
      delayed_(!model.delayed_scalings().empty()),
      nccl_(std::make_unique<distributed::NcclGroup>(host)) {}

void FluxRankSums::sum_gradients() {
  nccl_->sum(model_.gradients(), static_cast<size_t>(model_.layout().total_elements),
             model_.stream());
}

void FluxRankSums::reduce_amaxes() {
  if (!delayed_) return;
  CudaLinearScalings& scalings = model_.scalings();
  nccl_->max(scalings.device_floats(), scalings.float_count(), model_.stream());
}

}  // namespace fp8t::train

#endif  // FP8TRAIN_WITH_NCCL
