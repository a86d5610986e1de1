// nanochat's Muon (nanochat/optim.py, muon_step_fused, at commit 92d63d4) for one group of
// same-shape matrices, fp32 on the CPU. Per matrix [rows, cols] and step:
//   1. Nesterov momentum:  m = lerp(m, g, 1 − μ);  u = lerp(g, m, μ)
//   2. MuonEq:             every row of u rescaled to the RMS row norm ‖u‖_F / √rows
//   3. Polar Express:      X = u / (1.01·‖u‖_F + 1e-6), then 5 quintic steps
//                          X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ (X·(b·A + c·A²) with A = XᵀX
//                          when rows > cols): X → U·Vᵀ of u = U·S·Vᵀ
//   4. Muon+:              X scaled to ‖X‖_F = √min(rows, cols)
//   5. NorMuon:            v = lerp(v, mean of X² along the shorter side, 1 − β2); X scaled by
//                          1/√v per row (rows ≥ cols) or per column, then back to its norm of 4.
//   6. Cautious update:    p −= lr'·X + lr'·wd·p·[X·p ≥ 0],  lr' = lr·√max(1, rows/cols)
// Scalars and elementwise math are fp32 as in PyTorch (lerp in torch's two forms, Muon+'s scale
// as torch's scalar / tensor); sums and norms accumulate in double, which differs from PyTorch's
// fp32 reductions in the last bits only.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace fp8t::optim {

// Polar Express (Amsel, Persson, Musco, Gower 2025) for 5 steps, safety factor 2e-2,
// cushion 2: the (a, b, c) of each step, as nanochat lists them.
inline constexpr std::array<std::array<double, 3>, 5> kPolarExpressCoefficients = {{
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
}};

// Where steps 2 and 3 round. nanochat runs them in its COMPUTE_DTYPE: bf16 on CUDA sm80+,
// fp32 on the CPU (or with NANOCHAT_DTYPE=float32).
enum class MuonPrecision : uint8_t {
  Fp32,
  // Rounds to bf16 wherever nanochat materializes a bf16 tensor: the momentum update, MuonEq's
  // row scales and result, the norm, the normalized X, and in each iteration the Gram matrix A
  // (fp32 accumulation), b·A + c·A² and a·X + B·X. The two sums take their products' fp32 sums
  // and round once, as a GEMM epilogue computes them; nanochat's torch.compile rounds the
  // product to bf16 first and then the fused sum: one rounding more, the same order of error.
  Bf16,
};

struct MuonHyperparameters {
  double lr = 0.02;  // the group's lr; the step multiplies it by muon_lr_scale(rows, cols)
  double momentum = 0.95;
  double beta2 = 0.9;         // NorMuon's second moment
  double weight_decay = 0.0;  // cautious: only where the update and the parameter agree in sign
  int ns_steps = 5;           // Polar Express steps, at most kPolarExpressCoefficients.size()
  MuonPrecision precision = MuonPrecision::Fp32;
};

// nanochat's shape scaling of the Muon lr: √max(1, rows / cols), so tall matrices move more.
double muon_lr_scale(int64_t rows, int64_t cols);

// Step 2 (MuonEq) in place on a row-major [rows, cols] matrix. Rows of zeros stay zero (their
// norm is clamped to 1e-6, as in nanochat).
void equilibrate_rows(float* matrix, int64_t rows, int64_t cols, MuonPrecision precision);

// Step 3 in place: Frobenius normalization, then `steps` Polar Express iterations (GEMMs by
// OpenBLAS). The result has singular values near 1 wherever the input's were not tiny.
void polar_express(float* matrix, int64_t rows, int64_t cols, int steps, MuonPrecision precision);

// The Muon state of `count` same-shape matrices, stacked as nanochat stacks a group: a momentum
// [count, rows, cols] and a NorMuon second moment [count, rows, 1] when rows >= cols, else
// [count, 1, cols]. Matrix i's slices are contiguous, so a checkpoint can name them one by one.
class MuonGroup {
 public:
  MuonGroup(int64_t count, int64_t rows, int64_t cols);

  int64_t count() const { return count_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }

  // One step for the matrices first .. first + matrices − 1 of the group (every one by
  // default; a data-parallel rank takes its share): params[i] and grads[i] are matrix i,
  // [rows, cols] row-major, for every i of the group. The gradients are read only.
  void step(std::span<float* const> params, std::span<const float* const> grads,
            const MuonHyperparameters& hyper, int64_t first = 0, int64_t matrices = -1);

  std::span<float> momentum(int64_t index);       // [rows, cols]
  std::span<float> second_moment(int64_t index);  // second_moment_shape() of matrix `index`
  // [rows, 1] or [1, cols]: one value per row or column of the longer side.
  std::vector<int64_t> second_moment_shape() const;

 private:
  int64_t count_, rows_, cols_;
  std::vector<float> momentum_;
  std::vector<float> second_moment_;
  std::vector<float> update_;  // one matrix: the work buffer of a step
};

}  // namespace fp8t::optim
