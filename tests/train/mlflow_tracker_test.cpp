// The MLflow tracker without MLflow: URIs, value limits, the JSON of runs/log-batch, the queue's
// batches and its policy when full, and the tracker against a stand-in server on 127.0.0.1 that
// answers as MLflow's REST API does (or fails, or refuses). CI also runs a real `mlflow server`
// and reads the runs back with MLflow's client: tests/train/check_mlflow.py.
#include "train/mlflow_tracker.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_files.h"

namespace fp8t::train {
namespace {

using test::Contains;
using test::error_message;

struct Request {
  std::string method;  // "GET", "POST"
  std::string path;    // "/api/2.0/mlflow/runs/create", without the query
  std::string query;
  std::string body;
};

struct Answer {
  int status = 200;
  std::string body = "{}";
};

// An HTTP server on 127.0.0.1 (a port the kernel picks) that answers each request with what
// `respond` returns, one request per connection, and records the requests.
class StandInServer {
 public:
  explicit StandInServer(std::function<Answer(const Request&)> respond)
      : respond_(std::move(respond)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listener_ < 0) throw Error(fmt::format("socket: {}", std::strerror(errno)));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    if (::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0 ||
        ::listen(listener_, 16) != 0) {
      ::close(listener_);
      throw Error(fmt::format("bind/listen: {}", std::strerror(errno)));
    }
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~StandInServer() { stop(); }
  StandInServer(const StandInServer&) = delete;
  StandInServer& operator=(const StandInServer&) = delete;

  // Closes the port: connections are refused from now on.
  void stop() {
    if (!thread_.joinable()) return;
    stopping_ = true;
    thread_.join();
    ::close(listener_);
  }

  std::string uri() const { return fmt::format("http://127.0.0.1:{}", port_); }
  std::vector<Request> requests() const {
    const std::lock_guard lock(mutex_);
    return requests_;
  }
  // The requests to one method ("runs/log-batch").
  std::vector<Request> requests_to(const std::string& method) const {
    std::vector<Request> found;
    for (const Request& request : requests()) {
      if (request.path == "/api/2.0/mlflow/" + method) found.push_back(request);
    }
    return found;
  }

 private:
  void serve() {
    while (!stopping_) {
      pollfd ready{listener_, POLLIN, 0};
      if (::poll(&ready, 1, 20) <= 0) continue;
      const int connection = ::accept(listener_, nullptr, nullptr);
      if (connection < 0) continue;
      answer(connection);
      ::close(connection);
    }
  }

  void answer(int connection) {
    std::string received;
    char chunk[65536];
    size_t header_end = std::string::npos;
    size_t content_length = 0;
    while (header_end == std::string::npos || received.size() < header_end + 4 + content_length) {
      const ssize_t got = ::recv(connection, chunk, sizeof chunk, 0);
      if (got <= 0) return;
      received.append(chunk, static_cast<size_t>(got));
      if (header_end == std::string::npos &&
          (header_end = received.find("\r\n\r\n")) != std::string::npos) {
        const size_t field = lowercase(received.substr(0, header_end)).find("content-length:");
        if (field != std::string::npos) content_length = std::stoul(received.substr(field + 15));
      }
    }
    Request request;
    const size_t method_end = received.find(' ');
    const size_t target_end = received.find(' ', method_end + 1);
    request.method = received.substr(0, method_end);
    const std::string target = received.substr(method_end + 1, target_end - method_end - 1);
    const size_t question = target.find('?');
    request.path = target.substr(0, question);
    if (question != std::string::npos) request.query = target.substr(question + 1);
    request.body = received.substr(header_end + 4, content_length);
    {
      const std::lock_guard lock(mutex_);
      requests_.push_back(request);
    }
    const Answer reply = respond_(request);
    const std::string response = fmt::format(
        "HTTP/1.1 {} Answer\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
        "Connection: close\r\n\r\n{}",
        reply.status, reply.body.size(), reply.body);
    static_cast<void>(::send(connection, response.data(), response.size(), MSG_NOSIGNAL));
  }

