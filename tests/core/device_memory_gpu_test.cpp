// Device allocations that cannot succeed say what was asked for and what the GPU has free: a
// DeviceBuffer and a DeviceArena far larger than any GPU throw DeviceOutOfMemory naming the
// bytes (and the arena its category and the keys to lower), and leave no error behind for the
// next CUDA call.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"

namespace fp8t {
namespace {

constexpr size_t kPebibyte = size_t{1} << 50;

// The message of the DeviceOutOfMemory that allocate() throws; fails the test if it throws none.
template <typename Allocate>
std::string out_of_memory_message(Allocate&& allocate) {
  try {
    allocate();
  } catch (const DeviceOutOfMemory& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected DeviceOutOfMemory";
  return {};
}

TEST(DeviceMemory, AFailedBufferNamesTheBytesAskedForAndTheFreeMemory) {
  const std::string message =
      out_of_memory_message([] { DeviceBuffer<float> buffer(kPebibyte / sizeof(float)); });
  EXPECT_NE(message.find(std::to_string(kPebibyte) + " bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("1048576.00 GiB"), std::string::npos) << message;
  EXPECT_NE(message.find("GiB free of"), std::string::npos) << message;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed allocation left an error behind";
  DeviceBuffer<float> small(16);  // the device still allocates
  EXPECT_NE(small.get(), nullptr);
}

TEST(DeviceMemory, AFailedArenaNamesItsCategoryBytesAndWhatToLower) {
  DeviceArena arena("activations");
  arena.take<std::byte>(kPebibyte);
  const std::string message = out_of_memory_message([&] { arena.allocate_planned(); });
  EXPECT_NE(message.find("for activations"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(kPebibyte) + " bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("lower micro_batch_size"), std::string::npos) << message;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace fp8t
