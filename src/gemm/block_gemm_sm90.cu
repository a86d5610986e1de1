#include "gemm/block_gemm_sm90.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "numerics/float_bits.h"

// wgmma, TMA and setmaxnreg exist only in code built for sm_90a; other targets get an empty
// kernel, and block_gemm_sm90_serves() reports that the kernel is missing.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP8T_BLOCK_GEMM_DEVICE 1
#else
#define FP8T_BLOCK_GEMM_DEVICE 0
#endif

#ifndef FP8TRAIN_BLOCK_GEMM_FINGERPRINT
#error "src/CMakeLists.txt defines FP8TRAIN_BLOCK_GEMM_FINGERPRINT for this file"
#endif

namespace fp8t::gemm {
namespace {

constexpr int kTileM = 128;  // output rows per thread block (64 per consumer warpgroup)
constexpr int kTileN = 128;  // output columns per thread block
constexpr int kTileK = 128;  // the scale block: one stage holds one K block of each operand
constexpr int kStages = 6;
constexpr int kOperandTileBytes = kTileM * kTileK;  // FP8: one byte per element
constexpr int kStageBytes = 2 * kOperandTileBytes;
// Each stage also holds its K block's scales: a's of the tile's rows and b's of its columns
// (or, for 128x128 tiles, the aligned group of 4 that holds b's one).
constexpr int kScaleBytes = (kTileM + kTileN) * sizeof(float);
constexpr int kThreads = 384;        // the producer warpgroup and two consumer warpgroups
constexpr int kConsumerWarps = 8;    // each arrives on a stage's "empty" barrier
constexpr int kSwizzleAlign = 1024;  // the 128-byte swizzle repeats every 8 rows of 128 bytes
constexpr int kGroupRows = 16;       // tile rows per group of the tile order (see the kernel)
constexpr int kMaxSplits = 4;        // runs of K summed by atomics (KernelArgs::splits)
constexpr size_t kSharedBytes =
    size_t{kStages} * (kStageBytes + kScaleBytes) + 2 * kStages * sizeof(uint64_t) + kSwizzleAlign;

struct KernelArgs {
  int m = 0, n = 0, k_blocks = 0;
  // Split K: the K blocks in `splits` runs, one thread block per tile and run, each adding its
  // sum to the output by atomics (accumulated f32 outputs only).
  int splits = 1;
  const float* a_scale = nullptr;  // [k_blocks, m]
  const float* b_scale = nullptr;  // [k_blocks, n], or 128x128 tiles [ceil(n / 128), b_tile_ld]
  int b_tile_ld = 0;
  void* out = nullptr;
  int64_t ld = 0;
  bool out_bf16 = false;
  bool accumulate = false;
};

#if FP8T_BLOCK_GEMM_DEVICE

__device__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ void barrier_init(uint64_t* barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)),
               "r"(count));
}

__device__ void barrier_wait(uint64_t* barrier, int parity) {
  const uint32_t address = shared_address(barrier);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (done == 0);
}

__device__ void barrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier))
               : "memory");
}

__device__ void barrier_expect_bytes(uint64_t* barrier, int bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
}

// TMA: the box at (column, row) of a 2-D tensor map into shared memory; completion counts the
// box's bytes on `barrier`. Rows and columns beyond the tensor arrive as zeros.
__device__ void tma_load(void* destination, const CUtensorMap* map, int column, int row,
                         uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];" ::"r"(shared_address(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(shared_address(barrier))
      : "memory");
}

// A bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) into shared memory,
// counted on `barrier` like a TMA load.
__device__ void bulk_load(void* destination, const void* source, int bytes, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(destination)),
      "l"(source), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}

// Loads from shared memory by its 32-bit address.
__device__ float load_shared(uint32_t address) {
  float value;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(value) : "r"(address));
  return value;
}

__device__ float2 load_shared_pair(uint32_t address) {
  float2 value;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(value.x), "=f"(value.y) : "r"(address));
  return value;
}

// Waits until at most `Pending` of this warpgroup's committed wgmma groups are unfinished.
template <int Pending>
__device__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(Pending) : "memory");
}

