#include "train/mlflow_tracker.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <initializer_list>

#include <fmt/format.h>

#include "core/error.h"
#include "train/run_log.h"

namespace fp8t::train {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Requests of the connection at start, and each request of the sending thread.
constexpr milliseconds kRequestTimeout{10000};
// While the server is unreachable: the first retry after half a second, then doubling.
constexpr milliseconds kFirstBackoff{500};
constexpr milliseconds kMaxBackoff{30000};
// A fast trainer's values gather this long into one request instead of one request per step.
constexpr milliseconds kSendInterval{1000};

int64_t now_ms() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Busy or failing servers may recover; any other refusal would be refused again.
bool worth_retrying(long status) {
  return status == 408 || status == 429 || status >= 500;
}

nlohmann::json parsed(const io::HttpResponse& response) {
  return nlohmann::json::parse(response.body, nullptr, /*allow_exceptions=*/false);
}

// The value at `path` in a JSON answer; null when absent.
const nlohmann::json& node_at(const nlohmann::json& answer,
                              std::initializer_list<const char*> path) {
  static const nlohmann::json absent;
  const nlohmann::json* node = &answer;
  for (const char* key : path) {
    if (!node->is_object() || !node->contains(key)) return absent;
    node = &node->at(key);
  }
  return *node;
}

// The string at `path` in a JSON answer; empty when absent.
std::string text_at(const nlohmann::json& answer, std::initializer_list<const char*> path) {
  const nlohmann::json& node = node_at(answer, path);
  return node.is_string() ? node.get<std::string>() : "";
}

// "HTTP 404: RESOURCE_DOES_NOT_EXIST: Could not find ...": MLflow's error code and the first
// line of its message (the rest can be a database's statement), or the start of a body that is
// not MLflow's.
std::string describe_failure(const io::HttpResponse& response) {
  const nlohmann::json answer = parsed(response);
  std::string message = text_at(answer, {"message"});
  std::string detail = message.empty() ? response.body : message;
  detail = detail.substr(0, std::min(detail.find('\n'), size_t{300}));
  const std::string code = text_at(answer, {"error_code"});
  if (!code.empty()) return fmt::format("HTTP {}: {}: {}", response.status, code, detail);
  if (detail.empty()) return fmt::format("HTTP {}", response.status);
  return fmt::format("HTTP {}: {}", response.status, detail);
}

bool has_error_code(const io::HttpResponse& response, std::string_view code) {
  return text_at(parsed(response), {"error_code"}) == code;
}

std::string steps_text(int64_t first, int64_t last) {
  return first == last ? fmt::format("step {}", first) : fmt::format("steps {} to {}", first, last);
}

void print_to_stderr(const std::string& line) {
  fmt::print(stderr, "{}\n", line);
}

}  // namespace

