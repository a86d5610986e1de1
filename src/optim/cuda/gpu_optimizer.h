// The GPT's optimizer on the GPU (CUDA builds only): GptOptimizer::step (optim/gpt_optimizer.h)
// for parameters (fp32, or bf16 where the layout says so) and fp32 gradients that live on the
// device in a DeviceParameterLayout, plus
// the gradient norm and clipping of optim/clip.h. Everything is asynchronous on the stream a
// call is given and nothing synchronizes inside a step: norms and scales stay on the device,
// the step counter and the schedule reach the kernels as arguments.
//
// The math is GptOptimizer's with MuonPrecision::Bf16 (nanochat on sm80+ GPUs):
//   - AdamW groups: every tensor of every AdamW group in one launch, bit for bit adamw_step.
//   - Muon groups, all matrices of a group at once: Nesterov momentum (fp32 state) into a bf16
//     stack, MuonEq, Polar Express through batched cuBLASLt BF16 GEMMs (fp32 accumulation, its
//     sums in the GEMMs' epilogues, bf16 results, rounded where muon.h's Bf16 rounds), Muon+,
//     NorMuon (fp32 second moment) and the cautious weight-decayed update of the fp32 parameters.
//     Sums of squares accumulate in double in a fixed order, so a step is deterministic; it differs
//     from the CPU's only where the GEMMs' fp32 sums round a bf16 result the other way.
//
// All device memory (state, tables, workspace) is taken at construction; the workspace may be
// borrowed from memory the model needs only during forward and backward. The state is zero and
// the step counter 0 until upload_state. Calls of one instance must not overlap in time (one
// stream, or ordered by events), and neither may other users of the CublasLtGemm's workspace.
//
// C++17: CUDA sources include this header. Below the class, the kernels' host launchers
// (gpu_optimizer.cu), which the class strings together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "gemm/cublaslt_gemm.h"
#include "numerics/float_bits.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t::optim {

class GptOptimizer;
struct OptimizerGroup;
struct StepSchedule;

// The collectives of the tensor-parallel group whose rank's shares a layout holds
// (DeviceParameterLayout::tensor_parallel > 1), in place on the device and queued on the stream,
// every rank of the group calling each: Muon gathers each split matrix's shares to orthogonalize
// it whole (all_gather_bf16: every rank's `count` values into `all` [ranks, count]), the gradient
// norm sums the shares' squares (sum), and a download of the state gathers the shares' moments
// (sum, sum_bf16).
struct ShareCollectives {
  std::function<void(const bf16* own, bf16* all, size_t count, cudaStream_t stream)>
      all_gather_bf16;
  std::function<void(float* values, size_t count, cudaStream_t stream)> sum;
  std::function<void(bf16* values, size_t count, cudaStream_t stream)> sum_bf16;
};

class CudaGptOptimizer {
 public:
  // The groups (parameters, rules, lrs, betas, eps, weight decays) and the shard are copied
  // from `host`, which must have been built for the model whose parameters `layout` lays out.
  // With a shard of several ranks (ZeRO-1) the optimizer holds state for, and updates, only the
  // parameters this rank owns. The GEMMs run
  // on `gemm`, which must outlive this optimizer. Runs on the current CUDA device.
  // `borrowed`, `borrowed_bytes`: device memory (256-byte aligned) that nothing else uses while
  // step(), global_norm() or clip() run, such as CudaGptModel::scratch_between_steps(); the
  // workspace lives there when it fits, else in memory of the optimizer's own.
  // A layout of a tensor-parallel rank's shares needs its group's `collectives`: the optimizer
  // updates the shares, with the moments of its shares only (ZeRO-1's shard then splits the
  // parameters over the data-parallel replicas, each rank of a group owning the same).
  CudaGptOptimizer(const GptOptimizer& host, const DeviceParameterLayout& layout,
                   gemm::CublasLtGemm& gemm, uint8_t* borrowed = nullptr, size_t borrowed_bytes = 0,
                   ShareCollectives collectives = {});
  ~CudaGptOptimizer();
  CudaGptOptimizer(const CudaGptOptimizer&) = delete;

  // The device bytes an optimizer built from these arguments takes (its state, tables and,
  // unless borrowed_bytes hold it, its workspace): device_state_bytes() +
  // device_workspace_bytes(), before anything is allocated.
  static size_t planned_device_bytes(const GptOptimizer& host, const DeviceParameterLayout& layout,
                                     size_t borrowed_bytes);
  // The workspace's bytes alone: what `borrowed_bytes` must hold for the workspace to live
  // there.
  static size_t planned_workspace_bytes(const GptOptimizer& host,
                                        const DeviceParameterLayout& layout);
  CudaGptOptimizer& operator=(const CudaGptOptimizer&) = delete;

  // One step over every parameter; params, bf16_params and grads are the base pointers of the
  // layout's fp32 parameters, bf16 parameters (null when it has none) and gradients. The moments
  // of bf16 parameters are bf16 too, as GptOptimizer with OptimizerSettings::bf16_embeddings
  // keeps them.
  void step(float* params, bf16* bf16_params, const float* grads, const StepSchedule& schedule,
            cudaStream_t stream);

