// Device memory for one category (activations, workspace, ...) taken in one cudaMalloc, sized
// by a planning pass: the owner runs the same layout code twice, first against a planning arena
// that only counts, then against the allocated one, so plan and allocation cannot disagree and
// nothing is allocated once training runs (CUDA builds only).
#pragma once

#include <cstddef>
#include <string>

namespace fp8t {

class DeviceArena {
 public:
  static constexpr size_t kAlignment = 256;

  // A planning arena: take() returns null and counts.
  explicit DeviceArena(std::string name);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // Allocates the bytes counted so far and starts over, now handing out memory. Throws
  // fp8t::Error naming the arena and the sizes when the device cannot provide them.
  void allocate_planned();

  template <typename T>
  T* take(size_t count) {
    return static_cast<T*>(take_bytes(count * sizeof(T)));
  }
  void* take_bytes(size_t bytes);

  const std::string& name() const { return name_; }
  size_t bytes() const { return planned_; }
  bool allocated() const { return memory_ != nullptr; }

 private:
  std::string name_;
  size_t planned_ = 0;
  size_t used_ = 0;
  std::byte* memory_ = nullptr;
};

}  // namespace fp8t
