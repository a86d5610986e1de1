#include "io/safetensors.h"
#include "models/golden.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/gpt_config.h"
#include "test_files.h"

namespace fp8t::io {
namespace {

namespace fs = std::filesystem;
using test::Contains;
using test::error_message;

class Safetensors : public ::testing::Test {
 protected:
  // A file made of the 8-byte length of `header`, `header` and `data`.
  fs::path write_raw(const std::string& header, const std::string& data = "",
                     const std::string& name = "bad.safetensors") {
    std::string bytes(8, '\0');
    for (size_t i = 0; i < 8; ++i)
      bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
    return write_bytes(bytes + header + data, name);
  }

  fs::path write_bytes(const std::string& bytes, const std::string& name = "bad.safetensors") {
    const fs::path path = folder_ / name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // The message of the error that opening `path` raises.
  static std::string open_error(const fs::path& path) {
    return error_message([&] { SafetensorsFile file(path); });
  }

  test::TempFolder folder_;
};

TEST_F(Safetensors, RoundTripsDtypesShapesAndMetadata) {
  const std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f};
  const std::vector<double> f64 = {3.141592653589793, -1e300, 2.5, 0.1};
  const std::vector<bf16> bf16s = {float_to_bf16(1.0f), float_to_bf16(-3.5f), float_to_bf16(0.1f)};
  const std::vector<int32_t> i32 = {0, -1, 2147483647, -2147483647 - 1, 7, 8, 9, 10};
  const std::vector<int64_t> i64 = {int64_t{1} << 40};
  const std::vector<uint8_t> u8 = {0, 1, 127, 128, 255};
  const std::vector<float> scalar = {42.0f};
  const std::vector<float> empty;
  const std::vector<std::byte> e4m3 = {std::byte{0x38}, std::byte{0xB8}};
  const std::vector<TensorToWrite> tensors = {
      TensorToWrite::of<float>("layer.weight", {2, 3}, f32),
      TensorToWrite::of<double>("f64", {4}, f64),
      TensorToWrite::of<bf16>("embedding", {3, 1}, bf16s),
      TensorToWrite::of<int32_t>("idx", {2, 2, 2}, i32),
      TensorToWrite::of<int64_t>("i64", {1}, i64),
      TensorToWrite::of<uint8_t>("bytes", {5}, u8),
      TensorToWrite::of<float>("scalar", {}, scalar),
      TensorToWrite::of<float>("empty", {0, 3}, empty),
      {"fp8", DType::F8_E4M3, {2}, e4m3},
  };
  const std::map<std::string, std::string> metadata = {{"format", "test"}, {"version", "1"}};
  const fs::path path = folder_ / "round_trip.safetensors";
  write_safetensors(path, tensors, metadata);

  const SafetensorsFile file(path);
  EXPECT_EQ(file.metadata(), metadata);
  EXPECT_EQ(file.metadata_value("version"), "1");
  std::vector<std::string> expected_names;
  for (const TensorToWrite& tensor : tensors)
    expected_names.push_back(tensor.name);
  // names() lists data order, which is write order (the empty tensor included).
  EXPECT_EQ(file.names(), expected_names);