std::string mlflow_endpoint(std::string_view tracking_uri, std::string_view method) {
  if (tracking_uri.empty()) {
    throw Error(
        "MLflow: no tracking URI: set MLFLOW_TRACKING_URI to the address of a tracking server "
        "(e.g. http://127.0.0.1:5000)");
  }
  const size_t separator = tracking_uri.find("://");
  std::string scheme(tracking_uri.substr(0, separator == std::string_view::npos ? 0 : separator));
  std::transform(scheme.begin(), scheme.end(), scheme.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (scheme != "http" && scheme != "https") {
    throw Error(fmt::format(
        "MLflow tracking URI '{}': only http:// and https:// tracking servers are supported; "
        "start one with `mlflow server` and set MLFLOW_TRACKING_URI to its address",
        tracking_uri));
  }
  std::string base(tracking_uri);
  while (base.ends_with('/'))
    base.pop_back();
  if (base.size() <= separator + 3) {
    throw Error(fmt::format("MLflow tracking URI '{}': no host", tracking_uri));
  }
  return fmt::format("{}/api/2.0/mlflow/{}", base, method);
}

std::string truncate_value(std::string value, size_t limit) {
  if (value.size() <= limit) return value;
  const std::string note = fmt::format(" ... (truncated from {} bytes)", value.size());
  FP8T_CHECK(limit >= note.size(), "a limit of at least {} bytes, found {}", note.size(), limit);
  size_t keep = limit - note.size();
  while (keep > 0 && (static_cast<unsigned char>(value[keep]) & 0xC0u) == 0x80u)
    --keep;
  value.resize(keep);
  return value + note;
}

nlohmann::json mlflow_metric_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

std::string log_batch_body(const std::string& run_id, const MlflowBatch& batch) {
  auto key_values = [](const KeyValues& entries) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& [key, value] : entries)
      list.push_back({{"key", key}, {"value", value}});
    return list;
  };
  nlohmann::json body = {{"run_id", run_id}};
  if (!batch.metrics.empty()) {
    nlohmann::json metrics = nlohmann::json::array();
    for (const MlflowMetric& metric : batch.metrics) {
      metrics.push_back({{"key", metric.key},
                         {"value", mlflow_metric_value(metric.value)},
                         {"timestamp", metric.timestamp_ms},
                         {"step", metric.step}});
    }
    body["metrics"] = std::move(metrics);
  }
  if (!batch.params.empty()) body["params"] = key_values(batch.params);
  if (!batch.tags.empty()) body["tags"] = key_values(batch.tags);
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

MlflowQueue::MlflowQueue(size_t metric_capacity) : metric_capacity_(metric_capacity) {
  FP8T_CHECK(metric_capacity >= 1, "room for at least one metric value, found {}", metric_capacity);
}

void MlflowQueue::add_metric(MlflowMetric metric) {
  if (metrics_.size() >= metric_capacity_) drop_oldest();
  ++queued_per_key_[metric.key];
  metrics_.push_back(std::move(metric));
}

void MlflowQueue::add_param(std::string key, std::string value) {
  params_.emplace_back(std::move(key), std::move(value));
}

void MlflowQueue::add_tag(std::string key, std::string value) {
  tags_.emplace_back(std::move(key), std::move(value));
}

void MlflowQueue::drop_oldest() {
  // A key's newest value moves to the back instead of going; after a whole turn (every value
  // its key's newest) the oldest goes anyway.
  for (size_t turned = 0; turned < metrics_.size() && queued_per_key_.at(metrics_.front().key) == 1;
       ++turned) {
    metrics_.push_back(std::move(metrics_.front()));
    metrics_.pop_front();
  }
  const MlflowMetric& oldest = metrics_.front();
  first_dropped_step_ = dropped_ == 0 ? oldest.step : std::min(first_dropped_step_, oldest.step);
  last_dropped_step_ = dropped_ == 0 ? oldest.step : std::max(last_dropped_step_, oldest.step);
  ++dropped_;
  count_out(oldest.key);
  metrics_.pop_front();
}

void MlflowQueue::count_out(const std::string& key) {
  const auto queued = queued_per_key_.find(key);
  if (--queued->second == 0) queued_per_key_.erase(queued);
}

MlflowBatch MlflowQueue::take_batch() {
  MlflowBatch batch;
  auto take = [](std::deque<std::pair<std::string, std::string>>& from, KeyValues& to) {
    while (!from.empty() && to.size() < kMlflowParamsOrTagsPerBatch) {
      to.push_back(std::move(from.front()));
      from.pop_front();
    }
  };
  if (!params_.empty()) {
    take(params_, batch.params);
  } else if (!tags_.empty()) {
    take(tags_, batch.tags);
  } else {
    while (!metrics_.empty() && batch.metrics.size() < kMlflowMetricsPerBatch) {
      count_out(metrics_.front().key);
      batch.metrics.push_back(std::move(metrics_.front()));
      metrics_.pop_front();
    }
  }
  return batch;
}

