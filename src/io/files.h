// Whole-file reads, and atomic writes: a crash or a full disk mid-write leaves the previous
// file as it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace fp8t::io {

// The file's bytes. Throws fp8t::Error "PATH: no such file" or "PATH: cannot read".
std::string read_file(const std::filesystem::path& path);

// A file's length and CRC-32 (zlib's), as checkpoint manifests record them.
struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
// The digest of the pieces' bytes, in order.
FileDigest digest_of(std::span<const std::span<const std::byte>> pieces);
FileDigest digest_of(std::string_view text);
// The digest of a file's contents, read in pieces; nothing when it cannot be read.
std::optional<FileDigest> file_digest(const std::filesystem::path& path);

// Writes the pieces, in order, to a temporary file beside `path`, flushes it to disk, renames
// it over `path` and syncs the folder; returns the digest of what it wrote. Throws
// fp8t::Error naming `path` and the system's reason (e.g. "No space left on device"); the
// temporary file is then removed and `path` untouched.
FileDigest write_file_atomically(const std::filesystem::path& path,
                                 std::span<const std::span<const std::byte>> pieces);
FileDigest write_file_atomically(const std::filesystem::path& path, std::string_view text);

// fsync of a folder, so that renames and creations inside it are durable. Best effort: a
// folder that cannot be opened or synced is not an error.
void sync_folder(const std::filesystem::path& folder);

// Swaps two existing paths (files or folders) in one atomic step (Linux's renameat2 with
// RENAME_EXCHANGE): at every moment each name holds one of the two. False when the file system
// cannot (nothing changed then); throws fp8t::Error naming both paths for any other failure.
bool exchange_paths(const std::filesystem::path& first, const std::filesystem::path& second);

}  // namespace fp8t::io
