#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"

namespace fp8t::ops {
namespace {

// Checks every target before anything is written; returns how many rows count.
int64_t count_valid_rows(const int32_t* targets, const CrossEntropyShape& shape) {
  FP8T_CHECK(shape.rows >= 0, "expected rows >= 0, found {}", shape.rows);
  FP8T_CHECK(shape.vocab > 0, "expected vocab > 0, found {}", shape.vocab);
  FP8T_CHECK(shape.padded_vocab >= shape.vocab, "expected padded_vocab >= vocab ({}), found {}",
             shape.vocab, shape.padded_vocab);
  int64_t valid_rows = 0;
  for (int64_t r = 0; r < shape.rows; ++r) {
    const int32_t target = targets[r];
    FP8T_CHECK(target == kIgnoreTarget || (target >= 0 && target < shape.vocab),
               "expected targets in [0, {}) or {} (ignored), found {} at row {}", shape.vocab,
               kIgnoreTarget, target, r);
    if (target != kIgnoreTarget) ++valid_rows;
  }
  return valid_rows;
}

// The loss of every row, and with dloss the gradient in place of the logits.
template <typename T>
double softcap_cross_entropy_rows(const T* logits, T* gradient, T* token_losses,
                                  const int32_t* targets, const CrossEntropyShape& shape, T softcap,
                                  T dloss) {
  FP8T_CHECK(softcap > 0, "expected softcap > 0, found {}", softcap);
  const int64_t valid_rows = count_valid_rows(targets, shape);
  // Each valid row carries 1 / valid_rows of the mean.
  const T row_weight = valid_rows > 0 ? dloss / static_cast<T>(valid_rows) : T(0);
  // Per row: the capped logits, then exp(capped - max); one tanh and one exp per logit.
  std::vector<T> capped(static_cast<size_t>(shape.vocab));
  std::vector<T> exp_shifted(static_cast<size_t>(shape.vocab));
  double loss_sum = 0.0;
  for (int64_t r = 0; r < shape.rows; ++r) {
    const T* row = logits + r * shape.padded_vocab;
    const int32_t target = targets[r];
    if (target == kIgnoreTarget) {
      if (token_losses != nullptr) token_losses[r] = 0;
      if (gradient != nullptr)
        std::fill(gradient + r * shape.padded_vocab, gradient + (r + 1) * shape.padded_vocab, T(0));
      continue;
    }
    T max_capped = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < shape.vocab; ++j) {
      capped[size_t(j)] = softcap * std::tanh(row[j] / softcap);
      max_capped = std::max(max_capped, capped[size_t(j)]);
    }
    T sum_exp = 0;
    for (int64_t j = 0; j < shape.vocab; ++j) {
      exp_shifted[size_t(j)] = std::exp(capped[size_t(j)] - max_capped);
      sum_exp += exp_shifted[size_t(j)];
    }
    const T row_loss = max_capped + std::log(sum_exp) - capped[size_t(target)];
    loss_sum += static_cast<double>(row_loss);
    if (token_losses != nullptr) token_losses[r] = row_loss;
    if (gradient == nullptr) continue;
    // The row's logits are all read above, so gradient may be logits.
    T* grad_row = gradient + r * shape.padded_vocab;
    for (int64_t j = 0; j < shape.vocab; ++j) {
      const T tanh_value = capped[size_t(j)] / softcap;
      const T probability = exp_shifted[size_t(j)] / sum_exp;
      const T dcapped = (probability - (j == target ? T(1) : T(0))) * row_weight;
      // d(softcap tanh(x / softcap))/dx = 1 - tanh^2.
      grad_row[j] = dcapped * (T(1) - tanh_value * tanh_value);
    }
    std::fill(grad_row + shape.vocab, grad_row + shape.padded_vocab, T(0));
  }
  return valid_rows > 0 ? loss_sum / static_cast<double>(valid_rows) : 0.0;
}

}  // namespace

template <typename T>
double softcap_cross_entropy(const T* logits, const int32_t* targets,
                             const CrossEntropyShape& shape, NonDeduced<T>* token_losses,
                             NonDeduced<T> softcap) {
  return softcap_cross_entropy_rows<T>(logits, nullptr, token_losses, targets, shape, softcap,
                                       T(0));
}

template <typename T>
double softcap_cross_entropy_with_gradient(T* logits, const int32_t* targets,
                                           const CrossEntropyShape& shape, NonDeduced<T> dloss,
                                           NonDeduced<T>* token_losses, NonDeduced<T> softcap) {
  return softcap_cross_entropy_rows<T>(logits, logits, token_losses, targets, shape, softcap,
                                       dloss);
}

template double softcap_cross_entropy<float>(const float*, const int32_t*, const CrossEntropyShape&,
                                             float*, float);
template double softcap_cross_entropy<double>(const double*, const int32_t*,
                                              const CrossEntropyShape&, double*, double);
template double softcap_cross_entropy_with_gradient<float>(float*, const int32_t*,
                                                           const CrossEntropyShape&, float, float*,
                                                           float);
template double softcap_cross_entropy_with_gradient<double>(double*, const int32_t*,
                                                            const CrossEntropyShape&, double,
                                                            double*, double);

}  // namespace fp8t::ops
