#include "io/files.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <zlib.h>

#include "core/error.h"

namespace fp8t::io {

namespace {

bool write_all(int fd, const std::byte* data, size_t size) {
  while (size > 0) {
    const ssize_t written = ::write(fd, data, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += written;
    size -= static_cast<size_t>(written);
  }
  return true;
}

// The CRC-32 continued over `size` more bytes.
uint32_t crc32_update(uint32_t crc, const void* data, size_t size) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), size));
}

}  // namespace

FileDigest digest_of(std::span<const std::span<const std::byte>> pieces) {
  FileDigest digest;
  for (const std::span<const std::byte> piece : pieces) {
    digest.crc32 = crc32_update(digest.crc32, piece.data(), piece.size());
    digest.bytes += piece.size();
  }
  return digest;
}

FileDigest digest_of(std::string_view text) {
  const std::span<const std::byte> piece = std::as_bytes(std::span(text.data(), text.size()));
  return digest_of(std::span(&piece, 1));
}

std::optional<FileDigest> file_digest(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return std::nullopt;
  std::vector<char> piece(size_t{4} << 20);
  FileDigest digest;
  while (file) {
    file.read(piece.data(), static_cast<std::streamsize>(piece.size()));
    const auto count = static_cast<size_t>(file.gcount());
    digest.crc32 = crc32_update(digest.crc32, piece.data(), count);
    digest.bytes += count;
  }
  if (file.bad()) return std::nullopt;
  return digest;
}

std::string read_file(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw Error(fmt::format("{}: no such file", path.string()));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  if (!in) throw Error(fmt::format("{}: cannot read", path.string()));
  return std::move(contents).str();
}

FileDigest write_file_atomically(const std::filesystem::path& path,
                                 std::span<const std::span<const std::byte>> pieces) {
  // The temporary file sits in the destination's folder so the rename cannot cross file
  // systems.
  const std::filesystem::path folder =
      path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  std::string name = path.filename().string();
  name.insert(0, 1, '.');
  name.append(".XXXXXX");
  std::string temporary = (folder / name).string();
  const int fd = ::mkstemp(temporary.data());
  if (fd < 0) {
    throw Error(fmt::format("{}: cannot create a temporary file in {}: {}", path.string(),
                            folder.string(), std::strerror(errno)));
  }
  int error = 0;
  bool written = true;
  for (const std::span<const std::byte> piece : pieces) {
    written = written && write_all(fd, piece.data(), piece.size());
  }
  const FileDigest digest = digest_of(pieces);
  if (!written || ::fchmod(fd, 0644) != 0 || ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error == 0 && std::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error != 0) {
    ::unlink(temporary.c_str());
    throw Error(fmt::format("{}: cannot write: {}", path.string(), std::strerror(error)));
  }
  sync_folder(folder);
  return digest;
}

FileDigest write_file_atomically(const std::filesystem::path& path, std::string_view text) {
  const std::span<const std::byte> piece = std::as_bytes(std::span(text.data(), text.size()));
  return write_file_atomically(path, std::span(&piece, 1));
}

void sync_folder(const std::filesystem::path& folder) {
  const int folder_fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY);
  if (folder_fd >= 0) {
    ::fsync(folder_fd);
    ::close(folder_fd);
  }
}

bool exchange_paths(const std::filesystem::path& first, const std::filesystem::path& second) {
  if (::renameat2(AT_FDCWD, first.c_str(), AT_FDCWD, second.c_str(), RENAME_EXCHANGE) == 0) {
    return true;
  }
  const int error = errno;
  if (error == EINVAL || error == ENOSYS || error == EOPNOTSUPP) return false;
  throw Error(fmt::format("cannot exchange {} and {}: {}", first.string(), second.string(),
                          std::strerror(error)));
}

}  // namespace fp8t::io