void MlflowQueue::put_back(MlflowBatch batch) {
  for (auto metric = batch.metrics.rbegin(); metric != batch.metrics.rend(); ++metric) {
    ++queued_per_key_[metric->key];
    metrics_.push_front(std::move(*metric));
  }
  for (auto param = batch.params.rbegin(); param != batch.params.rend(); ++param) {
    params_.push_front(std::move(*param));
  }
  for (auto tag = batch.tags.rbegin(); tag != batch.tags.rend(); ++tag) {
    tags_.push_front(std::move(*tag));
  }
}

std::string_view mlflow_status_name(MlflowRunStatus status) {
  switch (status) {
    case MlflowRunStatus::Finished:
      return "FINISHED";
    case MlflowRunStatus::Failed:
      return "FAILED";
    case MlflowRunStatus::Killed:
      return "KILLED";
  }
  return "KILLED";
}

MlflowTracker::MlflowTracker(MlflowSettings settings)
    : settings_(std::move(settings)),
      api_(mlflow_endpoint(settings_.tracking_uri, "")),
      warning_(print_to_stderr) {
  if (settings_.resume_run_id.empty()) {
    connect_new_run();
  } else {
    connect_resumed_run();
  }
  sender_ = std::thread([this] { send_loop(); });
}

MlflowTracker::~MlflowTracker() {
  if (!sender_.joinable()) return;  // finished
  // A destructor must not throw: whatever goes wrong here, the values were logged as far as
  // they could be, and the caller is already leaving.
  try {
    for (const std::string& line : finish(MlflowRunStatus::Killed, std::chrono::seconds(10))) {
      warning_(line);
    }
  } catch (...) {
  }
}

io::HttpResponse MlflowTracker::request_at_start(std::string_view method, const std::string* query,
                                                 const nlohmann::json* body) {
  const std::string url = api_ + std::string(method) + (query != nullptr ? "?" + *query : "");
  try {
    return body != nullptr ? http_.post_json(url, body->dump(), kRequestTimeout)
                           : http_.get(url, kRequestTimeout);
  } catch (const Error& error) {
    throw Error(
        fmt::format("MLflow tracking server {} cannot be reached: {}; start it, or point "
                    "MLFLOW_TRACKING_URI at the one to use",
                    settings_.tracking_uri, error.what()));
  }
}

Error MlflowTracker::failure_at_start(std::string_view what,
                                      const io::HttpResponse& response) const {
  return Error(fmt::format("MLflow tracking server {}: {}: {}", settings_.tracking_uri, what,
                           describe_failure(response)));
}

void MlflowTracker::connect_new_run() {
  // MLflow's own name for the experiment of runs that name none.
  const std::string name = settings_.experiment.empty() ? "Default" : settings_.experiment;
  const std::string query = "experiment_name=" + http_.escape(name);
  io::HttpResponse found = request_at_start("experiments/get-by-name", &query, nullptr);
  if (found.status == 404 && has_error_code(found, "RESOURCE_DOES_NOT_EXIST")) {
    const nlohmann::json create = {{"name", name}};
    const io::HttpResponse created = request_at_start("experiments/create", nullptr, &create);
    if (created.status == 200) {
      experiment_id_ = text_at(parsed(created), {"experiment_id"});
    } else if (has_error_code(created, "RESOURCE_ALREADY_EXISTS")) {
      // Another run created it meanwhile.
      found = request_at_start("experiments/get-by-name", &query, nullptr);
    } else {
      throw failure_at_start(fmt::format("cannot create the experiment '{}'", name), created);
    }
  }
  if (experiment_id_.empty()) {
    if (found.status != 200) {
      throw failure_at_start(fmt::format("cannot look up the experiment '{}'", name), found);
    }
    const nlohmann::json answer = parsed(found);
    if (text_at(answer, {"experiment", "lifecycle_stage"}) == "deleted") {
      throw Error(fmt::format(
          "MLflow tracking server {}: the experiment '{}' is deleted; restore it (mlflow "
          "experiments restore) or name another one",
          settings_.tracking_uri, name));
    }
    experiment_id_ = text_at(answer, {"experiment", "experiment_id"});
  }
  if (experiment_id_.empty()) {
    throw Error(fmt::format("MLflow tracking server {}: no experiment id in its answer for '{}'",
                            settings_.tracking_uri, name));
  }

  nlohmann::json create = {{"experiment_id", experiment_id_}, {"start_time", now_ms()}};
  if (!settings_.run_name.empty()) create["run_name"] = settings_.run_name;
  const io::HttpResponse created = request_at_start("runs/create", nullptr, &create);
  if (created.status != 200) {
    throw failure_at_start(fmt::format("cannot create a run in the experiment '{}'", name),
                           created);
  }
  run_id_ = text_at(parsed(created), {"run", "info", "run_id"});
  if (run_id_.empty()) {
    throw Error(fmt::format("MLflow tracking server {}: no run id in its answer to runs/create",
                            settings_.tracking_uri));
  }
}