  static std::string lowercase(std::string text) {
    for (char& c : text)
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return text;
  }

  std::function<Answer(const Request&)> respond_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_ = false;
  std::thread thread_;
  mutable std::mutex mutex_;
  std::vector<Request> requests_;
};

Answer mlflow_error(int status, const std::string& code, const std::string& message) {
  return {status, nlohmann::json{{"error_code", code}, {"message", message}}.dump()};
}

// MLflow's answers for a server where the experiment does not exist yet; log-batch and update
// answer `log_batch` and `update`.
std::function<Answer(const Request&)> mlflow_api(std::function<Answer()> log_batch = [] {
  return Answer();
}) {
  return [log_batch](const Request& request) -> Answer {
    if (request.path.ends_with("/experiments/get-by-name")) {
      return mlflow_error(404, "RESOURCE_DOES_NOT_EXIST", "Could not find experiment");
    }
    if (request.path.ends_with("/experiments/create")) return {200, R"({"experiment_id": "7"})"};
    if (request.path.ends_with("/runs/create")) {
      return {200, R"({"run": {"info": {"run_id": "r1", "experiment_id": "7"}}})"};
    }
    if (request.path.ends_with("/runs/log-batch")) return log_batch();
    if (request.path.ends_with("/runs/update")) return {};
    return mlflow_error(404, "ENDPOINT_NOT_FOUND", "no such endpoint");
  };
}

MlflowSettings settings_for(const std::string& uri) {
  MlflowSettings settings;
  settings.tracking_uri = uri;
  settings.experiment = "fp8train-test";
  settings.run_name = "tiny";
  return settings;
}

nlohmann::json json_of(const Request& request) {
  return nlohmann::json::parse(request.body);
}

// The warning lines a tracker gives, from any thread.
class Warnings {
 public:
  MlflowTracker::Warning callback() {
    return [this](const std::string& line) {
      const std::lock_guard lock(mutex_);
      lines_.push_back(line);
    };
  }
  std::vector<std::string> lines() const {
    const std::lock_guard lock(mutex_);
    return lines_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST(MlflowEndpoint, JoinsTheApiPathToHttpAddresses) {
  EXPECT_EQ(mlflow_endpoint("http://127.0.0.1:5000", "runs/create"),
            "http://127.0.0.1:5000/api/2.0/mlflow/runs/create");
  EXPECT_EQ(mlflow_endpoint("https://mlflow.example.com/prefix//", "runs/log-batch"),
            "https://mlflow.example.com/prefix/api/2.0/mlflow/runs/log-batch");
  EXPECT_EQ(mlflow_endpoint("HTTP://host:5000", "runs/get"),
            "HTTP://host:5000/api/2.0/mlflow/runs/get");
}

TEST(MlflowEndpoint, RefusesWhatIsNotAnHttpServer) {
  for (const char* uri : {"file:///tmp/mlruns", "databricks", "./mlruns", "sqlite:///mlflow.db"}) {
    const std::string message = error_message([&] { return mlflow_endpoint(uri, "runs/get"); });
    EXPECT_TRUE(Contains(message, fmt::format("MLflow tracking URI '{}'", uri)));
    EXPECT_TRUE(Contains(message, "only http:// and https:// tracking servers are supported"));
  }
  EXPECT_TRUE(Contains(error_message([] { return mlflow_endpoint("", "runs/get"); }),
                       "set MLFLOW_TRACKING_URI"));
  EXPECT_TRUE(Contains(error_message([] { return mlflow_endpoint("http://", "runs/get"); }),
                       "MLflow tracking URI 'http://': no host"));
}

TEST(MlflowValues, LongValuesAreCutWithANote) {
  EXPECT_EQ(truncate_value("short", 100), "short");
  const std::string long_value(7000, 'x');
  const std::string cut = truncate_value(long_value, kMlflowParamValueLength);
  EXPECT_EQ(cut.size(), kMlflowParamValueLength);
  EXPECT_TRUE(cut.ends_with(" ... (truncated from 7000 bytes)")) << cut.substr(5900);
  // Two-byte characters: the cut falls between them, never inside one.
  std::string accented;
  for (int i = 0; i < 100; ++i)
    accented += "\xc3\xa9";  // é
  const std::string cut_accented = truncate_value(accented, 60);
  const size_t kept = cut_accented.find(" ... ");
  ASSERT_NE(kept, std::string::npos);
  EXPECT_EQ(kept % 2, 0u) << cut_accented;
  EXPECT_LE(cut_accented.size(), 60u);
}

TEST(MlflowValues, NonFiniteMetricsUseProtobufsJsonNames) {
  EXPECT_EQ(mlflow_metric_value(std::nan("")), "NaN");
  EXPECT_EQ(mlflow_metric_value(std::numeric_limits<double>::infinity()), "Infinity");
  EXPECT_EQ(mlflow_metric_value(-std::numeric_limits<double>::infinity()), "-Infinity");
  EXPECT_EQ(mlflow_metric_value(2.5), 2.5);
}

TEST(MlflowValues, LogBatchBodyHoldsEveryEntry) {
  MlflowBatch batch;
  batch.metrics = {{"train/loss", 2.5, 1700000000123, 3}, {"train/grad_norm", std::nan(""), 5, 3}};
  const nlohmann::json metrics = nlohmann::json::parse(log_batch_body("abc", batch));
  EXPECT_EQ(metrics, nlohmann::json::parse(R"({"run_id": "abc", "metrics": [
      {"key": "train/loss", "value": 2.5, "timestamp": 1700000000123, "step": 3},
      {"key": "train/grad_norm", "value": "NaN", "timestamp": 5, "step": 3}]})"));
  MlflowBatch params;
  params.params = {{"model.depth", "4"}, {"data.data_path", "bad \xff byte"}};
  const nlohmann::json body = nlohmann::json::parse(log_batch_body("abc", params));
  EXPECT_FALSE(body.contains("metrics"));
  EXPECT_EQ(body["params"][0], nlohmann::json::parse(R"({"key": "model.depth", "value": "4"})"));
  EXPECT_EQ(body["params"][1]["value"], "bad \xef\xbf\xbd byte");  // U+FFFD
}

TEST(MlflowQueue, BatchesOneKindAtATimeWithinMlflowsLimits) {
  MlflowQueue queue;
  for (int i = 0; i < 250; ++i)
    queue.add_param(fmt::format("p{}", i), "v");
  queue.add_tag("fp8train.device", "cpu");
  for (int64_t step = 1; step <= 1250; ++step) {
    queue.add_metric({"train/loss", 1.0, 0, step});
    queue.add_metric({"train/lr", 0.1, 0, step});
  }
  std::vector<std::string> sizes;
  for (MlflowBatch batch = queue.take_batch(); !batch.empty(); batch = queue.take_batch()) {
    sizes.push_back(
        fmt::format("{}p{}t{}m", batch.params.size(), batch.tags.size(), batch.metrics.size()));
  }
  EXPECT_EQ(sizes, (std::vector<std::string>{"100p0t0m", "100p0t0m", "50p0t0m", "0p1t0m",
                                             "0p0t1000m", "0p0t1000m", "0p0t500m"}));
  EXPECT_TRUE(queue.empty());
  EXPECT_EQ(queue.dropped(), 0u);
}

TEST(MlflowQueue, ABatchPutBackIsSentFirstInItsOrder) {
  MlflowQueue queue;
  for (int64_t step = 1; step <= 3; ++step)
    queue.add_metric({"loss", 1.0, 0, step});
  MlflowBatch batch = queue.take_batch();
  queue.add_metric({"loss", 1.0, 0, 4});
  queue.put_back(std::move(batch));
  std::vector<int64_t> steps;
  for (const MlflowMetric& metric : queue.metrics())
    steps.push_back(metric.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
}

TEST(MlflowQueue, WhenFullTheOldestGoButEachMetricsLastValueStays) {
  MlflowQueue queue(4);
  queue.add_metric({"val/loss", 5.0, 0, 1});  // logged once: its last value
  for (int64_t step = 1; step <= 10; ++step)
    queue.add_metric({"train/loss", 1.0, 0, step});
  EXPECT_EQ(queue.dropped(), 7u);
  EXPECT_EQ(queue.first_dropped_step(), 1);
  EXPECT_EQ(queue.last_dropped_step(), 7);
  std::vector<std::string> kept;
  for (const MlflowMetric& metric : queue.metrics()) {
    kept.push_back(fmt::format("{}@{}", metric.key, metric.step));
  }
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"train/loss@10", "train/loss@8", "train/loss@9",
                                            "val/loss@1"}));
  // Every value the last of its key: the oldest goes all the same.
  MlflowQueue distinct(2);
  for (int i = 0; i < 3; ++i)
    distinct.add_metric({fmt::format("m{}", i), 1.0, 0, i});
  EXPECT_EQ(distinct.dropped(), 1u);
  EXPECT_EQ(distinct.metrics().front().key, "m1");
}

TEST(MlflowTracker, RefusesAUriThatIsNotHttpBeforeConnecting) {
  const std::string message =
      error_message([] { MlflowTracker tracker(settings_for("file:///tmp/mlruns")); });
  EXPECT_TRUE(Contains(message, "MLflow tracking URI 'file:///tmp/mlruns': only http://"));
}

TEST(MlflowTracker, AClosedPortStopsTheRunAtStartNamingTheUri) {
  std::string uri;
  {
    const StandInServer server([](const Request&) { return Answer(); });
    uri = server.uri();
  }  // the port is closed now: connections are refused
  const auto start = std::chrono::steady_clock::now();
  const std::string message = error_message([&] { MlflowTracker tracker(settings_for(uri)); });
  EXPECT_TRUE(Contains(message, fmt::format("MLflow tracking server {} cannot be reached", uri)));
  EXPECT_TRUE(Contains(message, "MLFLOW_TRACKING_URI"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(MlflowTracker, AnHttpErrorAtStartNamesTheStatusAndMlflowsMessage) {
  StandInServer server([](const Request& request) {
    if (request.path.ends_with("/experiments/get-by-name")) {
      return mlflow_error(403, "PERMISSION_DENIED", "no access to experiment");
    }
    return Answer();
  });
  const std::string message =
      error_message([&] { MlflowTracker tracker(settings_for(server.uri())); });
  EXPECT_TRUE(Contains(message, fmt::format("MLflow tracking server {}: cannot look up the "
                                            "experiment 'fp8train-test': HTTP 403: "
                                            "PERMISSION_DENIED: no access to experiment",
                                            server.uri())));
}

TEST(MlflowTracker, CreatesTheExperimentAndRunThenLogsEverythingAndFinishes) {
  StandInServer server(mlflow_api());
  Warnings warnings;
  std::vector<std::string> report;
  {
    MlflowTracker tracker(settings_for(server.uri()));
    tracker.set_warning_callback(warnings.callback());
    EXPECT_EQ(tracker.run_id(), "r1");
    EXPECT_EQ(tracker.experiment_id(), "7");
    KeyValues params;
    for (int i = 0; i < 150; ++i)
      params.emplace_back(fmt::format("section.key{}", i), "1");
    params.emplace_back("data.long", std::string(7000, 'x'));
    tracker.log_params(params);
    tracker.set_tags({{"fp8train.device", "cpu"}});
    for (int64_t step = 1; step <= 3; ++step) {
      tracker.log_metrics(step, {{"train/loss", 10.0 - double(step)}, {"train/lr", 0.01}});
    }
    tracker.log_metrics(3, {{"train/grad_norm", std::numeric_limits<double>::infinity()}});
    report = tracker.finish(MlflowRunStatus::Finished, std::chrono::seconds(10));
  }
  EXPECT_TRUE(report.empty()) << fmt::format("{}", fmt::join(report, "\n"));
  EXPECT_TRUE(warnings.lines().empty()) << fmt::format("{}", fmt::join(warnings.lines(), "\n"));

  const std::vector<Request> lookups = server.requests_to("experiments/get-by-name");
  ASSERT_EQ(lookups.size(), 1u);
  EXPECT_EQ(lookups[0].method, "GET");
  EXPECT_EQ(lookups[0].query, "experiment_name=fp8train-test");
  ASSERT_EQ(server.requests_to("experiments/create").size(), 1u);
  EXPECT_EQ(json_of(server.requests_to("experiments/create")[0])["name"], "fp8train-test");
  const std::vector<Request> creates = server.requests_to("runs/create");
  ASSERT_EQ(creates.size(), 1u);
  EXPECT_EQ(json_of(creates[0])["experiment_id"], "7");
  EXPECT_EQ(json_of(creates[0])["run_name"], "tiny");
  EXPECT_GT(json_of(creates[0])["start_time"].get<int64_t>(), 1700000000000);

  size_t params = 0, tags = 0;
  std::vector<std::string> metrics;
  for (const Request& batch : server.requests_to("runs/log-batch")) {
    const nlohmann::json body = json_of(batch);
    EXPECT_EQ(body["run_id"], "r1");
    for (const nlohmann::json& param : body.value("params", nlohmann::json::array())) {
      ++params;
      if (param["key"] == "data.long") {
        EXPECT_EQ(param["value"].get<std::string>().size(), kMlflowParamValueLength);
      }
    }
    tags += body.value("tags", nlohmann::json::array()).size();
    for (const nlohmann::json& metric : body.value("metrics", nlohmann::json::array())) {
      metrics.push_back(fmt::format("{}@{}={}", metric["key"].get<std::string>(),
                                    metric["step"].get<int64_t>(), metric["value"].dump()));
    }
  }
  EXPECT_EQ(params, 151u);
  EXPECT_EQ(tags, 1u);
  EXPECT_EQ(metrics,
            (std::vector<std::string>{"train/loss@1=9.0", "train/lr@1=0.01", "train/loss@2=8.0",
                                      "train/lr@2=0.01", "train/loss@3=7.0", "train/lr@3=0.01",
                                      "train/grad_norm@3=\"Infinity\""}));
  const std::vector<Request> updates = server.requests_to("runs/update");
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(json_of(updates[0])["status"], "FINISHED");
  EXPECT_EQ(json_of(updates[0])["run_id"], "r1");
  EXPECT_TRUE(json_of(updates[0]).contains("end_time"));
  EXPECT_EQ(server.requests().back().path, "/api/2.0/mlflow/runs/update");  // the status last
}

TEST(MlflowTracker, AFailingServerNeverBlocksAndFinishSaysWhatDidNotArrive) {
  StandInServer server(
      mlflow_api([] { return mlflow_error(503, "TEMPORARILY_UNAVAILABLE", "busy"); }));
  Warnings warnings;
  MlflowTracker tracker(settings_for(server.uri()));
  tracker.set_warning_callback(warnings.callback());
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 1; step <= 4; ++step) {
    tracker.log_metrics(step, {{"train/loss", 1.0}});
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  // 1.2 s of sleeps: the calls never waited for a request (10 s each at most).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  const std::vector<std::string> report =
      tracker.finish(MlflowRunStatus::Failed, std::chrono::seconds(1));
  ASSERT_EQ(report.size(), 1u) << fmt::format("{}", fmt::join(report, "\n"));
  EXPECT_EQ(report[0], fmt::format("MLflow: not delivered to {}: 4 metric values (steps 1 to 4), "
                                   "the run's status FAILED (last failure: HTTP 503: "
                                   "TEMPORARILY_UNAVAILABLE: busy)",
                                   server.uri()));
  // The status was never tried: it waits behind the values.
  EXPECT_TRUE(server.requests_to("runs/update").empty());
  // 1 s of finishing: several retries, each of the same first batch.
  EXPECT_GE(server.requests_to("runs/log-batch").size(), 3u);
  const std::vector<std::string> lines = warnings.lines();
  ASSERT_EQ(lines.size(), 1u) << fmt::format("{}", fmt::join(lines, "\n"));
  EXPECT_TRUE(
      Contains(lines[0],
               fmt::format("MLflow: cannot deliver to {} from step 1 on (HTTP 503", server.uri())));
}

TEST(MlflowTracker, AFullQueueDropsTheOldestValuesAndSaysSo) {
  StandInServer server(mlflow_api([] { return mlflow_error(503, "", "down"); }));
  Warnings warnings;
  MlflowTracker tracker(settings_for(server.uri()));
  tracker.set_warning_callback(warnings.callback());
  std::vector<std::pair<std::string, double>> values;
  for (int i = 0; i < 100; ++i)
    values.emplace_back(fmt::format("m{}", i), 1.0);
  for (int64_t step = 1; step <= 1200; ++step)
    tracker.log_metrics(step, values);
  const std::vector<std::string> report =
      tracker.finish(MlflowRunStatus::Finished, std::chrono::seconds(0));
  // The queue keeps the newest values (steps 201 to 1200); the batches the thread took out
  // while it filled hold older steps, and which ones depends on the thread's scheduling.
  ASSERT_EQ(report.size(), 2u) << fmt::format("{}", fmt::join(report, "\n"));
  EXPECT_TRUE(Contains(report[0], "to 1200), the run's status FINISHED")) << report[0];
  const size_t steps_at = report[0].find("(steps ");
  ASSERT_NE(steps_at, std::string::npos) << report[0];
  int64_t first_step = 0;
  ASSERT_EQ(std::sscanf(report[0].c_str() + steps_at, "(steps %" SCNd64, &first_step), 1);
  EXPECT_GE(first_step, 1) << report[0];
  EXPECT_LE(first_step, 201) << report[0];
  EXPECT_TRUE(Contains(report[1], "were dropped while the queue was full")) << report[1];
  size_t undelivered = 0, dropped = 0;
  ASSERT_EQ(std::sscanf(report[0].c_str() + report[0].find(": ", 8) + 2, "%zu", &undelivered), 1);
  ASSERT_EQ(std::sscanf(report[1].c_str(), "MLflow: %zu", &dropped), 1);
  EXPECT_EQ(undelivered + dropped, 120000u);
  EXPECT_LE(undelivered, kMlflowQueuedMetrics + kMlflowMetricsPerBatch);
  const std::vector<std::string> lines = warnings.lines();
  const auto full = std::count_if(lines.begin(), lines.end(), [](const std::string& line) {
    return line.find("the oldest are dropped") != std::string::npos;
  });
  EXPECT_EQ(full, 1) << fmt::format("{}", fmt::join(lines, "\n"));
}

TEST(MlflowTracker, AnUnreachableServerThatReturnsGetsEverythingAndSaysSoOnce) {
  std::atomic<bool> down = true;
  StandInServer server(
      mlflow_api([&] { return down ? mlflow_error(502, "", "bad gateway") : Answer(); }));
  Warnings warnings;
  MlflowTracker tracker(settings_for(server.uri()));
  tracker.set_warning_callback(warnings.callback());
  tracker.log_metrics(1, {{"train/loss", 1.0}});
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // a few retries
  down = false;
  tracker.log_metrics(2, {{"train/loss", 0.5}});
  EXPECT_TRUE(tracker.finish(MlflowRunStatus::Finished, std::chrono::seconds(10)).empty());
  const std::vector<std::string> lines = warnings.lines();
  ASSERT_EQ(lines.size(), 2u) << fmt::format("{}", fmt::join(lines, "\n"));
  EXPECT_TRUE(Contains(lines[0], "cannot deliver to"));
  EXPECT_TRUE(Contains(lines[1], fmt::format("MLflow: {} answers again after", server.uri())));
  ASSERT_EQ(server.requests_to("runs/update").size(), 1u);
}

TEST(MlflowTracker, RefusedValuesAreCountedNotRetried) {
  StandInServer server(
      mlflow_api([] { return mlflow_error(400, "INVALID_PARAMETER_VALUE", "bad key"); }));
  std::vector<std::string> report;
  {
    MlflowTracker tracker(settings_for(server.uri()));
    tracker.set_warning_callback([](const std::string&) {});
    tracker.log_metrics(1, {{"train/loss", 1.0}, {"train/lr", 0.1}});
    report = tracker.finish(MlflowRunStatus::Finished, std::chrono::seconds(10));
  }
  ASSERT_EQ(report.size(), 1u) << fmt::format("{}", fmt::join(report, "\n"));
  EXPECT_TRUE(
      Contains(report[0], "refused 2 metric values (HTTP 400: INVALID_PARAMETER_VALUE: bad key)"));
  EXPECT_EQ(server.requests_to("runs/log-batch").size(), 1u);
  EXPECT_EQ(server.requests_to("runs/update").size(), 1u);
}

TEST(MlflowTracker, AResumedRunContinuesAndKeepsItsParams) {
  StandInServer server([](const Request& request) -> Answer {
    if (request.path.ends_with("/runs/get")) {
      return {200, R"({"run": {"info": {"run_id": "old", "experiment_id": "3",
                "lifecycle_stage": "active", "status": "KILLED"},
                "data": {"params": [{"key": "model.depth", "value": "4"},
                                    {"key": "training.train_iters", "value": "6"}]}}})"};
    }
    return Answer();
  });
  MlflowSettings settings = settings_for(server.uri());
  settings.resume_run_id = "old";
  Warnings warnings;
  {
    MlflowTracker tracker(settings);
    tracker.set_warning_callback(warnings.callback());
    EXPECT_EQ(tracker.run_id(), "old");
    EXPECT_EQ(tracker.experiment_id(), "3");
    tracker.log_params({{"model.depth", "4"}, {"training.train_iters", "9"}, {"run.new_key", "x"}});
    EXPECT_TRUE(tracker.finish(MlflowRunStatus::Finished).empty());
  }
  EXPECT_TRUE(server.requests_to("runs/create").empty());
  EXPECT_TRUE(server.requests_to("experiments/get-by-name").empty());
  const std::vector<Request> gets = server.requests_to("runs/get");
  ASSERT_EQ(gets.size(), 1u);
  EXPECT_EQ(gets[0].query, "run_id=old");
  const std::vector<Request> updates = server.requests_to("runs/update");
  ASSERT_EQ(updates.size(), 2u);
  EXPECT_EQ(json_of(updates[0])["status"], "RUNNING");
  EXPECT_EQ(json_of(updates[1])["status"], "FINISHED");
  const std::vector<Request> batches = server.requests_to("runs/log-batch");
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(json_of(batches[0])["params"],
            nlohmann::json::parse(R"([{"key": "run.new_key", "value": "x"}])"));
  ASSERT_EQ(warnings.lines().size(), 1u);
  EXPECT_TRUE(Contains(warnings.lines()[0],
                       "MLflow: the run keeps the params of its first start; changed since: "
                       "training.train_iters (6 -> 9)"));
}

TEST(MlflowTracker, AResumedRunThatIsNotThereStopsTheStart) {
  StandInServer server([](const Request&) {
    return mlflow_error(404, "RESOURCE_DOES_NOT_EXIST", "Run with id=gone not found");
  });
  MlflowSettings settings = settings_for(server.uri());
  settings.resume_run_id = "gone";
  EXPECT_TRUE(Contains(error_message([&] { MlflowTracker tracker(settings); }),
                       fmt::format("MLflow tracking server {}: cannot continue the run gone: HTTP "
                                   "404: RESOURCE_DOES_NOT_EXIST: Run with id=gone not found",
                                   server.uri())));
}

TEST(MlflowTracker, DestroyedWithoutFinishMarksTheRunKilled) {
  StandInServer server(mlflow_api());
  {
    MlflowTracker tracker(settings_for(server.uri()));
    tracker.log_metrics(1, {{"train/loss", 1.0}});
  }
  const std::vector<Request> updates = server.requests_to("runs/update");
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(json_of(updates[0])["status"], "KILLED");
  EXPECT_EQ(server.requests_to("runs/log-batch").size(), 1u);
}

}  // namespace
}  // namespace fp8t::train