// A wgmma shared-memory descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups
// 1024 bytes apart.
__device__ uint64_t wgmma_descriptor(const void* tile) {
  const uint64_t address = shared_address(tile);
  return ((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Keeps the compiler from moving accesses of wgmma accumulators across the asynchronous
// instructions that read and write them.
__device__ void fence_registers(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i)
    asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma of a warpgroup: d[64, 128] (+)= a[64, 32]·b[128, 32]ᵀ, both operands K-major FP8
// in shared memory ("e4m3.e5m2": a's and b's formats); `accumulate` 0 overwrites d.
#define FP8T_WGMMA_M64N128K32(TYPES)                                                               \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." TYPES                                         \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "           \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "           \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"             \
      "}, %64, %65, p, 1, 1;\n}\n"                                                                 \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])                                                                                \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <Fp8Format AFormat, Fp8Format BFormat>
__device__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                 uint32_t accumulate) {
  if constexpr (AFormat == Fp8Format::E4M3 && BFormat == Fp8Format::E4M3) {
    FP8T_WGMMA_M64N128K32("e4m3.e4m3");
  } else if constexpr (AFormat == Fp8Format::E4M3) {
    FP8T_WGMMA_M64N128K32("e4m3.e5m2");
  } else if constexpr (BFormat == Fp8Format::E4M3) {
    FP8T_WGMMA_M64N128K32("e5m2.e4m3");
  } else {
    FP8T_WGMMA_M64N128K32("e5m2.e5m2");
  }
}

// Adds (or writes) the two values at (row, col) and (row, col + 1); the runs of a split K add
// theirs by one atomic.
__device__ void store_pair(const KernelArgs& args, int row, int col, float v0, float v1) {
  const int64_t offset = row * args.ld + col;
  if (args.splits > 1) {
    atomicAdd(reinterpret_cast<float2*>(static_cast<float*>(args.out) + offset), float2{v0, v1});
  } else if (args.out_bf16) {
    bf16* out = static_cast<bf16*>(args.out) + offset;
    if (args.accumulate) {
      v0 += bf16_to_float(out[0]);
      v1 += bf16_to_float(out[1]);
    }
    const uint32_t pair = uint32_t{float_to_bf16(v0).bits} | uint32_t{float_to_bf16(v1).bits} << 16;
    *reinterpret_cast<uint32_t*>(out) = pair;
  } else {
    float2* out = reinterpret_cast<float2*>(static_cast<float*>(args.out) + offset);
    float2 value{v0, v1};
    if (args.accumulate) {
      const float2 before = *out;
      value.x += before.x;
      value.y += before.y;
    }
    *out = value;
  }
}

#endif  // FP8T_BLOCK_GEMM_DEVICE