void MlflowTracker::connect_resumed_run() {
  const std::string& id = settings_.resume_run_id;
  const std::string query = "run_id=" + http_.escape(id);
  const io::HttpResponse found = request_at_start("runs/get", &query, nullptr);
  if (found.status != 200) {
    throw failure_at_start(fmt::format("cannot continue the run {}", id), found);
  }
  const nlohmann::json answer = parsed(found);
  if (text_at(answer, {"run", "info", "lifecycle_stage"}) == "deleted") {
    throw Error(fmt::format(
        "MLflow tracking server {}: the run {} is deleted; restore it (mlflow runs restore) to "
        "continue it",
        settings_.tracking_uri, id));
  }
  experiment_id_ = text_at(answer, {"run", "info", "experiment_id"});
  for (const nlohmann::json& param : node_at(answer, {"run", "data", "params"})) {
    logged_params_[text_at(param, {"key"})] = text_at(param, {"value"});
  }
  const nlohmann::json update = {{"run_id", id}, {"status", "RUNNING"}};
  const io::HttpResponse updated = request_at_start("runs/update", nullptr, &update);
  if (updated.status != 200) {
    throw failure_at_start(fmt::format("cannot set the run {} running again", id), updated);
  }
  run_id_ = id;
}

void MlflowTracker::set_warning_callback(Warning warning) {
  const std::lock_guard lock(mutex_);
  warning_ = std::move(warning);
}

void MlflowTracker::log_params(const KeyValues& params) {
  std::vector<std::string> changed;
  Warning warning;
  {
    const std::lock_guard lock(mutex_);
    FP8T_CHECK(!finishing_, "params logged after finish()");
    for (const auto& [key, value] : params) {
      std::string sent = truncate_value(value, kMlflowParamValueLength);
      const auto logged = logged_params_.find(key);
      if (logged == logged_params_.end()) {
        queue_.add_param(key, std::move(sent));
      } else if (logged->second != sent) {
        changed.push_back(fmt::format("{} ({} -> {})", key, logged->second, sent));
      }
    }
    warning = warning_;
  }
  wake_.notify_one();
  if (!changed.empty()) {
    warning(fmt::format("MLflow: the run keeps the params of its first start; changed since: {}",
                        fmt::join(changed, ", ")));
  }
}

void MlflowTracker::set_tags(const KeyValues& tags) {
  {
    const std::lock_guard lock(mutex_);
    FP8T_CHECK(!finishing_, "tags set after finish()");
    for (const auto& [key, value] : tags) {
      queue_.add_tag(key, truncate_value(value, kMlflowTagValueLength));
    }
  }
  wake_.notify_one();
}

