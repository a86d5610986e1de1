// The safetensors reader (checkpoints, Flux shards): the input is a .safetensors file. One that
// opens has every tensor read, raw and (for dtypes with an element type) typed, and is then
// checked as a Flux shard.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "data/flux_shards.h"
#include "fuzz_input.h"
#include "io/safetensors.h"
#include "numerics/float_bits.h"

namespace {

using fp8t::io::DType;

template <typename T>
void read_typed(const fp8t::io::SafetensorsFile& file, const std::string& name) {
  const fp8t::io::Tensor<T> tensor = file.tensor<T>(name);
  if (static_cast<int64_t>(tensor.data.size()) != tensor.numel()) std::abort();
}

void read_tensor(const fp8t::io::SafetensorsFile& file, const std::string& name) {
  const fp8t::io::RawTensor raw = file.raw(name);
  const auto bytes =
      static_cast<uint64_t>(fp8t::io::shape_numel(raw.shape)) * fp8t::io::dtype_size(raw.dtype);
  if (raw.bytes.size() != bytes) std::abort();
  switch (raw.dtype) {
    case DType::U8:
      return read_typed<uint8_t>(file, name);
    case DType::I8:
      return read_typed<int8_t>(file, name);
    case DType::I16:
      return read_typed<int16_t>(file, name);
    case DType::U16:
      return read_typed<uint16_t>(file, name);
    case DType::BF16:
      return read_typed<fp8t::bf16>(file, name);
    case DType::I32:
      return read_typed<int32_t>(file, name);
    case DType::U32:
      return read_typed<uint32_t>(file, name);
    case DType::F32:
      return read_typed<float>(file, name);
    case DType::I64:
      return read_typed<int64_t>(file, name);
    case DType::U64:
      return read_typed<uint64_t>(file, name);
    case DType::F64:
      return read_typed<double>(file, name);
    default:
      return;  // read raw only
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path =
      fp8t::fuzz::scratch().write("input.safetensors", fp8t::fuzz::as_text(data, size));
  try {
    const fp8t::io::SafetensorsFile file(path);
    for (const std::string& name : file.names())
      read_tensor(file, name);
  } catch (const fp8t::Error&) {  // bad input, refused with a message
    return 0;
  }
  const std::array paths = {path};
  fp8t::data::check_flux_shards(paths, nullptr);  // reports errors in its result, never throws
  return 0;
}
