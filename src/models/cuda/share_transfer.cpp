#if FP8TRAIN_WITH_CUDA

#include "models/cuda/share_transfer.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "numerics/float_bits.h"

namespace fp8t {

namespace {

// pass(first, count, values) for each block of whole rows [first, first + count) that staging
// of `staging` elements takes (`values` of them), then waits for the stream.
template <typename Pass>
void for_each_pass(const ShareBlocks& share, size_t staging, cudaStream_t stream,
                   const Pass& pass) {
  FP8T_CHECK(share.whole_cols > 0 && static_cast<size_t>(share.whole_cols) <= staging,
             "a share's staging of {} elements cannot hold a whole row of {}", staging,
             share.whole_cols);
  const int64_t step = static_cast<int64_t>(staging) / share.whole_cols;
  for (int64_t first = 0; first < share.whole_rows; first += step) {
    const int64_t count = std::min(step, share.whole_rows - first);
    pass(first, count, size_t(count * share.whole_cols));
  }
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// Each part of the share's runs in the staged whole rows [first, first + count):
// copy(at_share, share_ld, at_staging, cols, rows), offsets in elements.
template <typename Copy>
void for_each_run(const ShareBlocks& share, int64_t first, int64_t count, const Copy& copy) {
  for (const ShareBlock& block : share.blocks) {
    const int64_t begin = std::max(first, block.whole_row);
    const int64_t end = std::min(first + count, block.whole_row + block.rows);
    if (begin >= end) continue;
    copy(block.share_first + (begin - block.whole_row) * block.share_ld, block.share_ld,
         (begin - first) * share.whole_cols + block.whole_col, block.cols, end - begin);
  }
}

template <typename T>
void copy_2d(T* to, int64_t to_ld, const T* from, int64_t from_ld, int64_t cols, int64_t rows,
             cudaStream_t stream) {
  FP8T_CUDA_CHECK(cudaMemcpy2DAsync(to, size_t(to_ld) * sizeof(T), from,
                                    size_t(from_ld) * sizeof(T), size_t(cols) * sizeof(T),
                                    size_t(rows), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace

ShareBlocks share_blocks(const optim::DeviceParameterLayout& layout,
                         const optim::DeviceParameter& parameter) {
  const optim::ShareRows share = layout.share_rows(parameter);
  const int64_t row = share.whole_first / share.whole_cols;
  const int64_t col = share.whole_first % share.whole_cols;
  return {parameter.whole_numel() / share.whole_cols,
          share.whole_cols,
          {{0, share.cols, row, col, share.rows, share.cols}}};
}

ShareBlocks share_blocks(const TensorShare& share, int64_t whole_out, int64_t whole_in) {
  ShareBlocks blocks{whole_out, whole_in, {}};
  if (share.split == TensorSplit::None) {
    blocks.blocks.push_back({0, whole_in, 0, 0, whole_out, whole_in});
    return blocks;
  }
  const int64_t part_in = share.features(whole_in, whole_out).first;
  int64_t done = 0;
  for (const ShareSegment& segment : share.segments) {
    if (share.split == TensorSplit::Outputs) {  // a run of whole rows
      blocks.blocks.push_back(
          {done * whole_in, whole_in, segment.first, 0, segment.count, whole_in});
    } else {  // a run of columns of every row
      blocks.blocks.push_back({done, part_in, 0, segment.first, whole_out, segment.count});
    }
    done += segment.count;
  }
  return blocks;
}

ShareStaging::ShareStaging(size_t whole_bytes) : bytes_(std::min(whole_bytes, kShareStagingBytes)) {
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());  // its poison, on the legacy stream, comes first
}

template <typename T>
void gather_share(const ShareBlocks& share, const T* own, std::span<T> staging,
                  const GroupSum<T>& sum, T* host, cudaStream_t stream) {
  for_each_pass(share, staging.size(), stream, [&](int64_t first, int64_t count, size_t values) {
    FP8T_CUDA_CHECK(cudaMemsetAsync(staging.data(), 0, values * sizeof(T), stream));
    for_each_run(
        share, first, count,
        [&](int64_t at_share, int64_t share_ld, int64_t at_staging, int64_t cols, int64_t rows) {
          copy_2d(staging.data() + at_staging, share.whole_cols, own + at_share, share_ld, cols,
                  rows, stream);
        });
    sum(staging.data(), values, stream);
    if (host != nullptr) {
      FP8T_CUDA_CHECK(cudaMemcpyAsync(host + first * share.whole_cols, staging.data(),
                                      values * sizeof(T), cudaMemcpyDeviceToHost, stream));
    }
  });
}

template <typename T>
void scatter_share(const ShareBlocks& share, const T* host, std::span<T> staging,
                   const GroupSum<T>& sum, T* own, cudaStream_t stream) {
  for_each_pass(share, staging.size(), stream, [&](int64_t first, int64_t count, size_t values) {
    if (host != nullptr) {
      FP8T_CUDA_CHECK(cudaMemcpyAsync(staging.data(), host + first * share.whole_cols,
                                      values * sizeof(T), cudaMemcpyHostToDevice, stream));
    } else {
      FP8T_CUDA_CHECK(cudaMemsetAsync(staging.data(), 0, values * sizeof(T), stream));
    }
    sum(staging.data(), values, stream);
    for_each_run(
        share, first, count,
        [&](int64_t at_share, int64_t share_ld, int64_t at_staging, int64_t cols, int64_t rows) {
          copy_2d(own + at_share, share_ld, staging.data() + at_staging, share.whole_cols, cols,
                  rows, stream);
        });
  });
}

template void gather_share<float>(const ShareBlocks&, const float*, std::span<float>,
                                  const GroupSum<float>&, float*, cudaStream_t);
template void gather_share<bf16>(const ShareBlocks&, const bf16*, std::span<bf16>,
                                 const GroupSum<bf16>&, bf16*, cudaStream_t);
template void scatter_share<float>(const ShareBlocks&, const float*, std::span<float>,
                                   const GroupSum<float>&, float*, cudaStream_t);
template void scatter_share<bf16>(const ShareBlocks&, const bf16*, std::span<bf16>,
                                  const GroupSum<bf16>&, bf16*, cudaStream_t);

}  // namespace fp8t

#endif  // FP8TRAIN_WITH_CUDA
