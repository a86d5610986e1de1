// A rank's share of a split weight: the rows or columns of its segments, copied once per change
// of the weights (or read in place), and its gradients added back where they came from.
#include "models/weight_share.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace fp8t {
namespace {

constexpr int64_t kOut = 6, kIn = 5;

std::vector<float> counting(size_t count, float start) {
  std::vector<float> values(count);
  std::iota(values.begin(), values.end(), start);
  return values;
}

TEST(WeightShare, RowSegmentsAreCopiedOncePerChangeOfTheWeights) {
  std::vector<float> weight = counting(kOut * kIn, 0.0f), bias = counting(kOut, 100.0f);
  WeightShare share(TensorSplit::Outputs, {{4, 2}, {1, 1}}, kOut, kIn);
  EXPECT_EQ(share.out_features(), 3);
  EXPECT_EQ(share.in_features(), kIn);
  share.refresh(weight.data(), bias.data());
  std::vector<float> expected;
  for (int64_t row : {4, 5, 1})
    expected.insert(expected.end(), weight.begin() + row * kIn, weight.begin() + (row + 1) * kIn);
  EXPECT_EQ(std::vector<float>(share.weight(), share.weight() + 3 * kIn), expected);
  EXPECT_EQ(std::vector<float>(share.bias(), share.bias() + 3),
            (std::vector<float>{104.0f, 105.0f, 101.0f}));

  weight[4 * kIn] = -1.0f;  // a change the share is not told of is not copied...
  share.refresh(weight.data(), bias.data());
  EXPECT_EQ(share.weight()[0], 20.0f);
  share.invalidate();  // ...and one it is told of is
  share.refresh(weight.data(), bias.data());
  EXPECT_EQ(share.weight()[0], -1.0f);
}

TEST(WeightShare, OneRunOfWholeRowsIsReadInPlace) {
  std::vector<float> weight = counting(kOut * kIn, 0.0f), bias = counting(kOut, 100.0f);
  std::vector<float> grad(kOut * kIn, 1.0f), grad_bias(kOut, 1.0f);
  WeightShare share(TensorSplit::Outputs, {{2, 3}}, kOut, kIn);
  share.refresh(weight.data(), bias.data());
  EXPECT_EQ(share.weight(), weight.data() + 2 * kIn);
  EXPECT_EQ(share.bias(), bias.data() + 2);
  share.begin_gradients(grad.data(), grad_bias.data());
  EXPECT_EQ(share.weight_gradient(), grad.data() + 2 * kIn);  // accumulated in place
  EXPECT_EQ(share.bias_gradient(), grad_bias.data() + 2);
  share.end_gradients();
  EXPECT_EQ(grad, std::vector<float>(kOut * kIn, 1.0f));
}

TEST(WeightShare, ColumnSegmentsAndTheirGradients) {
  std::vector<float> weight = counting(kOut * kIn, 0.0f), bias = counting(kOut, 100.0f);
  WeightShare share(TensorSplit::Inputs, {{3, 2}, {0, 1}}, kOut, kIn);
  EXPECT_EQ(share.out_features(), kOut);
  EXPECT_EQ(share.in_features(), 3);
  share.refresh(weight.data(), bias.data());
  EXPECT_EQ(share.bias(), bias.data());  // the whole bias: the model decides who adds it
  for (int64_t row = 0; row < kOut; ++row) {
    EXPECT_EQ(share.weight()[row * 3 + 0], weight[row * kIn + 3]);
    EXPECT_EQ(share.weight()[row * 3 + 1], weight[row * kIn + 4]);
    EXPECT_EQ(share.weight()[row * 3 + 2], weight[row * kIn + 0]);
  }

  std::vector<float> grad(kOut * kIn, 1.0f), grad_bias(kOut, 1.0f);
  for (int pass = 0; pass < 2; ++pass) {  // the share's buffers start from zero each time
    share.begin_gradients(grad.data(), grad_bias.data());
    EXPECT_EQ(share.bias_gradient(), grad_bias.data());
    for (int64_t i = 0; i < kOut * 3; ++i)
      share.weight_gradient()[i] += float(i + 1);
    share.end_gradients();
  }
  for (int64_t row = 0; row < kOut; ++row) {
    EXPECT_EQ(grad[row * kIn + 3], 1.0f + 2.0f * float(row * 3 + 1));
    EXPECT_EQ(grad[row * kIn + 4], 1.0f + 2.0f * float(row * 3 + 2));
    EXPECT_EQ(grad[row * kIn + 0], 1.0f + 2.0f * float(row * 3 + 3));
    EXPECT_EQ(grad[row * kIn + 1], 1.0f);
    EXPECT_EQ(grad[row * kIn + 2], 1.0f);
  }
}

TEST(WeightShare, RowGradientsAddBackIntoTheirRows) {
  std::vector<float> grad(kOut * kIn, 0.0f), grad_bias(kOut, 0.0f);
  WeightShare share(TensorSplit::Outputs, {{0, 1}, {3, 2}}, kOut, kIn);
  share.begin_gradients(grad.data(), grad_bias.data());
  for (int64_t i = 0; i < 3 * kIn; ++i)
    share.weight_gradient()[i] = float(i + 1);
  for (int64_t i = 0; i < 3; ++i)
    share.bias_gradient()[i] = float(10 * (i + 1));
  share.end_gradients();
  for (int64_t i = 0; i < kIn; ++i) {
    EXPECT_EQ(grad[0 * kIn + i], float(i + 1));
    EXPECT_EQ(grad[3 * kIn + i], float(kIn + i + 1));
    EXPECT_EQ(grad[4 * kIn + i], float(2 * kIn + i + 1));
    EXPECT_EQ(grad[1 * kIn + i], 0.0f);
  }
  EXPECT_EQ(grad_bias, (std::vector<float>{10.0f, 0.0f, 0.0f, 20.0f, 30.0f, 0.0f}));
}

TEST(WeightShare, WholeWeightWithoutTensorParallelism) {
  std::vector<float> weight = counting(kOut * kIn, 0.0f);
  WeightShare share(kOut, kIn);
  share.refresh(weight.data(), nullptr);
  EXPECT_EQ(share.weight(), weight.data());
  EXPECT_EQ(share.bias(), nullptr);
  EXPECT_EQ(share.split(), TensorSplit::None);
}

TEST(WeightShare, RejectsSegmentsOutsideTheWeight) {
  EXPECT_THROW(WeightShare(TensorSplit::Outputs, {{5, 2}}, kOut, kIn), Error);
  EXPECT_THROW(WeightShare(TensorSplit::Inputs, {{0, 0}}, kOut, kIn), Error);
  EXPECT_THROW(WeightShare(TensorSplit::Inputs, {}, kOut, kIn), Error);
}

}  // namespace
}  // namespace fp8t
