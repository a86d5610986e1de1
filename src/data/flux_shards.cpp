#include "data/flux_shards.h"

#include <glob.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "numerics/float_bits.h"

namespace fp8t::data {

namespace {

constexpr std::string_view kTensorNames[] = {"latent", "latent_mean", "latent_logvar",
                                             "t5",     "t5_mask",     "clip"};

bool is_float_dtype(io::DType dtype) {
  return dtype == io::DType::F32 || dtype == io::DType::BF16;
}

std::string shape_text(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// A metadata number: the whole value must parse and be finite.
std::optional<double> metadata_number(const io::SafetensorsFile& file, const std::string& key) {
  const auto found = file.metadata().find(key);
  if (found == file.metadata().end()) return std::nullopt;
  const std::string& text = found->second;
  double value = 0.0;
  const auto [stop, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || stop != text.data() + text.size() || !std::isfinite(value)) {
    throw Error(fmt::format("{}: metadata '{}': expected a finite decimal number, found '{}'",
                            file.path().string(), key, text));
  }
  return value;
}

// Reads `count` elements of a tensor starting at element `first`, as bytes.
void read_elements(std::ifstream& in, const std::filesystem::path& path, const std::string& name,
                   const io::TensorInfo& info, uint64_t data_start, int64_t first, int64_t count,
                   std::vector<std::byte>& bytes) {
  const size_t width = io::dtype_size(info.dtype);
  bytes.resize(static_cast<size_t>(count) * width);
  const uint64_t offset = data_start + info.begin + static_cast<uint64_t>(first) * width;
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!in || static_cast<size_t>(in.gcount()) != bytes.size()) {
    throw Error(
        fmt::format("{}: tensor '{}': cannot read {} bytes at offset {} (was the file "
                    "changed after it was opened?)",
                    path.string(), name, bytes.size(), offset));
  }
}

void to_floats(std::span<const std::byte> bytes, io::DType dtype, std::vector<float>& out) {
  if (dtype == io::DType::F32) {
    out.resize(bytes.size() / sizeof(float));
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return;
  }
  out.resize(bytes.size() / sizeof(bf16));
  for (size_t i = 0; i < out.size(); ++i) {
    bf16 value;
    std::memcpy(&value, bytes.data() + i * sizeof(bf16), sizeof(bf16));
    out[i] = bf16_to_float(value);
  }
}

}  // namespace

std::string_view flux_latent_mode_name(FluxLatentMode mode) {
  return mode == FluxLatentMode::Latent ? "latent" : "mean+logvar";
}

FluxShard::FluxShard(std::filesystem::path path) : file_(std::move(path)) {
  const std::string where = file_.path().string();
  const auto fail = [&](const std::string& message) {
    throw Error(fmt::format("{}: {}", where, message));
  };

  // Metadata first: a safetensors file of something else fails here, with the reason.
  const auto& metadata = file_.metadata();
  const auto format = metadata.find("format");
  if (format == metadata.end()) {
    fail(fmt::format("metadata 'format': missing; a Flux shard has format '{}'", kFluxShardFormat));
  }
  if (format->second != kFluxShardFormat) {
    fail(fmt::format("metadata 'format': expected '{}', found '{}'", kFluxShardFormat,
                     format->second));
  }
  const auto version = metadata.find("version");
  if (version == metadata.end() || version->second != kFluxShardVersion) {
    fail(fmt::format("metadata 'version': expected '{}', found {}", kFluxShardVersion,
                     version == metadata.end() ? "none" : fmt::format("'{}'", version->second)));
  }
  latent_scale_ = metadata_number(file_, "latent_scale");
  latent_shift_ = metadata_number(file_, "latent_shift");
  if (latent_scale_ && *latent_scale_ <= 0.0) {
    fail(fmt::format("metadata 'latent_scale': expected a number > 0, found {}", *latent_scale_));
  }
  if (const auto image_size = metadata_number(file_, "image_size");
      image_size && (*image_size < 1.0 || *image_size != std::floor(*image_size))) {
    fail(fmt::format("metadata 'image_size': expected a whole number >= 1, found {}", *image_size));
  }

  for (const std::string& name : file_.names()) {
    if (std::find(std::begin(kTensorNames), std::end(kTensorNames), name) ==
        std::end(kTensorNames)) {
      fail(fmt::format("tensor '{}': not part of the format (expected {})", name,
                       fmt::join(kTensorNames, ", ")));
    }
  }

  const bool has_latent = file_.contains("latent");
  const bool has_mean = file_.contains("latent_mean");
  const bool has_logvar = file_.contains("latent_logvar");
  if (has_latent && (has_mean || has_logvar)) {
    fail("tensor 'latent': found together with latent_mean / latent_logvar; a shard holds one");
  }
  if (!has_latent && !has_mean && !has_logvar) {
    fail("tensor 'latent': missing (a shard holds latent, or latent_mean and latent_logvar)");
  }
  if (!has_latent && has_mean != has_logvar) {
    fail(fmt::format("tensor '{}': missing (latent_mean and latent_logvar come together)",
                     has_mean ? "latent_logvar" : "latent_mean"));
  }
  layout_.mode = has_latent ? FluxLatentMode::Latent : FluxLatentMode::MeanLogvar;

  // Each tensor: present, its dtype allowed, its rank right and its first dimension N.
  const auto checked = [&](const std::string& name, size_t rank,
                           bool float_dtype) -> const io::TensorInfo& {
    if (!file_.contains(name)) fail(fmt::format("tensor '{}': missing", name));
    const io::TensorInfo& info = file_.info(name);
    const bool dtype_ok = float_dtype ? is_float_dtype(info.dtype)
                                      : info.dtype == io::DType::U8 || info.dtype == io::DType::I64;
    if (!dtype_ok) {
      fail(fmt::format("tensor '{}': expected dtype {}, found {}", name,
                       float_dtype ? "F32 or BF16" : "U8 or I64", io::dtype_name(info.dtype)));
    }
    if (info.shape.size() != rank) {
      fail(fmt::format("tensor '{}': expected {} dimensions, found shape {}", name, rank,
                       shape_text(info.shape)));
    }
    if (info.shape[0] != layout_.samples) {
      fail(fmt::format("tensor '{}': expected {} samples (the first dimension of {}), found {}",
                       name, layout_.samples,
                       layout_.mode == FluxLatentMode::Latent ? "latent" : "latent_mean",
                       info.shape[0]));
    }
    for (size_t d = 1; d < rank; ++d) {
      if (info.shape[d] < 1) {
        fail(fmt::format("tensor '{}': empty dimension in shape {}", name, shape_text(info.shape)));
      }
    }
    return info;
  };

  const std::string latent_name = has_latent ? "latent" : "latent_mean";
  if (file_.info(latent_name).shape.empty()) {
    fail(fmt::format("tensor '{}': expected 4 dimensions, found a scalar", latent_name));
  }
  layout_.samples = file_.info(latent_name).shape[0];
  if (layout_.samples < 1) fail(fmt::format("tensor '{}': no samples", latent_name));

  const io::TensorInfo& latent = checked(latent_name, 4, true);
  layout_.latent = {latent.shape[1], latent.shape[2], latent.shape[3]};
  layout_.latent_dtype = latent.dtype;
  if (layout_.latent.height % 2 != 0 || layout_.latent.width % 2 != 0) {
    fail(
        fmt::format("tensor '{}': height and width must be even (Flux packs 2×2 patches), "
                    "found shape {}",
                    latent_name, shape_text(latent.shape)));
  }
  if (!has_latent) {
    const io::TensorInfo& logvar = checked("latent_logvar", 4, true);
    if (logvar.shape != latent.shape || logvar.dtype != latent.dtype) {
      fail(fmt::format("tensor 'latent_logvar': expected {} {} as latent_mean, found {} {}",
                       io::dtype_name(latent.dtype), shape_text(latent.shape),
                       io::dtype_name(logvar.dtype), shape_text(logvar.shape)));
    }
  }

  const io::TensorInfo& t5 = checked("t5", 3, true);
  layout_.text_tokens = t5.shape[1];
  layout_.context_dim = t5.shape[2];
  layout_.t5_dtype = t5.dtype;
  layout_.has_t5_mask = file_.contains("t5_mask");
  if (layout_.has_t5_mask) {
    const io::TensorInfo& mask = checked("t5_mask", 2, false);
    if (mask.shape[1] != layout_.text_tokens) {
      fail(fmt::format("tensor 't5_mask': expected {} tokens (as t5), found shape {}",
                       layout_.text_tokens, shape_text(mask.shape)));
    }
  }
  const io::TensorInfo& clip = checked("clip", 2, true);
  layout_.pooled_dim = clip.shape[1];
  layout_.clip_dtype = clip.dtype;

  // SafetensorsFile has checked that the tensors cover the data section exactly, so it is the
  // file's last (largest end) bytes.
  uint64_t data_size = 0;
  for (const std::string& name : file_.names())
    data_size = std::max(data_size, file_.info(name).end);
  std::error_code error;
  const uint64_t file_size = std::filesystem::file_size(file_.path(), error);
  if (error) fail(fmt::format("cannot read its size: {}", error.message()));
  data_start_ = file_size - data_size;
}

void FluxShard::read_sample(int64_t index, FluxShardSample& out) const {
  if (index < 0 || index >= layout_.samples) {
    throw Error(
        fmt::format("{}: sample {} out of range [0, {})", path().string(), index, layout_.samples));
  }
  std::ifstream in(path(), std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open: {}", path().string(), std::strerror(errno)));
  std::vector<std::byte> bytes;
  const auto read_row = [&](const std::string& name) {
    const io::TensorInfo& info = file_.info(name);
    const int64_t row = info.numel() / layout_.samples;
    read_elements(in, path(), name, info, data_start_, index * row, row, bytes);
    return info.dtype;
  };
  const auto read_floats = [&](const std::string& name, std::vector<float>& destination) {
    const io::DType dtype = read_row(name);
    to_floats(bytes, dtype, destination);
  };

  if (layout_.mode == FluxLatentMode::Latent) {
    read_floats("latent", out.latent);
    out.latent_mean.clear();
    out.latent_logvar.clear();
  } else {
    out.latent.clear();
    read_floats("latent_mean", out.latent_mean);
    read_floats("latent_logvar", out.latent_logvar);
  }
  read_floats("t5", out.t5);
  read_floats("clip", out.clip);
  out.t5_mask.clear();
  if (layout_.has_t5_mask) {
    const io::DType dtype = read_row("t5_mask");
    if (dtype == io::DType::U8) {
      out.t5_mask.assign(bytes.size(), 0);
      for (size_t i = 0; i < bytes.size(); ++i)
        out.t5_mask[i] = std::to_integer<int64_t>(bytes[i]);
    } else {
      out.t5_mask.resize(bytes.size() / sizeof(int64_t));
      std::memcpy(out.t5_mask.data(), bytes.data(), bytes.size());
    }
  }
}

namespace {

// The first non-finite value of a sample's tensor, as an error message; empty when none.
std::string first_non_finite(const FluxShard& shard, const std::string& name, int64_t sample,
                             std::span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return fmt::format("{}: tensor '{}': sample {}, element {}: {} (every value must be finite)",
                         shard.path().string(), name, sample, i, values[i]);
    }
  }
  return {};
}

// The value scan: every float finite, every mask value 0 or 1.
std::string scan_values(const FluxShard& shard) {
  FluxShardSample sample;
  for (int64_t s = 0; s < shard.samples(); ++s) {
    shard.read_sample(s, sample);
    const std::pair<const char*, const std::vector<float>*> tensors[] = {
        {"latent", &sample.latent},
        {"latent_mean", &sample.latent_mean},
        {"latent_logvar", &sample.latent_logvar},
        {"t5", &sample.t5},
        {"clip", &sample.clip}};
    for (const auto& [name, values] : tensors) {
      if (std::string error = first_non_finite(shard, name, s, *values); !error.empty()) {
        return error;
      }
    }
    for (size_t i = 0; i < sample.t5_mask.size(); ++i) {
      if (sample.t5_mask[i] != 0 && sample.t5_mask[i] != 1) {
        return fmt::format("{}: tensor 't5_mask': sample {}, token {}: expected 0 or 1, found {}",
                           shard.path().string(), s, i, sample.t5_mask[i]);
      }
    }
  }
  return {};
}

// Against the model's input widths; empty when they match.
std::string model_mismatch(const FluxShard& shard, const FluxConfig& model) {
  const FluxShardLayout& layout = shard.layout();
  const std::string where = shard.path().string();
  if (layout.latent.token_dim() != model.in_channels) {
    return fmt::format(
        "{}: tensor '{}': {} latent channels pack into {} features, the model's in_channels is "
        "{} (expected {} channels)",
        where, layout.mode == FluxLatentMode::Latent ? "latent" : "latent_mean",
        layout.latent.channels, layout.latent.token_dim(), model.in_channels,
        model.in_channels / 4);
  }
  if (layout.context_dim != model.context_in_dim) {
    return fmt::format("{}: tensor 't5': expected width {} (the model's context_in_dim), found {}",
                       where, model.context_in_dim, layout.context_dim);
  }
  if (layout.pooled_dim != model.vec_in_dim) {
    return fmt::format("{}: tensor 'clip': expected width {} (the model's vec_in_dim), found {}",
                       where, model.vec_in_dim, layout.pooled_dim);
  }
  return {};
}

// Against the first shard that opened; empty when they agree.
std::string shard_mismatch(const FluxShard& shard, const FluxShard& first) {
  const FluxShardLayout& a = shard.layout();
  const FluxShardLayout& b = first.layout();
  const std::string where = shard.path().string();
  const std::string other = first.path().string();
  if (a.mode != b.mode) {
    return fmt::format("{}: stores {}, {} stores {}; all shards must store the same", where,
                       flux_latent_mode_name(a.mode), other, flux_latent_mode_name(b.mode));
  }
  const std::string latent_name = a.mode == FluxLatentMode::Latent ? "latent" : "latent_mean";
  if (a.latent.channels != b.latent.channels || a.latent.height != b.latent.height ||
      a.latent.width != b.latent.width) {
    return fmt::format("{}: tensor '{}': per-sample shape [{}, {}, {}], {} has [{}, {}, {}]", where,
                       latent_name, a.latent.channels, a.latent.height, a.latent.width, other,
                       b.latent.channels, b.latent.height, b.latent.width);
  }
  if (a.text_tokens != b.text_tokens || a.context_dim != b.context_dim) {
    return fmt::format("{}: tensor 't5': per-sample shape [{}, {}], {} has [{}, {}]", where,
                       a.text_tokens, a.context_dim, other, b.text_tokens, b.context_dim);
  }
  if (a.pooled_dim != b.pooled_dim) {
    return fmt::format("{}: tensor 'clip': width {}, {} has {}", where, a.pooled_dim, other,
                       b.pooled_dim);
  }
  // Mixed normalizations would train on differently scaled x0 without any error.
  const auto number = [](std::optional<double> value) {
    return value ? fmt::format("{}", *value) : std::string("none");
  };
  if (shard.latent_scale() != first.latent_scale() ||
      shard.latent_shift() != first.latent_shift()) {
    return fmt::format("{}: metadata latent_scale / latent_shift {} / {}, {} has {} / {}", where,
                       number(shard.latent_scale()), number(shard.latent_shift()), other,
                       number(first.latent_scale()), number(first.latent_shift()));
  }
  return {};
}

}  // namespace

