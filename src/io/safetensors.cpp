#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/files.h"

namespace fp8t::io {

// The format is little-endian; so is every machine this engine targets (x86-64, aarch64).
static_assert(std::endian::native == std::endian::little);

namespace {

// A header nests 3 levels (the header, a tensor, its shape). The messages below print parts of
// it with dump(), which recurses once per level: a deeply nested header would overflow the stack.
constexpr int kMaxHeaderDepth = 16;

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {DType::BOOL, "BOOL", 1},
    {DType::U8, "U8", 1},
    {DType::I8, "I8", 1},
    {DType::F8_E4M3, "F8_E4M3", 1},
    {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::I16, "I16", 2},
    {DType::U16, "U16", 2},
    {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},
    {DType::I32, "I32", 4},
    {DType::U32, "U32", 4},
    {DType::F32, "F32", 4},
    {DType::I64, "I64", 8},
    {DType::U64, "U64", 8},
    {DType::F64, "F64", 8},
}};

const DTypeEntry& entry_of(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  throw Error(fmt::format("safetensors: invalid DType value {}", static_cast<int>(dtype)));
}

std::string shape_string(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Elements times bytes per element, or nothing when that overflows 64 bits.
bool checked_byte_count(std::span<const int64_t> shape, size_t element_size, uint64_t& bytes) {
  uint64_t count = element_size;
  for (int64_t dim : shape) {
    const auto udim = static_cast<uint64_t>(dim);
    if (udim != 0 && count > std::numeric_limits<uint64_t>::max() / udim) return false;
    count *= udim;
  }
  bytes = count;
  return true;
}

uint64_t non_negative_integer(const nlohmann::json& value, bool& ok) {
  ok = value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
  return ok ? value.get<uint64_t>() : 0;
}

}  // namespace

std::string_view dtype_name(DType dtype) {
  return entry_of(dtype).name;
}

size_t dtype_size(DType dtype) {
  return entry_of(dtype).size;
}

DType parse_dtype(std::string_view name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  throw Error(fmt::format("unknown dtype '{}'", name));
}

int64_t shape_numel(std::span<const int64_t> shape) {
  int64_t count = 1;
  for (int64_t dim : shape)
    count *= dim;
  return count;
}

