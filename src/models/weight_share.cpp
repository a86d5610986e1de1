#include "models/weight_share.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace fp8t {
namespace {

void add(float* to, const float* from, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    to[i] += from[i];
}

}  // namespace

WeightShare::WeightShare(int64_t whole_out, int64_t whole_in)
    : whole_in_(whole_in), out_(whole_out), in_(whole_in) {}

WeightShare::WeightShare(TensorSplit split, std::vector<ShareSegment> segments, int64_t whole_out,
                         int64_t whole_in)
    : split_(split), segments_(std::move(segments)), whole_in_(whole_in) {
  int64_t count = 0;
  for (const ShareSegment& segment : segments_) {
    FP8T_CHECK(
        segment.first >= 0 && segment.count > 0 &&
            segment.first + segment.count <= (split == TensorSplit::Outputs ? whole_out : whole_in),
        "expected a share segment within a weight [{}, {}], found {} from {}", whole_out, whole_in,
        segment.count, segment.first);
    count += segment.count;
  }
  FP8T_CHECK(split == TensorSplit::None || !segments_.empty(), "expected the share's segments");
  out_ = split == TensorSplit::Outputs ? count : whole_out;
  in_ = split == TensorSplit::Inputs ? count : whole_in;
  copied_ = split == TensorSplit::Inputs || (split == TensorSplit::Outputs && segments_.size() > 1);
  if (!copied_) return;
  const auto weights = static_cast<size_t>(out_ * in_);
  weight_copy_.resize(weights);
  weight_gradient_copy_.resize(weights);
  if (split == TensorSplit::Outputs) {
    bias_copy_.resize(static_cast<size_t>(out_));
    bias_gradient_copy_.resize(static_cast<size_t>(out_));
  }
}

int64_t WeightShare::in_place_first_row() const {
  return split_ == TensorSplit::Outputs ? segments_.front().first : 0;
}

void WeightShare::refresh(const float* whole_weight, const float* whole_bias) {
  const bool rows = split_ == TensorSplit::Outputs;
  if (!copied_) {
    const int64_t first = in_place_first_row();
    weight_ = whole_weight + first * in_;
    bias_ = whole_bias != nullptr ? whole_bias + first : nullptr;
    return;
  }
  weight_ = weight_copy_.data();
  bias_ = !rows ? whole_bias : whole_bias != nullptr ? bias_copy_.data() : nullptr;
  if (current_) return;
  current_ = true;
  for_each_run(in_, [&](int64_t whole, int64_t share, int64_t count) {
    std::copy_n(whole_weight + whole, count, weight_copy_.begin() + share);
  });
  if (rows && whole_bias != nullptr) {
    for_each_run(1, [&](int64_t whole, int64_t share, int64_t count) {
      std::copy_n(whole_bias + whole, count, bias_copy_.begin() + share);
    });
  }
}

void WeightShare::begin_gradients(float* whole_weight_gradient, float* whole_bias_gradient) {
  const bool rows = split_ == TensorSplit::Outputs;
  whole_weight_gradient_ = whole_weight_gradient;
  whole_bias_gradient_ = whole_bias_gradient;
  if (!copied_) {
    const int64_t first = in_place_first_row();
    weight_gradient_ = whole_weight_gradient + first * in_;
    bias_gradient_ = whole_bias_gradient != nullptr ? whole_bias_gradient + first : nullptr;
    return;
  }
  std::fill(weight_gradient_copy_.begin(), weight_gradient_copy_.end(), 0.0f);
  weight_gradient_ = weight_gradient_copy_.data();
  bias_gradient_ = whole_bias_gradient;
  if (rows && whole_bias_gradient != nullptr) {
    std::fill(bias_gradient_copy_.begin(), bias_gradient_copy_.end(), 0.0f);
    bias_gradient_ = bias_gradient_copy_.data();
  }
}

void WeightShare::end_gradients() {
  if (!copied_) return;
  for_each_run(in_, [&](int64_t whole, int64_t share, int64_t count) {
    add(whole_weight_gradient_ + whole, weight_gradient_copy_.data() + share, count);
  });
  if (split_ == TensorSplit::Outputs && whole_bias_gradient_ != nullptr) {
    for_each_run(1, [&](int64_t whole, int64_t share, int64_t count) {
      add(whole_bias_gradient_ + whole, bias_gradient_copy_.data() + share, count);
    });
  }
}

}  // namespace fp8t
