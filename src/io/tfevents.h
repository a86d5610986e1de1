// TensorBoard event files ("events.out.tfevents.*"): a sequence of records, each framed as
// TFRecord does (the length as 8 bytes little-endian, the masked CRC-32C of those 8 bytes, the
// data, the masked CRC-32C of the data), each holding one Event protocol buffer. Only the fields
// scalars need are written: Event.wall_time (1), Event.step (2), Event.file_version (3) and
// Event.summary (5) with Summary.Value.tag (1) and Summary.Value.simple_value (2). They are
// encoded here by hand: five fields of protobuf's wire format are shorter than a generated
// schema, and Debian packages no CRC-32C library.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fp8t::io {

// CRC-32C (Castagnoli), as TFRecord uses; crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view bytes);
// TFRecord's masked form: the CRC rotated right by 15 bits plus 0xA282EAD8.
uint32_t masked_crc32c(std::string_view bytes);

// One framed record around `data`.
std::string tfevents_record(std::string_view data);

// The Event that opens every file: the time and file_version "brain.Event:2".
std::string file_version_event(double wall_time);
// An Event at `step` whose summary holds each (tag, value) as a simple_value (a 32-bit float).
std::string scalars_event(double wall_time, int64_t step,
                          const std::vector<std::pair<std::string, float>>& values);

// Appends records to a new event file in a folder; each call is written and flushed at once,
// so a crash loses at most the record being written (which TensorBoard's reader skips).
class TfEventsWriter {
 public:
  // Creates FOLDER/events.out.tfevents.<unix seconds>.<host>.<pid>.fp8train and writes its
  // file_version record. Throws fp8t::Error naming the file when it cannot be written.
  explicit TfEventsWriter(const std::filesystem::path& folder);

  void scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write(const std::string& event);

  std::filesystem::path path_;
  std::ofstream file_;
};

}  // namespace fp8t::io
