#include "optim/muon.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "gemm/cpu_gemm.h"
#include "numerics/float_bits.h"

namespace fp8t::optim {

namespace {

// Rounds as a tensor of the precision's dtype would hold the value.
float stored(float value, MuonPrecision precision) {
  return precision == MuonPrecision::Bf16 ? round_to_bf16(value) : value;
}

void store_all(std::span<float> values, MuonPrecision precision) {
  if (precision == MuonPrecision::Fp32) return;
  for (float& value : values)
    value = round_to_bf16(value);
}

// torch.lerp, both of its forms: the one for large weights keeps lerp(a, b, 1) == b exact.
float torch_lerp(float start, float end, float weight) {
  return std::abs(weight) < 0.5f ? start + weight * (end - start)
                                 : end - (end - start) * (1.0f - weight);
}

double sum_of_squares(const float* values, int64_t count) {
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i)
    sum += double(values[i]) * values[i];
  return sum;
}

float frobenius_norm(const float* matrix, int64_t count) {
  return static_cast<float>(std::sqrt(sum_of_squares(matrix, count)));
}

// out[m, n] = a[m, k] · b[k, n]
void matmul(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* out) {
  std::fill_n(out, m * n, 0.0f);
  gemm::dgrad_dyw(m, k, n, a, k, b, n, out, n);
}

// The Gram matrix of the shorter side: x·xᵀ [rows, rows] for wide x, xᵀ·x [cols, cols] for tall.
void gram(const float* x, int64_t rows, int64_t cols, bool tall, float* out) {
  if (tall) {
    std::fill_n(out, cols * cols, 0.0f);
    gemm::wgrad_dytx(rows, cols, cols, x, cols, x, cols, out, cols);
  } else {
    gemm::forward_xwt(rows, rows, cols, x, cols, x, cols, out, rows, false);
  }
}

// Step 5: NorMuon on one matrix with its second moment (one value per row when rows >= cols,
// else per column).
void normuon(float* update, int64_t rows, int64_t cols, float* second_moment, float beta2) {
  const bool per_row = rows >= cols;
  const int64_t kept = per_row ? rows : cols;
  const int64_t reduced = per_row ? cols : rows;
  std::vector<double> sums(static_cast<size_t>(kept), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double value = update[r * cols + c];
      sums[static_cast<size_t>(per_row ? r : c)] += value * value;
    }
  }
  const auto reduced_size = static_cast<float>(reduced);
  std::vector<float> mean_square(static_cast<size_t>(kept));
  double mean_square_sum = 0.0;
  for (size_t i = 0; i < mean_square.size(); ++i) {
    mean_square[i] = static_cast<float>(sums[i] / double(reduced));
    mean_square_sum += mean_square[i];
  }
  const float norm = std::sqrt(static_cast<float>(mean_square_sum) * reduced_size);
  const float weight = 1.0f - beta2;
  std::vector<float> scale(static_cast<size_t>(kept));
  double scaled_square_sum = 0.0;
  for (size_t i = 0; i < scale.size(); ++i) {
    second_moment[i] = torch_lerp(second_moment[i], mean_square[i], weight);
    scale[i] = 1.0f / std::sqrt(std::max(second_moment[i], 1e-10f));
    scaled_square_sum += (mean_square[i] * reduced_size) * (scale[i] * scale[i]);
  }
  // Rescaled rows (or columns) keep the norm the update had before.
  const float new_norm = std::sqrt(static_cast<float>(scaled_square_sum));
  const float restore = norm / std::max(new_norm, 1e-10f);
  for (float& value : scale)
    value *= restore;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      update[r * cols + c] *= scale[static_cast<size_t>(per_row ? r : c)];
  }
}

}  // namespace

double muon_lr_scale(int64_t rows, int64_t cols) {
  FP8T_CHECK(rows > 0 && cols > 0, "expected a non-empty matrix, found [{}, {}]", rows, cols);
  return std::sqrt(std::max(1.0, double(rows) / double(cols)));
}

void equilibrate_rows(float* matrix, int64_t rows, int64_t cols, MuonPrecision precision) {
  FP8T_CHECK(rows > 0 && cols > 0, "expected a non-empty matrix, found [{}, {}]", rows, cols);
  const float target =
      frobenius_norm(matrix, rows * cols) / static_cast<float>(std::sqrt(double(rows)));
  for (int64_t r = 0; r < rows; ++r) {
    float* row = matrix + r * cols;
    const float row_norm = std::max(frobenius_norm(row, cols), 1e-6f);
    const float scale = stored(target / row_norm, precision);
    for (int64_t c = 0; c < cols; ++c)
      row[c] = stored(row[c] * scale, precision);
  }
}