SafetensorsFile::SafetensorsFile(std::filesystem::path path) : path_(std::move(path)) {
  const auto fail = [this](const std::string& message) {
    throw Error(fmt::format("{}: {}", path_.string(), message));
  };

  std::error_code error;
  const bool exists = std::filesystem::exists(path_, error);
  if (!exists) fail("no such file");
  const uint64_t file_size = std::filesystem::file_size(path_, error);
  if (error) fail(fmt::format("cannot read its size: {}", error.message()));
  std::ifstream in(path_, std::ios::binary);
  if (!in) fail(fmt::format("cannot open: {}", std::strerror(errno)));

  if (file_size < 8) {
    fail(fmt::format("truncated header: the file has {} bytes, the header length alone has 8",
                     file_size));
  }
  std::array<unsigned char, 8> length_bytes{};
  in.read(reinterpret_cast<char*>(length_bytes.data()), 8);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = (header_length << 8) | length_bytes[static_cast<size_t>(i)];
  if (header_length > file_size - 8) {
    fail(fmt::format("truncated header: its length says {} bytes, the file has {} after it",
                     header_length, file_size - 8));
  }
  data_start_ = 8 + header_length;
  const uint64_t data_size = file_size - data_start_;

  std::string header_text(static_cast<size_t>(header_length), '\0');
  in.read(header_text.data(), static_cast<std::streamsize>(header_length));
  if (static_cast<uint64_t>(in.gcount()) != header_length) {
    fail(fmt::format("truncated header: read {} of its {} bytes", in.gcount(), header_length));
  }

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(
        header_text, [&](int depth, nlohmann::json::parse_event_t, const nlohmann::json&) {
          if (depth > kMaxHeaderDepth) {
            fail(fmt::format("header: expected JSON nested at most {} levels deep, found deeper",
                             kMaxHeaderDepth));
          }
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    fail(fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!header.is_object()) {
    fail(fmt::format("header is not a JSON object but a JSON {}", header.type_name()));
  }

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail("__metadata__ is not an object of strings");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) {
          fail(fmt::format("__metadata__ value of '{}' is not a string but a JSON {}", key,
                           text.type_name()));
        }
        metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    const auto fail_tensor = [&](const std::string& message) {
      fail(fmt::format("tensor '{}': {}", name, message));
    };
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets")) {
      fail_tensor("expected an object with dtype, shape and data_offsets, found " + value.dump());
    }
    const nlohmann::json& dtype = value["dtype"];
    const nlohmann::json& shape = value["shape"];
    const nlohmann::json& offsets = value["data_offsets"];
    if (!dtype.is_string()) fail_tensor("dtype is not a string: " + dtype.dump());
    TensorInfo info{};
    try {
      info.dtype = parse_dtype(dtype.get<std::string>());
    } catch (const Error& e) {
      fail_tensor(e.what());
    }
    if (!shape.is_array()) fail_tensor("shape is not an array: " + shape.dump());
    for (const nlohmann::json& dim : shape) {
      bool ok = false;
      const uint64_t extent = non_negative_integer(dim, ok);
      if (!ok || extent > uint64_t{std::numeric_limits<int64_t>::max()}) {
        fail_tensor("shape is not a list of non-negative integers: " + shape.dump());
      }
      info.shape.push_back(static_cast<int64_t>(extent));
    }
    bool begin_ok = false;
    bool end_ok = false;
    if (offsets.is_array() && offsets.size() == 2) {
      info.begin = non_negative_integer(offsets[0], begin_ok);
      info.end = non_negative_integer(offsets[1], end_ok);
    }
    if (!begin_ok || !end_ok) {
      fail_tensor("data_offsets is not a pair of non-negative integers: " + offsets.dump());
    }
    if (info.begin > info.end) {
      fail_tensor(fmt::format("data_offsets [{}, {}] are unsorted (begin after end)", info.begin,
                              info.end));
    }
    if (info.end > data_size) {
      fail_tensor(
          fmt::format("data_offsets [{}, {}] lie outside the file: its data section has "
                      "{} bytes",
                      info.begin, info.end, data_size));
    }
    uint64_t bytes = 0;
    const bool fits = checked_byte_count(info.shape, dtype_size(info.dtype), bytes);
    if (!fits || bytes != info.end - info.begin) {
      fail_tensor(fmt::format("shape {} of {} needs {} bytes, data_offsets [{}, {}] hold {}",
                              shape_string(info.shape), dtype_name(info.dtype),
                              fits ? std::to_string(bytes) : std::string("more than 2^64"),
                              info.begin, info.end, info.end - info.begin));
    }
    names_.push_back(name);
    infos_.emplace(name, std::move(info));
  }

  // The tensors must tile the data section: sorted by offset, each starts where the last ended.
  std::sort(names_.begin(), names_.end(), [this](const std::string& a, const std::string& b) {
    const TensorInfo& x = infos_.at(a);
    const TensorInfo& y = infos_.at(b);
    return std::tie(x.begin, x.end, a) < std::tie(y.begin, y.end, b);
  });
  uint64_t covered = 0;
  const std::string* previous = nullptr;
  for (const std::string& name : names_) {
    const TensorInfo& info = infos_.at(name);
    if (info.begin < covered) {
      const TensorInfo& last = infos_.at(*previous);
      fail(fmt::format("tensors '{}' [{}, {}] and '{}' [{}, {}] have overlapping data_offsets",
                       *previous, last.begin, last.end, name, info.begin, info.end));
    }
    if (info.begin > covered) {
      fail(fmt::format("bytes [{}, {}] of the data section belong to no tensor (before '{}')",
                       covered, info.begin, name));
    }
    covered = info.end;
    previous = &name;
  }
  if (covered != data_size) {
    fail(fmt::format("bytes [{}, {}] of the data section belong to no tensor (after the last)",
                     covered, data_size));
  }
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto found = infos_.find(name);
  if (found == infos_.end()) {
    throw Error(fmt::format("{}: no tensor named '{}'", path_.string(), name));
  }
  return found->second;
}

