#include "io/files.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::io {
namespace {

// CRC-32's check value: the CRC of the ASCII digits "123456789" is 0xCBF43926.
TEST(FileDigest, MatchesTheCrc32CheckValue) {
  const FileDigest digest = digest_of(std::string_view("123456789"));
  EXPECT_EQ(digest.bytes, 9u);
  EXPECT_EQ(digest.crc32, 0xCBF43926u);
  EXPECT_EQ(digest_of(std::string_view()).crc32, 0u);
}

// What an atomic write returns is the digest of the file it leaves, pieces or not; a file that
// is not there has none.
TEST(FileDigest, AWriteReturnsTheDigestOfTheFileItLeaves) {
  const test::TempFolder folder;
  std::vector<std::byte> big(size_t{9} << 20);  // longer than one read piece
  for (size_t i = 0; i < big.size(); ++i)
    big[i] = static_cast<std::byte>(i * 131 + i / 4099);
  const std::string head = "header";
  const std::vector<std::span<const std::byte>> pieces = {
      std::as_bytes(std::span(head.data(), head.size())), std::span(big)};
  const FileDigest written = write_file_atomically(folder / "data.bin", pieces);
  EXPECT_EQ(written.bytes, head.size() + big.size());
  const std::optional<FileDigest> read = file_digest(folder / "data.bin");
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->bytes, written.bytes);
  EXPECT_EQ(read->crc32, written.crc32);
  EXPECT_EQ(digest_of(pieces).crc32, written.crc32);
  const FileDigest text = write_file_atomically(folder / "text.txt", "123456789");
  EXPECT_EQ(text.crc32, 0xCBF43926u);
  EXPECT_FALSE(file_digest(folder / "absent.bin").has_value());
}

// Two folders swap names in one step (where the file system cannot, nothing changes); a path
// that does not exist is an error naming both.
TEST(ExchangePaths, SwapsTwoFolders) {
  const test::TempFolder folder;
  std::filesystem::create_directories(folder / "old");
  std::filesystem::create_directories(folder / "new");
  write_file_atomically(folder / "old" / "which", std::string_view("old"));
  write_file_atomically(folder / "new" / "which", std::string_view("new"));
  if (exchange_paths(folder / "new", folder / "old")) {
    EXPECT_EQ(read_file(folder / "old" / "which"), "new");
    EXPECT_EQ(read_file(folder / "new" / "which"), "old");
  } else {
    EXPECT_EQ(read_file(folder / "old" / "which"), "old");
  }
  EXPECT_THROW(exchange_paths(folder / "none", folder / "old"), Error);
}

}  // namespace
}  // namespace fp8t::io