  // *norm_out (device) = sqrt(Σ grads²) over count elements, summed in double in an order that
  // depends only on count: the same gradients give the same norm, bit for bit. With a layout of
  // shares (count: all of its elements) each run of shares and of whole tensors sums its squares
  // (rounded to fp32), the shares' are summed over the group and the whole tensors', which every
  // rank of it holds alike, added once: the norm of the whole gradients, the same on every rank
  // of the group.
  void global_norm(const float* grads, int64_t count, float* norm_out, cudaStream_t stream);
  // Reads *norm (device); when it exceeds max_norm, scales the gradients by
  // max_norm / (norm + 1e-6). A non-finite norm leaves them as they are (clip_gradients' rule).
  void clip(float* grads, int64_t count, const float* norm, float max_norm, cudaStream_t stream);

  // Copies the state into host.state() (same names and shapes as the host's own: momentum and
  // second_moment per Muon matrix, exp_avg and exp_avg_sq per AdamW tensor, optimizer.step),
  // for a checkpoint, and back from it; with a shard, the buffers of this rank's parameters
  // only. Both wait for all device work first. With a layout of shares, a download gathers the
  // shares' state over the group (every rank of it downloads together) and an upload takes this
  // rank's share of the host's. `host` must have
  // the groups this optimizer was built from; a mismatch throws before anything is copied.
  void download_state(GptOptimizer& host) const;
  void upload_state(GptOptimizer& host);

