// TensorBoard event records: CRC-32C against its published check value, the TFRecord framing,
// and the bytes of an Event against a hand encoding of protobuf's wire format. (CI also reads a
// run's event files with TensorBoard's reader: tests/train/check_tensorboard.py.)
#include "io/tfevents.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

#include "test_files.h"

namespace fp8t::io {
namespace {

uint32_t u32_at(const std::string& bytes, size_t offset) {
  uint32_t value = 0;
  std::memcpy(&value, bytes.data() + offset, sizeof value);
  return value;
}

TEST(TfEvents, Crc32cMatchesItsCheckValue) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720, B.4
  const uint32_t crc = crc32c("123456789");
  EXPECT_EQ(masked_crc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xA282EAD8u);
}

TEST(TfEvents, RecordsFrameTheirDataWithLengthAndChecksums) {
  const std::string data = "an event";
  const std::string record = tfevents_record(data);
  ASSERT_EQ(record.size(), 8 + 4 + data.size() + 4);
  uint64_t length = 0;
  std::memcpy(&length, record.data(), sizeof length);
  EXPECT_EQ(length, data.size());
  EXPECT_EQ(u32_at(record, 8), masked_crc32c(record.substr(0, 8)));
  EXPECT_EQ(record.substr(12, data.size()), data);
  EXPECT_EQ(u32_at(record, 12 + data.size()), masked_crc32c(data));
}

TEST(TfEvents, ScalarEventsEncodeTheEventFields) {
  // Event{wall_time: 0.5 (field 1, fixed64), step: 300 (field 2, varint 0xAC 0x02),
  //       summary (field 5) {value (1) {tag (1): "a", simple_value (2, fixed32): 1.0f}}}
  const std::string expected(
      "\x09\x00\x00\x00\x00\x00\x00\xe0\x3f"  // 0.5 as a little-endian double
      "\x10\xac\x02"
      "\x2a\x0a"
      "\x0a\x08"
      "\x0a\x01"
      "a"
      "\x15\x00\x00\x80\x3f",
      24);
  EXPECT_EQ(scalars_event(0.5, 300, {{"a", 1.0f}}), expected);
  const std::string version = file_version_event(0.5);
  EXPECT_EQ(version.substr(9), std::string("\x1a\x0d") + "brain.Event:2");
}

TEST(TfEvents, WriterAppendsOneFlushedRecordPerCall) {
  const test::TempFolder folder;
  TfEventsWriter writer(folder.path());
  EXPECT_EQ(writer.path().parent_path(), folder.path());
  EXPECT_NE(writer.path().filename().string().find("events.out.tfevents."), std::string::npos);
  writer.scalars(1, {{"train/loss", 2.5f}});
  writer.scalars(2, {{"train/loss", 2.25f}, {"train/lr", 0.01f}});
  std::ifstream file(writer.path(), std::ios::binary);  // readable before the writer closes
  const std::string bytes((std::istreambuf_iterator<char>(file)), {});
  size_t offset = 0;
  int records = 0;
  while (offset < bytes.size()) {
    uint64_t length = 0;
    std::memcpy(&length, bytes.data() + offset, sizeof length);
    ASSERT_LE(offset + 16 + length, bytes.size());
    EXPECT_EQ(u32_at(bytes, offset + 12 + length),
              masked_crc32c(bytes.substr(offset + 12, length)));
    offset += 16 + length;
    ++records;
  }
  EXPECT_EQ(records, 3);  // the file version, then two steps
}

}  // namespace
}  // namespace fp8t::io