void MlflowTracker::log_metrics(int64_t step,
                                const std::vector<std::pair<std::string, double>>& values) {
  const int64_t timestamp = now_ms();
  Warning warning;
  {
    const std::lock_guard lock(mutex_);
    FP8T_CHECK(!finishing_, "metrics logged after finish()");
    for (const auto& [key, value] : values)
      queue_.add_metric(MlflowMetric{key, value, timestamp, step});
    last_step_ = step;
    if (queue_.dropped() > 0 && !dropping_told_) {
      dropping_told_ = true;
      warning = warning_;
    }
  }
  wake_.notify_one();
  if (warning) {
    warning(fmt::format(
        "MLflow: {} metric values wait for {}; from step {} on, the oldest are dropped (the "
        "last value of each metric is kept)",
        kMlflowQueuedMetrics, settings_.tracking_uri, step));
  }
}

std::vector<std::string> MlflowTracker::finish(MlflowRunStatus status,
                                               std::chrono::seconds deadline) {
  {
    const std::lock_guard lock(mutex_);
    FP8T_CHECK(!finishing_, "finish() called twice");
    finishing_ = true;
    retry_now_ = true;
    final_status_ = status;
    end_time_ms_ = now_ms();
    finish_deadline_ = Clock::now() + deadline;
  }
  wake_.notify_all();
  sender_.join();
  const std::lock_guard lock(mutex_);
  return undelivered_report();
}

void MlflowTracker::warn(std::unique_lock<std::mutex>& lock, const std::string& message) {
  const Warning warning = warning_;
  lock.unlock();
  warning(message);
  lock.lock();
}

void MlflowTracker::send_loop() {
  milliseconds backoff = kFirstBackoff;
  Clock::time_point last_request;
  MlflowBatch batch;  // taken from the queue and not delivered yet
  bool have_request = false;
  std::unique_lock lock(mutex_);
  for (;;) {
    if (!have_request) {
      wake_.wait(lock, [&] { return finishing_ || !queue_.empty(); });
      if (!finishing_ && queue_.params().empty() && queue_.tags().empty()) {
        wake_.wait_until(lock, last_request + kSendInterval, [&] {
          return finishing_ || queue_.metrics().size() >= kMlflowMetricsPerBatch;
        });
      }
      batch = queue_.take_batch();
      // An empty batch while finishing stands for the run's final status.
      have_request = !batch.empty() || (finishing_ && !status_done_);
      if (!have_request) break;
    }
    const Clock::time_point now = Clock::now();
    milliseconds timeout = kRequestTimeout;
    if (finishing_) {
      if (now >= finish_deadline_) break;
      timeout = std::min(timeout, std::chrono::ceil<milliseconds>(finish_deadline_ - now));
    }
    last_request = now;
    lock.unlock();
    std::string reason;
    const Outcome outcome = send(batch, timeout, reason);
    lock.lock();

    if (outcome == Outcome::Unreachable) {
      last_failure_ = reason;
      if (!unreachable_) {
        unreachable_ = true;
        unreachable_since_ = Clock::now();
        // The values of the failed batch are the oldest that wait.
        const int64_t step = batch.metrics.empty() ? last_step_ : batch.metrics.front().step;
        warn(lock, fmt::format("MLflow: cannot deliver to {} from {} on ({}); training goes on, "
                               "and the values are sent when the server answers again",
                               settings_.tracking_uri,
                               step < 0 ? std::string("the start") : fmt::format("step {}", step),
                               reason));
      }
      Clock::time_point retry_at = Clock::now() + backoff;
      backoff = std::min(2 * backoff, kMaxBackoff);
      if (finishing_) retry_at = std::min(retry_at, finish_deadline_);
      wake_.wait_until(lock, retry_at, [&] { return retry_now_; });
      if (retry_now_) {
        retry_now_ = false;
        backoff = kFirstBackoff;
      }
      continue;
    }

    backoff = kFirstBackoff;
    last_failure_.clear();
    if (unreachable_) {
      unreachable_ = false;
      warn(lock,
           fmt::format(
               "MLflow: {} answers again after {}; sending what waited", settings_.tracking_uri,
               format_duration(
                   std::chrono::duration<double>(Clock::now() - unreachable_since_).count())));
    }
    if (batch.empty()) {
      status_done_ = true;
      status_recorded_ = outcome == Outcome::Delivered;
      if (!status_recorded_ && first_rejection_.empty()) first_rejection_ = reason;
    } else if (outcome == Outcome::Rejected) {
      rejected_metrics_ += batch.metrics.size();
      rejected_params_ += batch.params.size();
      rejected_tags_ += batch.tags.size();
      if (first_rejection_.empty()) {
        first_rejection_ = reason;
        warn(lock, fmt::format("MLflow: {} refused a batch ({}); the run goes on without it",
                               settings_.tracking_uri, reason));
      }
    }
    batch = MlflowBatch();
    have_request = false;
  }
  queue_.put_back(std::move(batch));
}