FluxShardSet::FluxShardSet(std::span<const std::filesystem::path> paths, const FluxConfig& model,
                           const FluxShardSet* reference) {
  if (paths.empty()) throw Error("expected at least one Flux shard, found none");
  shards_.reserve(paths.size());
  first_sample_.push_back(0);
  for (const std::filesystem::path& path : paths) {
    FluxShard shard(path);
    std::string error = model_mismatch(shard, model);
    const FluxShard* like = reference != nullptr ? &reference->first()
                            : shards_.empty()    ? nullptr
                                                 : &shards_.front();
    if (error.empty() && like != nullptr) error = shard_mismatch(shard, *like);
    if (!error.empty()) throw Error(error);
    first_sample_.push_back(first_sample_.back() + shard.samples());
    shards_.push_back(std::move(shard));
  }
}

void FluxShardSet::read_sample(int64_t index, FluxShardSample& out) const {
  if (index < 0 || index >= samples()) {
    throw Error(fmt::format("sample {} out of range [0, {}) of {} shards", index, samples(),
                            shards_.size()));
  }
  // The last shard whose first sample is at or before index.
  const auto after = std::upper_bound(first_sample_.begin(), first_sample_.end(), index);
  const auto shard = static_cast<size_t>(after - first_sample_.begin() - 1);
  shards_[shard].read_sample(index - first_sample_[shard], out);
}