template <Fp8Format AFormat, Fp8Format BFormat, bool BTiles>
__global__ void __launch_bounds__(kThreads, 1)
    block_gemm_kernel(const __grid_constant__ CUtensorMap a_map,
                      const __grid_constant__ CUtensorMap b_map, const KernelArgs args) {
#if FP8T_BLOCK_GEMM_DEVICE
  extern __shared__ uint8_t shared_raw[];
  uint8_t* const shared =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + kSwizzleAlign - 1) &
                                 ~uintptr_t{kSwizzleAlign - 1});
  uint8_t* const a_tiles = shared;
  uint8_t* const b_tiles = shared + kStages * kOperandTileBytes;
  float* const scales = reinterpret_cast<float*>(shared + kStages * kStageBytes);
  uint64_t* const full =
      reinterpret_cast<uint64_t*>(shared + kStages * (kStageBytes + kScaleBytes));
  uint64_t* const empty = full + kStages;
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  // Thread blocks [0, tiles) take the first run of K blocks, the next `tiles` the second, ...
  // Tiles in groups of kGroupRows tile rows, column by column within a group: the thread blocks
  // running at once share a few operand rows and columns, which stay in L2.
  const int tile_rows = (args.m + kTileM - 1) / kTileM, tile_cols = (args.n + kTileN - 1) / kTileN;
  const int tile = static_cast<int>(blockIdx.x) % (tile_rows * tile_cols);
  const int run = static_cast<int>(blockIdx.x) / (tile_rows * tile_cols);
  const int run_blocks = (args.k_blocks + args.splits - 1) / args.splits;
  const int first_block = run * run_blocks;
  const int end_block = min(args.k_blocks, first_block + run_blocks);
  const int group = tile / (kGroupRows * tile_cols);
  const int first_row = group * kGroupRows;
  const int group_rows = min(kGroupRows, tile_rows - first_row);
  const int in_group = tile % (kGroupRows * tile_cols);
  const int m0 = (first_row + in_group % group_rows) * kTileM;
  const int n0 = in_group / group_rows * kTileN;

  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      barrier_init(&full[stage], 1);
      barrier_init(&empty[stage], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {  // the producer: one thread issues every load
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      // M and N are multiples of 4: the scale rows are 16-byte aligned and whole 16-byte units.
      const int a_scale_bytes = min(kTileM, args.m - m0) * static_cast<int>(sizeof(float));
      const int b_scale_bytes =
          BTiles ? 16 : min(kTileN, args.n - n0) * static_cast<int>(sizeof(float));
      for (int block = first_block; block < end_block; ++block) {
        const int step = block - first_block, stage = step % kStages;
        float* const stage_scales = scales + stage * (kTileM + kTileN);
        barrier_wait(&empty[stage], ((step / kStages) & 1) ^ 1);
        barrier_expect_bytes(&full[stage], kStageBytes + a_scale_bytes + b_scale_bytes);
        tma_load(a_tiles + stage * kOperandTileBytes, &a_map, block * kTileK, m0, &full[stage]);
        tma_load(b_tiles + stage * kOperandTileBytes, &b_map, block * kTileK, n0, &full[stage]);
        bulk_load(stage_scales, args.a_scale + int64_t{block} * args.m + m0, a_scale_bytes,
                  &full[stage]);
        const float* b_source =
            BTiles ? args.b_scale + int64_t{n0 / 128} * args.b_tile_ld + block / 4 * 4
                   : args.b_scale + int64_t{block} * args.n + n0;
        bulk_load(stage_scales + kTileM, b_source, b_scale_bytes, &full[stage]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

  // wgmma's accumulator layout: each warp holds 16 rows; a thread holds rows `row` and row + 8,
  // and in each 8-column group j the columns col + 8j and the next.
  const int consumer = warpgroup - 1;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32 % 4;
  const int row = m0 + consumer * 64 + warp * 16 + lane / 4;
  const int col = n0 + (lane % 4) * 2;
  // The descriptors of stage 0's first K slice; a stage and a K slice only move the address.
  const uint64_t a_descriptor = wgmma_descriptor(a_tiles + consumer * 64 * kTileK);
  const uint64_t b_descriptor = wgmma_descriptor(b_tiles);
  // This thread's scales within a stage: its two rows' a scales and its columns' b scales.
  const uint32_t scales_address = shared_address(scales);
  const uint32_t a_scale_address = scales_address + (row - m0) * sizeof(float);
  const uint32_t b_scale_address =
      scales_address + (kTileM + (BTiles ? 0 : col - n0)) * sizeof(float);
  float total[64];
#pragma unroll
  for (int i = 0; i < 64; ++i)
    total[i] = 0.0f;
  // Two products in turn: while the tensor cores make one K block's, the warpgroup scales and
  // adds the previous one's (all but the last promotion of each round below).
  float even[64], odd[64];

  const auto issue = [&](float(&partial)[64], int block) {
    const int step = block - first_block, stage = step % kStages;
    barrier_wait(&full[stage], (step / kStages) & 1);
    fence_registers(partial);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    const uint64_t stage_offset = stage * kOperandTileBytes / 16;
#pragma unroll
    for (int k = 0; k < kTileK / 32; ++k) {
      wgmma_m64n128k32<AFormat, BFormat>(partial, a_descriptor + stage_offset + 2 * k,
                                         b_descriptor + stage_offset + 2 * k, k > 0 ? 1u : 0u);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  };
  // Adds a finished K block's product, scaled, to the total (rows and columns beyond the
  // output are never stored, whatever their scales hold), then frees its stage once the whole
  // warp has read the stage's scales.
  const auto promote = [&](float(&partial)[64], int block) {
    const int stage = (block - first_block) % kStages;
    fence_registers(partial);
    const uint32_t stage_bytes = stage * (kTileM + kTileN) * sizeof(float);
    const float a0 = load_shared(a_scale_address + stage_bytes);
    const float a1 = load_shared(a_scale_address + stage_bytes + 8 * sizeof(float));
    if constexpr (BTiles) {
      const float b = load_shared(b_scale_address + stage_bytes + block % 4 * sizeof(float));
      const float s0 = a0 * b, s1 = a1 * b;
#pragma unroll
      for (int i = 0; i < 64; i += 4) {
        total[i + 0] += partial[i + 0] * s0;
        total[i + 1] += partial[i + 1] * s0;
        total[i + 2] += partial[i + 2] * s1;
        total[i + 3] += partial[i + 3] * s1;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 b = load_shared_pair(b_scale_address + stage_bytes + 8 * j * sizeof(float));
        total[4 * j + 0] += partial[4 * j + 0] * (a0 * b.x);
        total[4 * j + 1] += partial[4 * j + 1] * (a0 * b.y);
        total[4 * j + 2] += partial[4 * j + 2] * (a1 * b.x);
        total[4 * j + 3] += partial[4 * j + 3] * (a1 * b.y);
      }
    }
    __syncwarp();
    if (lane == 0) barrier_arrive(&empty[stage]);
  };

  // A round of `length` K blocks from `first`, each block's product promoted while the next
  // one's is made. It ends with no wgmma in flight: ptxas serializes every wgmma of a loop that
  // carries one across its back edge.
  const auto round = [&](auto length, int first) {
    constexpr int kLength = decltype(length)::value;
    issue(even, first);
#pragma unroll
    for (int i = 0; i < kLength; ++i) {
      float(&current)[64] = i % 2 == 0 ? even : odd;
      if (i + 1 < kLength) {
        issue(i % 2 == 0 ? odd : even, first + i + 1);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      promote(current, first + i);
    }
  };
  // Pairs of K blocks ran 3 % faster on average than rounds of four on an H100
  // (docs/benchmarks.md).
  int block = first_block;
  for (; block + 2 <= end_block; block += 2)
    round(std::integral_constant<int, 2>{}, block);
  if (block < end_block) round(std::integral_constant<int, 1>{}, block);

#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (col + 8 * j >= args.n) continue;
    if (row < args.m) store_pair(args, row, col + 8 * j, total[4 * j], total[4 * j + 1]);
    if (row + 8 < args.m)
      store_pair(args, row + 8, col + 8 * j, total[4 * j + 2], total[4 * j + 3]);
  }
#endif  // FP8T_BLOCK_GEMM_DEVICE
}

__global__ void report_block_gemm_device_code(int* present) {
  *present = FP8T_BLOCK_GEMM_DEVICE;
}

// Lets every instantiation of the kernel use kSharedBytes of shared memory on the current device.
void allow_shared_memory() {
  constexpr Fp8Format e4m3 = Fp8Format::E4M3, e5m2 = Fp8Format::E5M2;
  const void* const kernels[] = {
      reinterpret_cast<const void*>(block_gemm_kernel<e4m3, e4m3, false>),
      reinterpret_cast<const void*>(block_gemm_kernel<e4m3, e4m3, true>),
      reinterpret_cast<const void*>(block_gemm_kernel<e4m3, e5m2, false>),
      reinterpret_cast<const void*>(block_gemm_kernel<e4m3, e5m2, true>),
      reinterpret_cast<const void*>(block_gemm_kernel<e5m2, e4m3, false>),
      reinterpret_cast<const void*>(block_gemm_kernel<e5m2, e4m3, true>),
      reinterpret_cast<const void*>(block_gemm_kernel<e5m2, e5m2, false>),
      reinterpret_cast<const void*>(block_gemm_kernel<e5m2, e5m2, true>)};
  for (const void* kernel : kernels) {
    FP8T_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kSharedBytes)));
  }
}

// The current device's multiprocessor count when it can run the kernels (an sm_90 GPU, and
// sm_90a code in the binary), otherwise 0. Asked once per device; that first call also prepares
// the kernels (allow_shared_memory), so launches do nothing per call but launch.
int device_ready() {
  static std::mutex mutex;
  static std::map<int, int> answers;
  int device = 0;
  FP8T_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = answers.find(device); found != answers.end()) return found->second;
  int major = 0, minor = 0;
  FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  int present = 0;
  if (major == 9 && minor == 0) {
    int* flag = nullptr;
    FP8T_CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
    report_block_gemm_device_code<<<1, 1>>>(flag);
    int host = 0;
    const cudaError_t launched = cudaGetLastError();
    const cudaError_t copied = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost);
    FP8T_CUDA_CHECK(cudaFree(flag));
    FP8T_CUDA_CHECK(launched);
    FP8T_CUDA_CHECK(copied);
    if (host == 1) {
      allow_shared_memory();
      FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&present, cudaDevAttrMultiProcessorCount, device));
    }
  }
  return answers.emplace(device, present).first->second;
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FP8T_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                     cudaEnableDefault, &found));
    FP8T_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr,
               "the CUDA driver offers no cuTensorMapEncodeTiled (needs a CUDA 12 driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// The TMA map of an FP8 operand [rows, k] with row stride ld: boxes of 128 rows x 128 bytes,