MlflowTracker::Outcome MlflowTracker::send(const MlflowBatch& batch, milliseconds timeout,
                                           std::string& reason) {
  std::string method;
  std::string body;
  if (batch.empty()) {
    method = "runs/update";
    body = nlohmann::json{{"run_id", run_id_},
                          {"status", std::string(mlflow_status_name(final_status_))},
                          {"end_time", end_time_ms_}}
               .dump();
  } else {
    method = "runs/log-batch";
    body = log_batch_body(run_id_, batch);
  }
  try {
    const io::HttpResponse response = http_.post_json(api_ + method, body, timeout);
    if (response.status == 200) return Outcome::Delivered;
    reason = describe_failure(response);
    return worth_retrying(response.status) ? Outcome::Unreachable : Outcome::Rejected;
  } catch (const Error& error) {
    reason = error.what();
    return Outcome::Unreachable;
  }
}

std::vector<std::string> MlflowTracker::undelivered_report() const {
  std::vector<std::string> lines;
  std::vector<std::string> unsent;
  const std::deque<MlflowMetric>& metrics = queue_.metrics();
  if (!metrics.empty()) {
    const auto [first, last] = std::minmax_element(
        metrics.begin(), metrics.end(),
        [](const MlflowMetric& a, const MlflowMetric& b) { return a.step < b.step; });
    unsent.push_back(
        fmt::format("{} metric values ({})", metrics.size(), steps_text(first->step, last->step)));
  }
  if (!queue_.params().empty()) unsent.push_back(fmt::format("{} params", queue_.params().size()));
  if (!queue_.tags().empty()) unsent.push_back(fmt::format("{} tags", queue_.tags().size()));
  if (!status_done_) {
    unsent.push_back(fmt::format("the run's status {}", mlflow_status_name(final_status_)));
  }
  if (!unsent.empty()) {
    lines.push_back(fmt::format(
        "MLflow: not delivered to {}: {} ({})", settings_.tracking_uri, fmt::join(unsent, ", "),
        last_failure_.empty() ? "the deadline passed" : "last failure: " + last_failure_));
  }
  if (queue_.dropped() > 0) {
    lines.push_back(fmt::format(
        "MLflow: {} metric values of {} were dropped while the queue was full", queue_.dropped(),
        steps_text(queue_.first_dropped_step(), queue_.last_dropped_step())));
  }
  std::vector<std::string> refused;
  if (rejected_metrics_ > 0) refused.push_back(fmt::format("{} metric values", rejected_metrics_));
  if (rejected_params_ > 0) refused.push_back(fmt::format("{} params", rejected_params_));
  if (rejected_tags_ > 0) refused.push_back(fmt::format("{} tags", rejected_tags_));
  if (status_done_ && !status_recorded_) {
    refused.push_back(fmt::format("the run's status {}", mlflow_status_name(final_status_)));
  }
  if (!refused.empty()) {
    lines.push_back(fmt::format("MLflow: {} refused {} ({})", settings_.tracking_uri,
                                fmt::join(refused, ", "), first_rejection_));
  }
  return lines;
}

}  // namespace fp8t::train
