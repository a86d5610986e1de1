// This rank's share of a linear's weight [out, in] and bias under tensor parallelism
// (models/tensor_parallel.h): runs of the whole weight's rows (column-parallel) or columns
// (row-parallel), kept as one contiguous matrix for the GEMMs, and their gradients added back
// into the whole gradients. Both CPU models hold their parameters whole (checkpoints stay
// whole); this is where a rank cuts out what its GEMMs read.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "models/tensor_parallel.h"

namespace fp8t {

// A run of the whole weight's rows (TensorSplit::Outputs) or columns (Inputs).
struct ShareSegment {
  int64_t first = 0;
  int64_t count = 0;
};

// A rank's share of a linear: how tensor parallelism splits it, and the rank's runs of rows or
// columns of the whole weight, in order (none when it is not split).
struct TensorShare {
  TensorSplit split = TensorSplit::None;
  std::vector<ShareSegment> segments;

  // The share's {in_features, out_features} of a linear [out, in]: the rows (Outputs) or columns
  // (Inputs) of all its runs; the linear's own when it is not split.
  std::pair<int64_t, int64_t> features(int64_t in, int64_t out) const {
    int64_t width = 0;
    for (const ShareSegment& segment : segments)
      width += segment.count;
    if (split == TensorSplit::Outputs) return {in, width};
    if (split == TensorSplit::Inputs) return {width, out};
    return {in, out};
  }
};

class WeightShare {
 public:
  // The whole weight, [whole_out, whole_in]. None: the share is the whole weight.
  WeightShare(int64_t whole_out, int64_t whole_in);
  // Outputs: `segments` of rows, with their bias values; Inputs: `segments` of columns, and the
  // whole bias (the model decides which rank adds it).
  WeightShare(TensorSplit split, std::vector<ShareSegment> segments, int64_t whole_out,
              int64_t whole_in);

  TensorSplit split() const { return split_; }
  int64_t out_features() const { return out_; }
  int64_t in_features() const { return in_; }

  // Points weight() and bias() at the share of the whole weight and bias (may be null). A share
  // that is one run of whole rows is read in place; any other is copied, once after each
  // invalidate(): the weights change only between optimizer steps or when loaded.
  void refresh(const float* whole_weight, const float* whole_bias);
  void invalidate() { current_ = false; }
  const float* weight() const { return weight_; }
  const float* bias() const { return bias_; }

  // Around a backward: begin_gradients() points weight_gradient() and bias_gradient() at zeroed
  // share buffers (or, read in place, at the whole gradients' own rows), which the backward adds
  // into; end_gradients() adds the buffers into the whole gradients.
  void begin_gradients(float* whole_weight_gradient, float* whole_bias_gradient);
  float* weight_gradient() const { return weight_gradient_; }
  float* bias_gradient() const { return bias_gradient_; }
  void end_gradients();

 private:
  // Where an in-place share starts in the whole weight: its first row.
  int64_t in_place_first_row() const;
  // visit(whole offset, share offset, count) for each contiguous run of the share in the whole:
  // rows: each segment, `width` values per row (in_features for the weight, 1 for the bias);
  // columns: each segment of each row.
  template <typename Visit>
  void for_each_run(int64_t width, Visit&& visit) const {
    int64_t done = 0;
    for (const ShareSegment& segment : segments_) {
      if (split_ == TensorSplit::Outputs) {
        visit(segment.first * width, done * width, segment.count * width);
      } else {
        for (int64_t row = 0; row < out_; ++row)
          visit(row * whole_in_ + segment.first, row * in_ + done, segment.count);
      }
      done += segment.count;
    }
  }

  TensorSplit split_ = TensorSplit::None;
  std::vector<ShareSegment> segments_;
  int64_t whole_in_ = 0, out_ = 0, in_ = 0;
  bool copied_ = false;   // the share is not one run of whole rows
  bool current_ = false;  // the copies hold the weights of the last refresh()
  std::vector<float> weight_copy_, bias_copy_, weight_gradient_copy_, bias_gradient_copy_;
  const float* weight_ = nullptr;
  const float* bias_ = nullptr;
  float* weight_gradient_ = nullptr;
  float* bias_gradient_ = nullptr;
  float* whole_weight_gradient_ = nullptr;
  float* whole_bias_gradient_ = nullptr;
};

// After the weights change, over a model's map from linear name to layer (any layer type with a
// member `WeightShare share`): every share is copied again at its next refresh().
template <typename LinearMap>
void invalidate_weight_shares(LinearMap& linears) {
  for (auto& [name, layer] : linears)
    layer.share.invalidate();
}

}  // namespace fp8t