// swizzled as wgmma_descriptor() expects.
CUtensorMap operand_map(const Fp8Operand& operand, int64_t rows, int64_t k, const char* name) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(operand.ld)};
  const cuuint32_t box[2] = {kTileK, kTileM};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(operand.data), dims, strides,
      box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP8T_CHECK(result == CUDA_SUCCESS,
             "cuTensorMapEncodeTiled failed (CUresult {}) for the block GEMM's operand {} "
             "([{}, {}], ld {})",
             static_cast<int>(result), name, rows, k, operand.ld);
  return map;
}

// Split K pays where a problem has few tiles for the multiprocessors and a long K, as weight
// gradients do: the last wave of thread blocks is then a large share of the time. Measured on
// the H100 (docs/gemm.md), 2 runs gained 9-20 % on the W-GPT24 and W-FLUX535 weight gradients
// even where the tiles fill many waves, and 1536 x 1536 outputs over 16k tokens gained most
// with 3 or 4. The estimate: the waves (a partial last wave costing at least kLastWave of a
// full one) times each run's K blocks, plus each run's atomic adds of its tile.
constexpr double kLastWave = 0.6;
constexpr double kAtomicAdds = 2.0;  // one run's adds of a tile, in K blocks of work

// Output tiles of an M x N problem.
int64_t output_tiles(int64_t m, int64_t n) {
  return (m + kTileM - 1) / kTileM * ((n + kTileN - 1) / kTileN);
}

