// Whole-file reads, and atomic writes: a crash or a full disk mid-write leaves the previous
// file as it was.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace fp8t::io {

// The file's bytes. Throws fp8t::Error "PATH: no such file" or "PATH: cannot read".
std::string read_file(const std::filesystem::path& path);

// Writes the pieces, in order, to a temporary file beside `path`, flushes it to disk, renames
// it over `path` and syncs the folder. Throws fp8t::Error naming `path` and the system's reason
// (e.g. "No space left on device"); the temporary file is then removed and `path` untouched.
void write_file_atomically(const std::filesystem::path& path,
                           std::span<const std::span<const std::byte>> pieces);
void write_file_atomically(const std::filesystem::path& path, std::string_view text);

// fsync of a folder, so that renames and creations inside it are durable. Best effort: a
// folder that cannot be opened or synced is not an error.
void sync_folder(const std::filesystem::path& folder);

}  // namespace fp8t::io