const std::string& SafetensorsFile::metadata_value(const std::string& key) const {
  const auto found = metadata_.find(key);
  if (found == metadata_.end()) {
    throw Error(fmt::format("{}: no metadata key '{}'", path_.string(), key));
  }
  return found->second;
}

const TensorInfo& SafetensorsFile::checked_info(const std::string& name, DType expected) const {
  const TensorInfo& found = info(name);
  if (found.dtype != expected) {
    throw Error(fmt::format("{}: tensor '{}': expected dtype {}, found {}", path_.string(), name,
                            dtype_name(expected), dtype_name(found.dtype)));
  }
  return found;
}

RawTensor SafetensorsFile::raw(const std::string& name) const {
  const TensorInfo& found = info(name);
  RawTensor result{found.dtype, found.shape,
                   std::vector<std::byte>(static_cast<size_t>(found.end - found.begin))};
  read_bytes(name, found, result.bytes);
  return result;
}

void SafetensorsFile::read_bytes(const std::string& name, const TensorInfo& info,
                                 std::span<std::byte> destination) const {
  if (destination.empty()) return;
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + info.begin));
  in.read(reinterpret_cast<char*>(destination.data()),
          static_cast<std::streamsize>(destination.size()));
  if (!in || static_cast<size_t>(in.gcount()) != destination.size()) {
    throw Error(
        fmt::format("{}: tensor '{}': cannot read its {} bytes at offset {} (was the "
                    "file changed after it was opened?)",
                    path_.string(), name, destination.size(), data_start_ + info.begin));
  }
}

FileDigest write_safetensors(const std::filesystem::path& path,
                             std::span<const TensorToWrite> tensors,
                             const std::map<std::string, std::string>& metadata) {
  const auto fail = [&path](const std::string& message) {
    throw Error(fmt::format("{}: {}", path.string(), message));
  };

  // Metadata first, then the tensors in data order, as the reference implementation writes.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json strings = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata)
      strings[key] = value;
    header["__metadata__"] = std::move(strings);
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const TensorToWrite& tensor : tensors) {
    if (tensor.name == "__metadata__") fail("'__metadata__' is reserved, not a tensor name");
    if (!seen.insert(tensor.name).second) {
      fail(fmt::format("tensor '{}' is given twice", tensor.name));
    }
    for (int64_t dim : tensor.shape) {
      if (dim < 0) {
        fail(fmt::format("tensor '{}': shape {} has a negative extent", tensor.name,
                         shape_string(tensor.shape)));
      }
    }
    uint64_t bytes = 0;
    if (!checked_byte_count(tensor.shape, dtype_size(tensor.dtype), bytes) ||
        bytes != tensor.bytes.size()) {
      fail(fmt::format("tensor '{}': shape {} of {} needs {} bytes, found {}", tensor.name,
                       shape_string(tensor.shape), dtype_name(tensor.dtype), bytes,
                       tensor.bytes.size()));
    }
    header[tensor.name] = {{"dtype", std::string(dtype_name(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail(fmt::format("cannot encode the header: {}", e.what()));
  }
  // Pad with spaces so the data section starts 8-byte aligned.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  std::array<unsigned char, 8> length_bytes{};
  for (size_t i = 0; i < 8; ++i)
    length_bytes[i] = static_cast<unsigned char>(header_text.size() >> (8 * i));

  std::vector<std::span<const std::byte>> pieces = {
      std::as_bytes(std::span(length_bytes)),
      std::as_bytes(std::span(header_text.data(), header_text.size()))};
  for (const TensorToWrite& tensor : tensors)
    pieces.push_back(tensor.bytes);
  return write_file_atomically(path, pieces);
}

}  // namespace fp8t::io
