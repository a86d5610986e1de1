// Whole tensors to and from the shares a tensor-parallel group's ranks hold on their GPUs, for
// checkpoints and host copies: through a staging buffer of at most kShareStagingBytes, a block of
// the whole tensor's rows at a time, so that a large split tensor (the GPT's value embeddings,
// the Flux's linears) costs no whole-tensor temporary beside the planned memory. Every rank of
// the group calls each transfer together, with staging of the same size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/device_buffer.h"
#include "models/weight_share.h"
#include "numerics/float_bits.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {

// Well within the engines' runtime reserve.
inline constexpr size_t kShareStagingBytes = size_t{64} << 20;

// One run of a rank's share: `rows` rows of `cols` values, from share_first in the share (rows
// share_ld apart) and from (whole_row, whole_col) in the whole tensor.
struct ShareBlock {
  int64_t share_first = 0, share_ld = 0;
  int64_t whole_row = 0, whole_col = 0;
  int64_t rows = 0, cols = 0;
};

// A rank's share of a whole tensor [whole_rows, whole_cols], as its runs.
struct ShareBlocks {
  int64_t whole_rows = 0, whole_cols = 0;
  std::vector<ShareBlock> blocks;

  int64_t whole_numel() const { return whole_rows * whole_cols; }
};

// A layout's share of one of its tensors (the GPT's).
ShareBlocks share_blocks(const optim::DeviceParameterLayout& layout,
                         const optim::DeviceParameter& parameter);
// A linear's share (the Flux's) of its whole [whole_out, whole_in] (a bias: whole_in 1).
ShareBlocks share_blocks(const TensorShare& share, int64_t whole_out, int64_t whole_in);

// Device staging for the transfers of tensors of up to whole_bytes: as many bytes, or
// kShareStagingBytes; once made, ready for work on any stream. The ranks of a group make it
// with the same whole_bytes.
class ShareStaging {
 public:
  explicit ShareStaging(size_t whole_bytes);
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(bytes_.get()), bytes_.count() / sizeof(T)};
  }

 private:
  DeviceBuffer<uint8_t> bytes_;
};

template <typename T>
using GroupSum = std::function<void(T* values, size_t count, cudaStream_t stream)>;

// A group's sum of fp32 or of bf16 values (DeviceTensorParallel's, optim::ShareCollectives').
template <typename T, typename Group>
const GroupSum<T>& group_sum(const Group& group) {
  if constexpr (std::is_same_v<T, bf16>) {
    return group.sum_bf16;
  } else {
    return group.sum;
  }
}

// The whole tensor into `host` on every rank (null: the rank only takes part in the sums): each
// rank's runs of `own` in their places among zeros, summed over the group (`sum`). Returns with
// the copies done.
template <typename T>
void gather_share(const ShareBlocks& share, const T* own, std::span<T> staging,
                  const GroupSum<T>& sum, T* host, cudaStream_t stream);

// The group's first rank's whole tensor `host` (null on the other ranks) into each rank's share
// `own`. Returns with the copies done.
template <typename T>
void scatter_share(const ShareBlocks& share, const T* host, std::span<T> staging,
                   const GroupSum<T>& sum, T* own, cudaStream_t stream);

}  // namespace fp8t
