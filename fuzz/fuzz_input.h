// What the fuzzers share: their inputs as files, for the readers that take a path. Each fuzzer
// feeds its input to a reader; fp8t::Error is the reader's answer to bad input, and anything else
// that escapes, a sanitizer report, a hang or an allocation far beyond the input is a bug.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace fp8t::fuzz {

// Where the inputs are written: in memory where the machine offers it, since on a disk writing
// each input costs more than reading it.
inline std::filesystem::path scratch_root() {
  return std::filesystem::is_directory("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                   : std::filesystem::temp_directory_path();
}

// A folder of this process's own (fuzzers may run side by side), removed when it exits.
class ScratchFolder {
 public:
  ScratchFolder() : path_(scratch_root() / ("fp8train_fuzz_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~ScratchFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  // Replaces the file `name` in the folder by `bytes`; returns its path.
  std::filesystem::path write(std::string_view name, std::string_view bytes) const {
    const std::filesystem::path file = path_ / name;
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) throw std::runtime_error("fuzz: cannot write " + file.string());
    return file;
  }

 private:
  std::filesystem::path path_;
};

inline const ScratchFolder& scratch() {
  static const ScratchFolder folder;
  return folder;
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace fp8t::fuzz
