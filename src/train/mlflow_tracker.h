// An MLflow run, logged through a tracking server's REST API (the /api/2.0/mlflow/ paths, which
// MLflow 2 and 3 serve): the experiment found or created, the run created (or a resumed run
// continued), params, tags and metrics sent in runs/log-batch requests, and the run's status at
// the end. Training must not wait for the server: values go into a bounded queue that a thread
// of the tracker sends from, retrying with backoff while the server is unreachable, and what
// never arrives is reported at the end.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/http_client.h"

namespace fp8t::train {

// MLflow's limits on one runs/log-batch request and on values (mlflow/utils/validation.py).
// Tags: the 5000 characters of MLflow 2's servers (MLflow 3 takes 8000).
inline constexpr size_t kMlflowMetricsPerBatch = 1000;
inline constexpr size_t kMlflowParamsOrTagsPerBatch = 100;
inline constexpr size_t kMlflowParamValueLength = 6000;
inline constexpr size_t kMlflowTagValueLength = 5000;
// Metric values the queue holds while the server is unreachable (a few MB).
inline constexpr size_t kMlflowQueuedMetrics = 100000;

using KeyValues = std::vector<std::pair<std::string, std::string>>;

struct MlflowMetric {
  std::string key;
  double value = 0.0;
  int64_t timestamp_ms = 0;  // Unix time
  int64_t step = 0;
};

// The endpoint of `method` ("runs/log-batch") on the server at `tracking_uri`: the URI without
// trailing slashes, then "/api/2.0/mlflow/", then the method. Throws fp8t::Error when the URI
// is empty or not an http:// or https:// address (file stores, "databricks", ...).
std::string mlflow_endpoint(std::string_view tracking_uri, std::string_view method);

// `value` when it has at most `limit` bytes; else cut at a character boundary and ended with
// " ... (truncated from N bytes)", `limit` bytes at most in all.
std::string truncate_value(std::string value, size_t limit);

// A metric value in the REST API's JSON: a number, or "NaN", "Infinity", "-Infinity" (protobuf's
// JSON spelling of the values JSON has no number for; MLflow stores infinities as ±DBL_MAX).
nlohmann::json mlflow_metric_value(double value);

// One runs/log-batch request's entries: of one kind only, which keeps a full batch of the
// longest values well under MLflow's 1 MB per request.
struct MlflowBatch {
  std::vector<MlflowMetric> metrics;
  KeyValues params;
  KeyValues tags;

  bool empty() const { return metrics.empty() && params.empty() && tags.empty(); }
};

// The JSON body of runs/log-batch for `batch` (invalid UTF-8 becomes U+FFFD).
std::string log_batch_body(const std::string& run_id, const MlflowBatch& batch);

// What waits to be sent, in order. Metric values are bounded: one more than `metric_capacity`
// drops the oldest, unless that is its key's newest queued value (the next oldest goes
// instead), so that each metric's last value survives any outage. Params and tags, logged once
// per run, are not bounded.
class MlflowQueue {
 public:
  explicit MlflowQueue(size_t metric_capacity = kMlflowQueuedMetrics);

  void add_metric(MlflowMetric metric);
  void add_param(std::string key, std::string value);
  void add_tag(std::string key, std::string value);
  // The next request's entries, taken out of the queue: params first, then tags, then metrics,
  // within MLflow's limits. Empty when nothing waits.
  MlflowBatch take_batch();
  // A batch that could not be sent goes back to the front, in its order.
  void put_back(MlflowBatch batch);

  bool empty() const { return metrics_.empty() && params_.empty() && tags_.empty(); }
  const std::deque<MlflowMetric>& metrics() const { return metrics_; }
  const std::deque<std::pair<std::string, std::string>>& params() const { return params_; }
  const std::deque<std::pair<std::string, std::string>>& tags() const { return tags_; }
  // The metric values dropped when full, and the steps of the first and last of them.
  size_t dropped() const { return dropped_; }
  int64_t first_dropped_step() const { return first_dropped_step_; }
  int64_t last_dropped_step() const { return last_dropped_step_; }

 private:
  void drop_oldest();
  void count_out(const std::string& key);