int choose_splits(int64_t m, int64_t n, int64_t k_blocks, const GemmOutput& out, bool repeatable,
                  int multiprocessors) {
  if (repeatable || out.type != GemmType::F32 || !out.accumulate || k_blocks < 2) return 1;
  const int64_t tiles = output_tiles(m, n);
  int best = 2;
  double best_cost = std::numeric_limits<double>::infinity();
  for (int splits = 2; splits <= kMaxSplits; ++splits) {
    const int64_t blocks = tiles * splits;
    const double last = static_cast<double>(blocks % multiprocessors) / multiprocessors;
    const double waves = static_cast<double>(blocks / multiprocessors) +
                         (last > 0.0 ? std::max(last, kLastWave) : 0.0);
    const double cost = waves * static_cast<double>((k_blocks + splits - 1) / splits) +
                        kAtomicAdds * static_cast<double>(blocks) / multiprocessors;
    if (cost < best_cost) {
      best = splits;
      best_cost = cost;
    }
  }
  return best;
}

template <Fp8Format AFormat, Fp8Format BFormat, bool BTiles>
void launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const KernelArgs& args,
            cudaStream_t stream) {
  const int64_t blocks = output_tiles(args.m, args.n) * args.splits;
  FP8T_CHECK(blocks < (int64_t{1} << 31), "the sm_90 block GEMM: {} thread blocks are too many",
             blocks);
  const dim3 grid(static_cast<unsigned>(blocks));
  block_gemm_kernel<AFormat, BFormat, BTiles>
      <<<grid, kThreads, kSharedBytes, stream>>>(a_map, b_map, args);
  FP8T_CUDA_CHECK_LAUNCH();
}

template <Fp8Format AFormat, Fp8Format BFormat>
void launch_for_b(const CUtensorMap& a_map, const CUtensorMap& b_map, const KernelArgs& args,
                  bool b_tiles, cudaStream_t stream) {
  if (b_tiles) {
    launch<AFormat, BFormat, true>(a_map, b_map, args, stream);
  } else {
    launch<AFormat, BFormat, false>(a_map, b_map, args, stream);
  }
}

}  // namespace

