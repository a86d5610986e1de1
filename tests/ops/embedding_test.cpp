#include "ops/embedding.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using test::TestRng;

constexpr int64_t kVocab = 5;
constexpr int64_t kDim = 3;
// Repeats (2 three times, 0 twice) and a row (3) that is never used.
const std::vector<int32_t> kIds = {2, 0, 4, 2, 1, 2, 0};
const int64_t kTokens = static_cast<int64_t>(kIds.size());

TEST(OpsEmbedding, ForwardCopiesTheRowsOfTheIds) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> table = test::random_values(rng, kVocab * kDim);
  std::vector<double> out(kTokens * kDim, -7.0);
  ops::embedding_forward(out.data(), kIds.data(), table.data(), kTokens, kVocab, kDim);
  for (int64_t n = 0; n < kTokens; ++n) {
    for (int64_t i = 0; i < kDim; ++i)
      EXPECT_EQ(out[n * kDim + i], table[kIds[n] * kDim + i]) << n << ", " << i;
  }
}

TEST(OpsEmbedding, BackwardSumsRepeatedIdsIntoTheirRow) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> dout = test::random_values(rng, kTokens * kDim);
  const std::vector<double> initial = test::random_values(rng, kVocab * kDim);
  std::vector<double> dtable = initial;
  ops::embedding_backward(dtable.data(), dout.data(), kIds.data(), kTokens, kVocab, kDim);
  for (int64_t i = 0; i < kDim; ++i) {
    EXPECT_DOUBLE_EQ(dtable[2 * kDim + i], initial[2 * kDim + i] + dout[0 * kDim + i] +
                                               dout[3 * kDim + i] + dout[5 * kDim + i]);
    EXPECT_DOUBLE_EQ(dtable[0 * kDim + i],
                     initial[0 * kDim + i] + dout[1 * kDim + i] + dout[6 * kDim + i]);
    EXPECT_DOUBLE_EQ(dtable[4 * kDim + i], initial[4 * kDim + i] + dout[2 * kDim + i]);
    EXPECT_DOUBLE_EQ(dtable[1 * kDim + i], initial[1 * kDim + i] + dout[4 * kDim + i]);
    EXPECT_EQ(dtable[3 * kDim + i], initial[3 * kDim + i]);  // unused row untouched
  }
}

TEST(OpsEmbedding, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> table = test::random_values(rng, kVocab * kDim);
  const std::vector<double> dout = test::random_values(rng, kTokens * kDim);
  std::vector<double> out(kTokens * kDim);
  const auto loss = [&] {
    ops::embedding_forward(out.data(), kIds.data(), table.data(), kTokens, kVocab, kDim);
    return test::weighted_sum(out, dout);
  };
  std::vector<double> dtable(kVocab * kDim, 0.0);
  ops::embedding_backward(dtable.data(), dout.data(), kIds.data(), kTokens, kVocab, kDim);
  test::expect_gradient_matches(dtable, test::numeric_gradient(table, loss), "table");
}

TEST(OpsEmbedding, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> dout = test::random_values(rng, kTokens * kDim);
  test::expect_backward_accumulates({kVocab * kDim}, [&](std::vector<std::vector<double>>& g) {
    ops::embedding_backward(g[0].data(), dout.data(), kIds.data(), kTokens, kVocab, kDim);
  });
}

TEST(OpsEmbedding, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> table = test::random_values(rng, kVocab * kDim);
  const std::vector<double> dout = test::random_values(rng, kTokens * kDim);
  std::vector<double> out(kTokens * kDim);
  std::vector<double> dtable(kVocab * kDim, 0.0);
  ops::embedding_forward(out.data(), kIds.data(), table.data(), kTokens, kVocab, kDim);
  ops::embedding_backward(dtable.data(), dout.data(), kIds.data(), kTokens, kVocab, kDim);
  const std::vector<float> table_f = test::convert<float>(table);
  const std::vector<float> dout_f = test::convert<float>(dout);
  std::vector<float> out_f(kTokens * kDim);
  std::vector<float> dtable_f(kVocab * kDim, 0.0f);
  ops::embedding_forward(out_f.data(), kIds.data(), table_f.data(), kTokens, kVocab, kDim);
  ops::embedding_backward(dtable_f.data(), dout_f.data(), kIds.data(), kTokens, kVocab, kDim);
  test::expect_float_matches_double(out_f, out, "out");
  test::expect_float_matches_double(dtable_f, dtable, "dtable");
}

TEST(OpsEmbedding, RejectsIdsOutsideTheVocabBeforeWriting) {
  const std::vector<double> table(kVocab * kDim, 1.0);
  for (int32_t bad_id : {-1, static_cast<int32_t>(kVocab)}) {
    const std::vector<int32_t> ids = {0, bad_id};
    std::vector<double> out(2 * kDim, 0.0);
    try {
      ops::embedding_forward(out.data(), ids.data(), table.data(), 2, kVocab, kDim);
      ADD_FAILURE() << "no error for id " << bad_id;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what())
                    .find(fmt::format("expected token ids in [0, 5), found {}", bad_id)),
                std::string::npos)
          << error.what();
    }
    EXPECT_EQ(out, std::vector<double>(2 * kDim, 0.0));
    std::vector<double> dtable(kVocab * kDim, 0.0);
    EXPECT_THROW(ops::embedding_backward(dtable.data(), out.data(), ids.data(), 2, kVocab, kDim),
                 Error);
    EXPECT_EQ(dtable, std::vector<double>(kVocab * kDim, 0.0));
  }
}

}  // namespace
}  // namespace fp8t