  const Tensor<float> weight = file.tensor<float>("layer.weight");
  EXPECT_EQ(weight.shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(weight.data.size(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i)  // bit-exact, -0.0 included
    EXPECT_EQ(float_to_bits(weight.data[i]), float_to_bits(f32[i])) << i;
  EXPECT_EQ(file.tensor<double>("f64").data, f64);
  const Tensor<bf16> embedding = file.tensor<bf16>("embedding");
  EXPECT_EQ(embedding.shape, (std::vector<int64_t>{3, 1}));
  for (size_t i = 0; i < bf16s.size(); ++i)
    EXPECT_EQ(embedding.data[i].bits, bf16s[i].bits);
  const Tensor<int32_t> idx = file.tensor<int32_t>("idx");
  EXPECT_EQ(idx.shape, (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(idx.data, i32);
  EXPECT_EQ(file.tensor<int64_t>("i64").data, i64);
  EXPECT_EQ(file.tensor<uint8_t>("bytes").data, u8);
  const Tensor<float> read_scalar = file.tensor<float>("scalar");
  EXPECT_TRUE(read_scalar.shape.empty());
  EXPECT_EQ(read_scalar.numel(), 1);
  EXPECT_EQ(read_scalar.data, scalar);
  const Tensor<float> read_empty = file.tensor<float>("empty");
  EXPECT_EQ(read_empty.shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(read_empty.data.empty());
  const RawTensor fp8 = file.raw("fp8");
  EXPECT_EQ(fp8.dtype, DType::F8_E4M3);
  EXPECT_EQ(fp8.bytes, e4m3);
  EXPECT_EQ(file.info("idx").dtype, DType::I32);

  // The data section starts 8-byte aligned (the header is padded with spaces).
  std::ifstream in(path, std::ios::binary);
  uint64_t header_length = 0;
  in.read(reinterpret_cast<char*>(&header_length), 8);
  EXPECT_EQ(header_length % 8, 0u);
}

TEST_F(Safetensors, ReadsAFileWrittenByHand) {
  // As the reference implementation writes it: metadata first, padded header.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  )";
  std::string data(16, '\0');
  const float a[2] = {1.0f, -2.0f};
  const int64_t b = -5;
  std::memcpy(data.data(), a, 8);
  std::memcpy(data.data() + 8, &b, 8);
  const SafetensorsFile file(write_raw(header, data, "hand.safetensors"));
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.tensor<float>("a").data, (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(file.tensor<int64_t>("b").data, std::vector<int64_t>{-5});
}

TEST_F(Safetensors, WritesAtomicallyOverAnExistingFile) {
  const fs::path path = folder_ / "model.safetensors";
  const std::vector<float> first = {1, 2, 3};
  write_safetensors(path, std::vector{TensorToWrite::of<float>("x", {3}, first)});
  const std::vector<float> second = {4, 5};
  write_safetensors(path, std::vector{TensorToWrite::of<float>("y", {2}, second)});
  const SafetensorsFile file(path);
  EXPECT_EQ(file.names(), std::vector<std::string>{"y"});
  EXPECT_EQ(file.tensor<float>("y").data, second);
  EXPECT_TRUE(file.metadata().empty());

  // A failed write leaves the destination as it was and no temporary file behind.
  const std::vector<TensorToWrite> mismatched = {TensorToWrite::of<float>("z", {3}, second)};
  const std::string message = error_message([&] { write_safetensors(path, mismatched); });
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(Contains(message, "tensor 'z': shape [3] of F32 needs 12 bytes, found 8"));
  EXPECT_EQ(SafetensorsFile(path).tensor<float>("y").data, second);
  EXPECT_EQ(std::distance(fs::directory_iterator(folder_.path()), fs::directory_iterator()), 1);
}

TEST_F(Safetensors, WriterRejectsDuplicateAndReservedNames) {
  const std::vector<float> value = {1};
  const fs::path path = folder_ / "names.safetensors";
  const std::vector<TensorToWrite> duplicate = {TensorToWrite::of<float>("x", {1}, value),
                                                TensorToWrite::of<float>("x", {1}, value)};
  EXPECT_TRUE(Contains(error_message([&] { write_safetensors(path, duplicate); }),
                       "tensor 'x' is given twice"));
  const std::vector<TensorToWrite> reserved = {
      TensorToWrite::of<float>("__metadata__", {1}, value)};
  EXPECT_THROW(write_safetensors(path, reserved), Error);
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(Safetensors, MissingNameAndWrongDtypeNameFileAndTensor) {
  const fs::path path = folder_ / "typed.safetensors";
  const std::vector<int32_t> value = {1, 2};
  write_safetensors(path, std::vector{TensorToWrite::of<int32_t>("input.idx", {2}, value)});
  const SafetensorsFile file(path);
  const std::string wrong_dtype = error_message([&] { file.tensor<float>("input.idx"); });
  EXPECT_TRUE(Contains(wrong_dtype, path.string()));
  EXPECT_TRUE(Contains(wrong_dtype, "tensor 'input.idx': expected dtype F32, found I32"));
  const std::string missing = error_message([&] { file.tensor<int32_t>("input.targets"); });
  EXPECT_TRUE(Contains(missing, path.string()));
  EXPECT_TRUE(Contains(missing, "no tensor named 'input.targets'"));
  EXPECT_THROW(file.metadata_value("format"), Error);
}

TEST_F(Safetensors, MissingFile) {
  const fs::path path = folder_ / "absent.safetensors";
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(Contains(message, "no such file"));
}

TEST_F(Safetensors, TruncatedHeader) {
  const fs::path short_file = write_bytes("abc", "short.safetensors");
  EXPECT_TRUE(Contains(open_error(short_file), short_file.string()));
  EXPECT_TRUE(Contains(open_error(short_file), "truncated header: the file has 3 bytes"));

  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const fs::path cut = write_bytes(std::string("\x00\x10\x00\x00\x00\x00\x00\x00", 8) + header,
                                   "cut.safetensors");  // says 4096 bytes
  const std::string message = open_error(cut);
  EXPECT_TRUE(Contains(message, cut.string()));
  EXPECT_TRUE(
      Contains(message, "truncated header: its length says 4096 bytes, the file has 54 after it"));
}

TEST_F(Safetensors, BadJson) {
  const fs::path path = write_raw(R"({"a": {"dtype": "F32", )");
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(Contains(message, "header is not valid JSON"));

  const fs::path array = write_raw("[1, 2]", "", "array.safetensors");
  EXPECT_TRUE(Contains(open_error(array), "header is not a JSON object but a JSON array"));
  const fs::path metadata = write_raw(R"({"__metadata__":{"seed":1234}})", "", "meta.safetensors");
  EXPECT_TRUE(Contains(open_error(metadata), "__metadata__ value of 'seed' is not a string"));
}

// A header nested 100 000 levels deep is refused when parsed: printing part of it in a message
// (dump() recurses once per level) overflowed the stack.
TEST_F(Safetensors, DeeplyNestedHeader) {
  const std::string nested = std::string(100000, '[') + std::string(100000, ']');
  const fs::path path = write_raw(R"({"a":)" + nested + "}");
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(
      Contains(message, "header: expected JSON nested at most 16 levels deep, found deeper"));
}

TEST_F(Safetensors, OffsetsOutsideTheFile) {
  const fs::path path =
      write_raw(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, 'x'));
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(Contains(message,
                       "tensor 'w': data_offsets [0, 16] lie outside the file: its data section "
                       "has 8 bytes"));
}

TEST_F(Safetensors, UnknownDtype) {
  const fs::path path =
      write_raw(R"({"w":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", std::string(1, 'x'));
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(Contains(message, "tensor 'w': unknown dtype 'F7'"));
}

TEST_F(Safetensors, OverlappingOffsets) {
  const fs::path path = write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                  std::string(12, 'x'));
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(
      Contains(message, "tensors 'a' [0, 8] and 'b' [4, 12] have overlapping data_offsets"));
}

TEST_F(Safetensors, UnsortedOffsets) {
  const fs::path path =
      write_raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", std::string(8, 'x'));
  const std::string message = open_error(path);
  EXPECT_TRUE(Contains(message, path.string()));
  EXPECT_TRUE(Contains(message, "tensor 'a': data_offsets [8, 4] are unsorted"));
}

TEST_F(Safetensors, ShapeThatDoesNotFitItsBytes) {
  const fs::path path =
      write_raw(R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", std::string(4, 'x'));
  EXPECT_TRUE(Contains(open_error(path),
                       "tensor 'a': shape [3] of BF16 needs 6 bytes, data_offsets [0, 4] hold 4"));
}

TEST_F(Safetensors, BytesThatBelongToNoTensor) {
  const fs::path hole = write_raw(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                                  std::string(4, 'x'), "hole.safetensors");
  EXPECT_TRUE(Contains(open_error(hole), "bytes [0, 2] of the data section belong to no tensor"));
  const fs::path tail = write_raw(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
                                  std::string(4, 'x'), "tail.safetensors");
  EXPECT_TRUE(Contains(open_error(tail), "bytes [2, 4] of the data section belong to no tensor"));
}

// The golden file of tests/reference/gpt_reference.py holds exactly the parameters of the C++
// parameter table, with their gradients, inputs and outputs (skipped until it is generated).
TEST_F(Safetensors, GoldenFileMatchesTheGptParameterTable) {
  const fs::path path = testing::golden_path();
  if (!fs::exists(path)) GTEST_SKIP() << path << " not generated";
  const SafetensorsFile file(path);
  EXPECT_EQ(file.metadata_value("format"), "fp8train-golden");
  EXPECT_EQ(file.metadata_value("version"), "1");
  const GptConfig config = testing::golden_config(file);
  const int64_t batch = std::stoi(file.metadata_value("batch"));

  const std::vector<ParamSpec> params = gpt_parameters(config);
  for (const ParamSpec& param : params) {
    EXPECT_EQ(file.info(param.name).dtype, DType::F32) << param.name;
    EXPECT_EQ(file.info(param.name).shape, param.shape) << param.name;
    EXPECT_EQ(file.info("grad." + param.name).shape, param.shape) << param.name;
  }
  const std::vector<int64_t> tokens = {batch, config.sequence_len};
  EXPECT_EQ(file.tensor<int32_t>("input.idx").shape, tokens);
  EXPECT_EQ(file.tensor<int32_t>("input.targets").shape, tokens);
  EXPECT_EQ(file.info("output.logits").shape,
            (std::vector<int64_t>{batch, config.sequence_len, config.vocab_size}));
  EXPECT_EQ(file.tensor<float>("output.loss").shape, std::vector<int64_t>{1});
  EXPECT_EQ(file.names().size(), 2 * params.size() + 4);
}

}  // namespace
}  // namespace fp8t::io