std::vector<std::filesystem::path> find_flux_shard_files(const std::string& folder_or_pattern) {
  std::vector<std::filesystem::path> paths;
  std::error_code error;
  if (std::filesystem::is_directory(folder_or_pattern, error)) {
    for (const auto& entry : std::filesystem::directory_iterator(folder_or_pattern)) {
      if (entry.is_regular_file() && entry.path().extension() == ".safetensors") {
        paths.push_back(entry.path());
      }
    }
    if (paths.empty()) {
      throw Error(fmt::format("'{}': a folder without .safetensors files", folder_or_pattern));
    }
  } else {
    glob_t matches{};
    const int status = ::glob(folder_or_pattern.c_str(), 0, nullptr, &matches);
    for (size_t i = 0; status == 0 && i < matches.gl_pathc; ++i)
      paths.emplace_back(matches.gl_pathv[i]);
    ::globfree(&matches);
    if (paths.empty()) {
      throw Error(fmt::format(
          "'{}': expected a folder of .safetensors shards, a shard file or a glob pattern "
          "(shards/train_*.safetensors), found no such file",
          folder_or_pattern));
    }
  }
  // glob(3) sorts by the locale's collation; the training order needs one that never varies.
  std::sort(paths.begin(), paths.end());
  return paths;
}

std::vector<FluxShardCheck> check_flux_shards(std::span<const std::filesystem::path> paths,
                                              const FluxConfig* model) {
  std::vector<FluxShardCheck> checks;
  std::optional<FluxShard> first;
  for (const std::filesystem::path& path : paths) {
    FluxShardCheck& check = checks.emplace_back();
    check.path = path;
    try {
      FluxShard shard(path);
      check.layout = shard.layout();
      if (model != nullptr) check.error = model_mismatch(shard, *model);
      if (check.error.empty() && first) check.error = shard_mismatch(shard, *first);
      if (check.error.empty()) check.error = scan_values(shard);
      if (!first) first.emplace(std::move(shard));
    } catch (const Error& error) {
      check.error = error.what();
    }
  }
  return checks;
}

}  // namespace fp8t::data