void polar_express(float* matrix, int64_t rows, int64_t cols, int steps, MuonPrecision precision) {
  FP8T_CHECK(rows > 0 && cols > 0, "expected a non-empty matrix, found [{}, {}]", rows, cols);
  FP8T_CHECK(steps >= 0 && size_t(steps) <= kPolarExpressCoefficients.size(),
             "expected 0 to {} Polar Express steps, found {}", kPolarExpressCoefficients.size(),
             steps);
  const int64_t count = rows * cols;
  const std::span<float> x(matrix, static_cast<size_t>(count));
  // The 1.01 keeps the largest singular value below 1, where the iteration converges.
  const float norm = stored(frobenius_norm(matrix, count), precision);
  const float denominator = stored(stored(norm * 1.01f, precision) + 1e-6f, precision);
  for (float& value : x)
    value = stored(value / denominator, precision);

  // Square matrices take the wide form, as in nanochat (the two agree for them).
  const bool tall = rows > cols;
  const int64_t side = tall ? cols : rows;
  std::vector<float> gram_matrix(static_cast<size_t>(side * side));
  std::vector<float> gram_squared(gram_matrix.size());
  std::vector<float> product(static_cast<size_t>(count));
  for (int step = 0; step < steps; ++step) {
    const auto& coefficients = kPolarExpressCoefficients[static_cast<size_t>(step)];
    const auto a = static_cast<float>(coefficients[0]);
    const auto b = static_cast<float>(coefficients[1]);
    const auto c = static_cast<float>(coefficients[2]);
    gram(matrix, rows, cols, tall, gram_matrix.data());
    store_all(gram_matrix, precision);
    // The two sums take the products' fp32 values and round once, as a GEMM epilogue does.
    matmul(side, side, side, gram_matrix.data(), gram_matrix.data(), gram_squared.data());
    for (size_t i = 0; i < gram_matrix.size(); ++i)  // becomes B = b·A + c·A²
      gram_matrix[i] = stored(c * gram_squared[i] + b * gram_matrix[i], precision);
    if (tall) {
      matmul(rows, cols, cols, matrix, gram_matrix.data(), product.data());
    } else {
      matmul(rows, cols, rows, gram_matrix.data(), matrix, product.data());
    }
    for (size_t i = 0; i < x.size(); ++i)
      x[i] = stored(product[i] + a * x[i], precision);
  }
}

MuonGroup::MuonGroup(int64_t count, int64_t rows, int64_t cols)
    : count_(count), rows_(rows), cols_(cols) {
  FP8T_CHECK(count > 0 && rows > 0 && cols > 0,
             "expected a non-empty group of matrices, found {} of [{}, {}]", count, rows, cols);
  momentum_.assign(static_cast<size_t>(count * rows * cols), 0.0f);
  second_moment_.assign(static_cast<size_t>(count * std::max(rows, cols)), 0.0f);
  update_.resize(static_cast<size_t>(rows * cols));
}

std::span<float> MuonGroup::momentum(int64_t index) {
  FP8T_CHECK(index >= 0 && index < count_, "expected a matrix index in [0, {}), found {}", count_,
             index);
  const auto size = static_cast<size_t>(rows_ * cols_);
  return std::span<float>(momentum_).subspan(static_cast<size_t>(index) * size, size);
}

std::span<float> MuonGroup::second_moment(int64_t index) {
  FP8T_CHECK(index >= 0 && index < count_, "expected a matrix index in [0, {}), found {}", count_,
             index);
  const auto size = static_cast<size_t>(std::max(rows_, cols_));
  return std::span<float>(second_moment_).subspan(static_cast<size_t>(index) * size, size);
}

std::vector<int64_t> MuonGroup::second_moment_shape() const {
  return rows_ >= cols_ ? std::vector<int64_t>{rows_, 1} : std::vector<int64_t>{1, cols_};
}

void MuonGroup::step(std::span<float* const> params, std::span<const float* const> grads,
                     const MuonHyperparameters& hyper, int64_t first, int64_t matrices) {
  FP8T_CHECK(std::ssize(params) == count_ && std::ssize(grads) == count_,
             "expected {} parameters and gradients, found {} and {}", count_, params.size(),
             grads.size());
  if (matrices < 0) matrices = count_ - first;
  FP8T_CHECK(first >= 0 && first + matrices <= count_,
             "expected matrices {} .. {} within the group's {}", first, first + matrices - 1,
             count_);
  FP8T_CHECK(hyper.momentum >= 0 && hyper.momentum <= 1,
             "expected a Muon momentum in [0, 1], found {}", hyper.momentum);
  FP8T_CHECK(hyper.beta2 >= 0 && hyper.beta2 < 1, "expected a NorMuon beta2 in [0, 1), found {}",
             hyper.beta2);
  // nanochat passes its scalars as fp32 tensors.
  const auto mu = static_cast<float>(hyper.momentum);
  const float momentum_weight = 1.0f - mu;
  const auto lr = static_cast<float>(hyper.lr * muon_lr_scale(rows_, cols_));
  const float decay = lr * static_cast<float>(hyper.weight_decay);
  const auto beta2 = static_cast<float>(hyper.beta2);
  const auto target_norm = static_cast<float>(std::sqrt(double(std::min(rows_, cols_))));
  for (int64_t index = first; index < first + matrices; ++index) {
    float* param = params[static_cast<size_t>(index)];
    const float* grad = grads[static_cast<size_t>(index)];
    const std::span<float> buffer = momentum(index);
    for (size_t i = 0; i < buffer.size(); ++i) {  // Nesterov
      buffer[i] = torch_lerp(buffer[i], grad[i], momentum_weight);
      update_[i] = stored(torch_lerp(grad[i], buffer[i], mu), hyper.precision);
    }
    equilibrate_rows(update_.data(), rows_, cols_, hyper.precision);
    polar_express(update_.data(), rows_, cols_, hyper.ns_steps, hyper.precision);

    // Muon+: the norm of an exactly semi-orthogonal matrix. PyTorch computes the scalar over
    // the tensor as a reciprocal times the scalar.
    const float current_norm = std::max(frobenius_norm(update_.data(), std::ssize(update_)), 1e-6f);
    const float renormalize = (1.0f / current_norm) * target_norm;
    for (float& value : update_)
      value *= renormalize;

    normuon(update_.data(), rows_, cols_, second_moment(index).data(), beta2);

    for (size_t i = 0; i < update_.size(); ++i) {
      const float weight_decay = update_[i] * param[i] >= 0.0f ? decay * param[i] : 0.0f;
      param[i] -= lr * update_[i] + weight_decay;
    }
  }
}

}  // namespace fp8t::optim