bool block_gemm_sm90_serves(const Fp8Operand& a, const Fp8Operand& b, const GemmOutput& out,
                            std::string* why) {
  const auto refuse = [why](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (a.scale_mode != ScaleMode::Block1x128) return refuse("a is not scaled in 1x128 blocks");
  if (b.scale_mode != ScaleMode::Block1x128 && b.scale_mode != ScaleMode::Block128x128)
    return refuse("b is not block-scaled");
  for (const Fp8Format format : {a.format, b.format}) {
    if (format != Fp8Format::E4M3 && format != Fp8Format::E5M2)
      return refuse("an operand is neither e4m3 nor e5m2");
  }
  if (out.type != GemmType::F32 && out.type != GemmType::BF16)
    return refuse("the output is neither f32 nor bf16");
  if (out.bias != nullptr || out.addend != nullptr || out.scale != nullptr || out.amax != nullptr)
    return refuse("the output has a bias, an addend, a scale or an amax");
  if (device_ready() == 0)
    return refuse("the program holds no sm_90a code for this GPU (the kernel needs sm_90a)");
  return true;
}

void block_gemm_sm90_planned(int64_t m, int64_t n, int64_t k, const Fp8Operand& a,
                             const Fp8Operand& b, const GemmOutput& out, const BlockGemmPlan& plan,
                             cudaStream_t stream) {
  std::string why;
  FP8T_CHECK(block_gemm_sm90_serves(a, b, out, &why),
             "the sm_90 block GEMM cannot serve M={}, N={}, K={}: {}", m, n, k, why);
  FP8T_CHECK(m > 0 && n > 0 && k > 0 && k % 16 == 0 && m % 4 == 0 && n % 4 == 0 &&
                 m < (int64_t{1} << 31) - kTileM && n < (int64_t{1} << 31) - kTileN &&
                 k < (int64_t{1} << 31) - kTileK,
             "the sm_90 block GEMM needs positive M and N multiples of 4 and K a multiple of 16, "
             "found M={}, N={}, K={}",
             m, n, k);
  FP8T_CHECK(plan.splits >= 1 && plan.splits <= kMaxSplits &&
                 (plan.splits == 1 || (out.type == GemmType::F32 && out.accumulate)),
             "the sm_90 block GEMM cannot run M={}, N={}, K={} in {} runs of K (1 to {}, more "
             "than 1 only for an accumulated f32 output)",
             m, n, k, plan.splits, kMaxSplits);
  KernelArgs args;
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.k_blocks = static_cast<int>((k + kTileK - 1) / kTileK);
  args.splits = plan.splits;
  args.a_scale = a.scale_inv;
  args.b_scale = b.scale_inv;
  args.b_tile_ld = static_cast<int>(padded_tile_scale_row(args.k_blocks));
  args.out = out.data;
  args.ld = out.ld;
  args.out_bf16 = out.type == GemmType::BF16;
  args.accumulate = out.accumulate;
  const CUtensorMap a_map = operand_map(a, m, k, "a");
  const CUtensorMap b_map = operand_map(b, n, k, "b");
  const bool b_tiles = b.scale_mode == ScaleMode::Block128x128;
  constexpr Fp8Format e4m3 = Fp8Format::E4M3, e5m2 = Fp8Format::E5M2;
  if (a.format == e4m3 && b.format == e4m3) {
    launch_for_b<e4m3, e4m3>(a_map, b_map, args, b_tiles, stream);
  } else if (a.format == e4m3) {
    launch_for_b<e4m3, e5m2>(a_map, b_map, args, b_tiles, stream);
  } else if (b.format == e4m3) {
    launch_for_b<e5m2, e4m3>(a_map, b_map, args, b_tiles, stream);
  } else {
    launch_for_b<e5m2, e5m2>(a_map, b_map, args, b_tiles, stream);
  }
}

BlockGemmPlan block_gemm_sm90_plan(int64_t m, int64_t n, int64_t k, const GemmOutput& out,
                                   bool repeatable) {
  return {.splits = choose_splits(m, n, (k + kTileK - 1) / kTileK, out, repeatable,
                                  std::max(1, device_ready()))};
}

void block_gemm_sm90(int64_t m, int64_t n, int64_t k, const Fp8Operand& a, const Fp8Operand& b,
                     const GemmOutput& out, bool repeatable, cudaStream_t stream) {
  block_gemm_sm90_planned(m, n, k, a, b, out, block_gemm_sm90_plan(m, n, k, out, repeatable),
                          stream);
}

std::string block_gemm_sm90_fingerprint() {
  return FP8TRAIN_BLOCK_GEMM_FINGERPRINT;
}

}  // namespace fp8t::gemm
