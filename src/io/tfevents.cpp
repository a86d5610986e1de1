#include "io/tfevents.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::io {
namespace {

// The reflected Castagnoli polynomial.
constexpr uint32_t kCastagnoli = 0x82F63B78u;

constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit)
      crc = (crc >> 1) ^ ((crc & 1u) != 0 ? kCastagnoli : 0u);
    table[byte] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = crc32c_table();

// Protobuf's wire format: a key is (field number << 3) | wire type.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void put_key(std::string& out, uint32_t field, WireType type) {
  put_varint(out, (uint64_t{field} << 3) | type);
}

template <typename T>
void put_little_endian(std::string& out, T value) {
  static_assert(std::endian::native == std::endian::little, "event files are little-endian");
  char bytes[sizeof value];
  std::memcpy(bytes, &value, sizeof value);
  out.append(bytes, sizeof value);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event.wall_time (1, double) and Event.step (2, int64).
std::string event_head(double wall_time, int64_t step) {
  std::string event;
  put_key(event, 1, kFixed64);
  put_little_endian(event, wall_time);
  put_key(event, 2, kVarint);
  put_varint(event, static_cast<uint64_t>(step));
  return event;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : bytes)
    crc = (crc >> 8) ^ kCrc32cTable[(crc ^ static_cast<uint8_t>(c)) & 0xFFu];
  return ~crc;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

std::string tfevents_record(std::string_view data) {
  std::string length;
  put_little_endian(length, static_cast<uint64_t>(data.size()));
  std::string record = length;
  put_little_endian(record, masked_crc32c(length));
  record.append(data);
  put_little_endian(record, masked_crc32c(data));
  return record;
}

std::string file_version_event(double wall_time) {
  std::string event;
  put_key(event, 1, kFixed64);
  put_little_endian(event, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

std::string scalars_event(double wall_time, int64_t step,
                          const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string entry;  // Summary.Value
    put_bytes(entry, 1, tag);
    put_key(entry, 2, kFixed32);
    put_little_endian(entry, value);
    put_bytes(summary, 1, entry);  // Summary.value, repeated
  }
  std::string event = event_head(wall_time, step);
  put_bytes(event, 5, summary);
  return event;
}

TfEventsWriter::TfEventsWriter(const std::filesystem::path& folder) {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const double now = now_seconds();
  path_ = folder / fmt::format("events.out.tfevents.{}.{}.{}.fp8train", static_cast<int64_t>(now),
                               host, ::getpid());
  file_.open(path_, std::ios::binary | std::ios::app);
  if (!file_) throw Error(fmt::format("{}: cannot open for writing", path_.string()));
  write(file_version_event(now));
}

void TfEventsWriter::scalars(int64_t step,
                             const std::vector<std::pair<std::string, float>>& values) {
  write(scalars_event(now_seconds(), step, values));
}

void TfEventsWriter::write(const std::string& event) {
  file_ << tfevents_record(event) << std::flush;
  if (!file_) throw Error(fmt::format("{}: cannot write", path_.string()));
}

}  // namespace fp8t::io