  size_t device_state_bytes() const;  // moments and second moments
  // Device memory of its own besides the state: tables, and the workspace (bf16 stacks, Gram
  // matrices, scales) unless borrowed.
  size_t device_workspace_bytes() const;
  bool workspace_borrowed() const;
  int64_t steps_taken() const;
  // The host's groups, with lr updated by each step as GptOptimizer::step updates its own.
  const std::vector<OptimizerGroup>& groups() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace fp8t::optim

// --- The kernels' launchers (gpu_optimizer.cu). Device pointers, sizes and a stream; each checks
// its arguments (throwing fp8t::Error) and the launch. ---
namespace fp8t::optim::cuda {

// AdamW (optim/adamw.h) over many tensors in one launch: the tensors are cut into chunks, and a
// block updates one chunk with the scalars of its group.
inline constexpr int kMaxAdamWGroups = 8;
inline constexpr int64_t kAdamWChunkElements = 16384;

struct AdamWChunk {
  int64_t param;  // offset (elements) of the chunk in the parameters
  int64_t grad;   // and in the gradients (the same for fp32 parameters)
  int64_t state;  // offset (elements) of the chunk in exp_avg and exp_avg_sq
  int32_t count;  // 1 to kAdamWChunkElements elements
  int32_t group;  // index into AdamWStep::groups
};

// adamw_step's fp32 scalars for one group and one step.
struct AdamWScalars {
  float decay;      // 1 − lr·wd
  float weight1;    // 1 − β1
  float weight2;    // 1 − β2
  float inv_bias2;  // 1 / (1 − β2^step)
  float step_size;  // lr / (1 − β1^step)
  float eps;
};

struct AdamWStep {
  AdamWScalars groups[kMaxAdamWGroups];
};

// adamw_step's scalars (optim/adamw.cpp) at this lr and step, computed in double and rounded to
// fp32 as it does.
AdamWScalars adamw_step_scalars(double lr, double beta1, double beta2, double eps,
                                double weight_decay, int64_t step);

// chunk_amax (optional, chunk_count values): chunk i's new values' largest magnitude, as the
// bits abs_bits (numerics/float_bits.h) orders, NaN above inf.
void adamw_multi_tensor(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                        const AdamWChunk* chunks, int64_t chunk_count, const AdamWStep& step,
                        cudaStream_t stream, uint32_t* chunk_amax = nullptr);

// A tensor's chunks chunk_amax[first_chunk .. first_chunk + chunks) of an AdamW step, and where
// their largest amax goes (a float, overwritten): tensor_amaxes folds them after the step.
struct TensorAmax {
  float* amax;
  int64_t first_chunk;
  int64_t chunks;
};
void tensor_amaxes(const TensorAmax* tensors, int64_t tensor_count, const uint32_t* chunk_amax,
                   cudaStream_t stream);
// Parameters and moments stored in bf16: the step in fp32 from the values they hold, each result
// rounded to bf16 once, as GptOptimizer's bf16 storage rounds.
void adamw_multi_tensor(bf16* params, const float* grads, bf16* exp_avg, bf16* exp_avg_sq,
                        const AdamWChunk* chunks, int64_t chunk_count, const AdamWStep& step,
                        cudaStream_t stream);

// Muon (optim/muon.h) for `count` matrices [rows, cols] of one group. The bf16 work buffers
// stack them `stride` elements apart (>= rows·cols; a multiple of 128 keeps every matrix
// 256-byte aligned for cuBLASLt). offsets[i] (device) is matrix i's offset in the parameters
// and the gradients, a multiple of 8 (DeviceParameterLayout puts every tensor on a 256-byte
// boundary): the passes take 16-byte vectors where the rows allow.
struct MuonShape {
  int64_t count;
  int64_t rows;
  int64_t cols;
  int64_t stride;
};

// Step 1: m = lerp(m, g, 1 − μ) in momentum [count, rows·cols] (fp32, unpadded); then
// update = bf16(lerp(g, m, μ)), and row_squares as muon_row_squares(update) writes them.
void muon_nesterov(bf16* update, double* row_squares, float* momentum, const float* grads,
                   const int64_t* offsets, const MuonShape& shape, float mu, cudaStream_t stream);

// row_squares[i·rows + r] = Σ_c (x[i, r, c] · f_i)², in double; f_i = matrix_factors[i], or 1
// when matrix_factors is null (the fp32 product rounds first, as the CPU's).
void muon_row_squares(double* row_squares, const bf16* x, const float* matrix_factors,
                      const MuonShape& shape, cudaStream_t stream);
// column_squares[i·cols + c] = Σ_r (x[i, r, c] · f_i)².
void muon_column_squares(double* column_squares, const bf16* x, const float* matrix_factors,
                         const MuonShape& shape, cudaStream_t stream);

// What muon_matrix_scalars derives from each matrix's Frobenius norm ‖X‖ (from row_squares).
enum class MatrixScalar : uint8_t {
  MuonEqTarget,         // ‖X‖ / √rows: the row norm MuonEq gives every row
  PolarExpressDivisor,  // bf16(bf16(1.01 · bf16(‖X‖)) + 1e-6): Polar Express's normalization
  MuonPlusFactor,       // (1 / max(‖X‖, 1e-6)) · √min(rows, cols): Muon+'s rescaling
};
void muon_matrix_scalars(float* scalars, const double* row_squares, const MuonShape& shape,
                         MatrixScalar kind, cudaStream_t stream);

// Step 2 in place: row r of matrix i times bf16(targets[i] / max(sqrt(row_squares), 1e-6)),
// rounded to bf16; row_squares then holds the new rows' sums of squares.
void muon_equilibrate_rows(bf16* x, double* row_squares, const float* targets,
                           const MuonShape& shape, cudaStream_t stream);

// x_i = bf16(x_i / divisors[i]).
void muon_divide(bf16* x, const float* divisors, const MuonShape& shape, cudaStream_t stream);

// NorMuon's scales from line_squares (Σ (X·f)² per row when rows >= cols, else per column):
// updates second_moment [count, max(rows, cols)] (fp32 state) with weight 1 − beta2 and writes
// scales [count, max(rows, cols)].
void normuon_scales(float* scales, float* second_moment, const double* line_squares,
                    const MuonShape& shape, float beta2, cudaStream_t stream);

// Under tensor parallelism, matrix i's share on each rank of the group: a run of whole rows
// (by_rows) or of each row's columns, [rows, cols]; rank t's starts at t·rows or t·cols.
struct MuonShare {
  int64_t rows;
  int64_t cols;
  int32_t by_rows;
};
// A group's shares: `table` (device, one per matrix; null: the matrices are whole), this rank,
// the elements of each share (the same for all) and the fewest columns of any.
struct MuonShares {
  const MuonShare* table = nullptr;
  int rank = 0;
  int64_t elements = 0;
  int64_t min_cols = 0;
};

// Step 6: u = (x·f_i)·scales[line]; p −= lr·u + [u·p >= 0]·decay·p (the cautious weight decay).
// With shares, the parameters at offsets[i] are this rank's share of matrix i, and x and the
// scales the whole matrix's.
void muon_cautious_update(float* params, const int64_t* offsets, const bf16* x,
                          const float* matrix_factors, const float* scales, const MuonShape& shape,
                          float lr, float decay, cudaStream_t stream,
                          const MuonShares& shares = {});

// The ranks' shares of each matrix, gathered ([ranks, count] shares, share_stride elements
// apart), into their places in x [count, rows, cols].
void muon_place_shares(bf16* x, const bf16* gathered, const MuonShares& shares,
                       const MuonShape& shape, int64_t share_stride, int ranks,
                       cudaStream_t stream);

// Gradient norm: blocks sum squares in double into partials (kNormPartials doubles, contents
// irrelevant), then one block adds them in block order: *norm = sqrt(total).
inline constexpr int kNormPartials = 1024;
void sum_of_squares_norm(float* norm, const float* values, int64_t count, double* partials,
                         cudaStream_t stream);
// The same sum without the root: *squares = total (fp32), for a norm whose parts are summed over
// a group first; norm_of_squares then writes *norm = sqrt(squares[0] + … + squares[count − 1]).
void sum_of_squares(float* squares, const float* values, int64_t count, double* partials,
                    cudaStream_t stream);
void norm_of_squares(float* norm, const float* squares, int count, cudaStream_t stream);
// values *= max_norm / (*norm + 1e-6) when *norm > max_norm and finite.
void clip_by_norm(float* values, int64_t count, const float* norm, float max_norm,
                  cudaStream_t stream);

}  // namespace fp8t::optim::cuda