  size_t metric_capacity_;
  std::deque<MlflowMetric> metrics_;
  std::unordered_map<std::string, size_t> queued_per_key_;
  std::deque<std::pair<std::string, std::string>> params_;
  std::deque<std::pair<std::string, std::string>> tags_;
  size_t dropped_ = 0;
  int64_t first_dropped_step_ = 0;
  int64_t last_dropped_step_ = 0;
};

struct MlflowSettings {
  std::string tracking_uri;   // http(s)://host:port of a tracking server (MLFLOW_TRACKING_URI)
  std::string experiment;     // found by name, or created; empty: MLflow's "Default"
  std::string run_name;       // empty: MLflow picks one
  std::string resume_run_id;  // empty: a new run; else this run continues (its experiment)
};

enum class MlflowRunStatus : uint8_t { Finished, Failed, Killed };

// "FINISHED", "FAILED", "KILLED": MLflow's names.
std::string_view mlflow_status_name(MlflowRunStatus status);

class MlflowTracker {
 public:
  // A line for the run's log, once per change: "MLflow: cannot deliver to URI from step 12 on
  // (REASON); training goes on, ...", "MLflow: URI answers again after 1m05s; ...", the first
  // batch the server refused, the queue full (values dropped from now on), a resumed run's
  // changed params. Called from the tracker's thread, and from the caller of log_params or
  // log_metrics: it must be safe to call from any thread.
  using Warning = std::function<void(const std::string&)>;

  // Connects before training starts, waiting 10 s at most per request: finds the experiment by
  // name or creates it, then creates the run (its start time now); with resume_run_id, checks
  // that the run exists and is not deleted, and sets it RUNNING again. Throws fp8t::Error naming
  // the URI and what failed (a URI that is not http(s), no answer, or the HTTP status and
  // MLflow's message): an unusable server stops a run before its first step.
  explicit MlflowTracker(MlflowSettings settings);
  // Without finish(): finish(Killed) with a 10 s deadline, its lines sent to the warning
  // callback; nothing is thrown.
  ~MlflowTracker();
  MlflowTracker(const MlflowTracker&) = delete;
  MlflowTracker& operator=(const MlflowTracker&) = delete;

  const std::string& run_id() const { return run_id_; }
  const std::string& experiment_id() const { return experiment_id_; }

  // Default: each line to stderr.
  void set_warning_callback(Warning warning);

  // The calls below queue their values and return: the caller waits for a mutex at most.
  // Values are truncated to MLflow's limits (saying so in the value). MLflow never changes a
  // logged param: on a resumed run, params it holds with the same value are skipped, and those
  // whose value changed are left as they were, named in one warning.
  void log_params(const KeyValues& params);
  void set_tags(const KeyValues& tags);
  // The values of `step`, stamped with the current time. A NaN or infinite value is sent as
  // MLflow's JSON spells it (see mlflow_metric_value).
  void log_metrics(int64_t step, const std::vector<std::pair<std::string, double>>& values);

  // Sends what is queued, retrying until `deadline` from now, then records the run's status and
  // end time, and stops the thread (after the deadline, plus at most the time limit of a
  // request already under way). Returns lines for the run's log saying what did not arrive:
  // values still queued (counts and steps), dropped or rejected ones, a status not recorded;
  // nothing when everything did. Call it once.
  std::vector<std::string> finish(MlflowRunStatus status,
                                  std::chrono::seconds deadline = std::chrono::seconds(30));

 private:
  enum class Outcome : uint8_t { Delivered, Rejected, Unreachable };

  // A request of the connection at start (a POST when `body` is given): its answer, whatever
  // the status; fp8t::Error naming the server when there is none.
  io::HttpResponse request_at_start(std::string_view method, const std::string* query,
                                    const nlohmann::json* body);
  Error failure_at_start(std::string_view what, const io::HttpResponse& response) const;
  void connect_new_run();
  void connect_resumed_run();
  void send_loop();
  // Sends the batch, or with an empty batch the final status; `reason` is set unless delivered.
  Outcome send(const MlflowBatch& batch, std::chrono::milliseconds timeout, std::string& reason);
  void warn(std::unique_lock<std::mutex>& lock, const std::string& message);
  std::vector<std::string> undelivered_report() const;

  MlflowSettings settings_;
  std::string api_;      // ".../api/2.0/mlflow/", to which a method's path is appended
  io::HttpClient http_;  // the constructor's, then only the thread's
  std::string run_id_;
  std::string experiment_id_;
  // A resumed run's params, as MLflow holds them.
  std::unordered_map<std::string, std::string> logged_params_;

  std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  MlflowQueue queue_;
  Warning warning_;
  int64_t last_step_ = -1;  // of log_metrics
  bool unreachable_ = false;
  std::chrono::steady_clock::time_point unreachable_since_;
  std::string last_failure_;
  size_t rejected_metrics_ = 0, rejected_params_ = 0, rejected_tags_ = 0;
  std::string first_rejection_;
  bool finishing_ = false;
  bool retry_now_ = false;  // finish() cuts a backoff wait short
  std::chrono::steady_clock::time_point finish_deadline_;
  bool dropping_told_ = false;  // the warning that the queue is full, given once
  MlflowRunStatus final_status_ = MlflowRunStatus::Finished;
  int64_t end_time_ms_ = 0;
  bool status_done_ = false;  // recorded, or refused by the server
  bool status_recorded_ = false;
  std::thread sender_;
};

}  // namespace fp8t::train
