// The safetensors format: reading and (atomic) writing.
//
// Layout: an 8-byte little-endian header length N, a JSON header of N bytes
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// then the data section; offsets are relative to its start, data is little-endian and
// row-major, and the tensors cover the data section exactly (no holes, no overlaps).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "io/files.h"
#include "numerics/float_bits.h"

namespace fp8t::io {

enum class DType : uint8_t {
  BOOL,
  U8,
  I8,
  F8_E4M3,
  F8_E5M2,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  I64,
  U64,
  F64,
};

std::string_view dtype_name(DType dtype);  // as written in the header: "F32", "BF16", ...
size_t dtype_size(DType dtype);            // bytes per element
// Throws fp8t::Error for a name the format does not define.
DType parse_dtype(std::string_view name);

// The dtype a C++ element type is read and written as: bf16 is BF16, uint16_t is U16. BOOL,
// F16 and the FP8 dtypes have no element type here: read them with SafetensorsFile::raw(),
// write them with a TensorToWrite built from bytes.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::U8;
};
template <>
struct DTypeOf<int8_t> {
  static constexpr DType value = DType::I8;
};
template <>
struct DTypeOf<int16_t> {
  static constexpr DType value = DType::I16;
};
template <>
struct DTypeOf<uint16_t> {
  static constexpr DType value = DType::U16;
};
template <>
struct DTypeOf<bf16> {
  static constexpr DType value = DType::BF16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct DTypeOf<uint32_t> {
  static constexpr DType value = DType::U32;
};
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::I64;
};
template <>
struct DTypeOf<uint64_t> {
  static constexpr DType value = DType::U64;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::F64;
};

int64_t shape_numel(std::span<const int64_t> shape);  // 1 for a 0-d scalar

// What the header says about one tensor.
struct TensorInfo {
  DType dtype;
  std::vector<int64_t> shape;  // empty for a 0-d scalar
  uint64_t begin = 0;          // byte range in the data section
  uint64_t end = 0;

  int64_t numel() const { return shape_numel(shape); }
};

template <typename T>
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<T> data;  // row-major, numel() elements

  int64_t numel() const { return shape_numel(shape); }
};

struct RawTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

// A safetensors file whose header is read and checked on construction; tensor data is read
// from the file on each access, so a large checkpoint is never held whole in memory.
// Every error is an fp8t::Error whose message starts with the path.
class SafetensorsFile {
 public:
  // Throws when the file is missing or unreadable, the header is truncated or not a JSON
  // object, a dtype is unknown, a shape does not match its byte range, or the byte ranges lie
  // outside the data section, run backwards, overlap or leave holes.
  explicit SafetensorsFile(std::filesystem::path path);

  const std::filesystem::path& path() const { return path_; }
  // Tensor names in data order (ascending offsets).
  const std::vector<std::string>& names() const { return names_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return infos_.count(name) != 0; }
  // Throws when the name is absent.
  const TensorInfo& info(const std::string& name) const;
  // Throws when the name is absent or the metadata has no such key.
  const std::string& metadata_value(const std::string& key) const;

  // The tensor's elements; throws when the name is absent or its dtype is not T's.
  template <typename T>
  Tensor<T> tensor(const std::string& name) const {
    const TensorInfo& found = checked_info(name, DTypeOf<T>::value);
    Tensor<T> result{found.shape, std::vector<T>(static_cast<size_t>(found.numel()))};
    read_bytes(name, found, std::as_writable_bytes(std::span<T>(result.data)));
    return result;
  }

  // Any dtype, as bytes.
  RawTensor raw(const std::string& name) const;

 private:
  const TensorInfo& checked_info(const std::string& name, DType expected) const;
  void read_bytes(const std::string& name, const TensorInfo& info,
                  std::span<std::byte> destination) const;

  std::filesystem::path path_;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<std::string> names_;
  std::map<std::string, TensorInfo> infos_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: a view of the caller's memory.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;  // numel(shape) * dtype_size(dtype) bytes

  template <typename T>
  static TensorToWrite of(std::string name, std::vector<int64_t> shape, std::span<const T> data) {
    return {std::move(name), DTypeOf<std::remove_const_t<T>>::value, std::move(shape),
            std::as_bytes(data)};
  }
};

// Writes tensors (data in the given order) and metadata atomically: into a temporary file in
// the same folder, flushed to disk, then renamed over `path`; returns the digest of the file
// written. Throws fp8t::Error naming the
// path for a duplicate or reserved name, a size that does not match the shape, or an I/O
// failure; the destination is then left as it was.
FileDigest write_safetensors(const std::filesystem::path& path,
                             std::span<const TensorToWrite> tensors,
                             const std::map<std::string, std::string>& metadata = {});

}  // namespace fp8t::io
