#include "io/http_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::io {
namespace {

// curl_global_init is not thread-safe in every libcurl, and curl_easy_init would call it
// unguarded: the first client of any thread runs it, once. It is never undone: clients may
// live until the process exits.
void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const CURLcode code = curl_global_init(CURL_GLOBAL_DEFAULT);
    if (code != CURLE_OK) {
      throw Error(fmt::format("libcurl: cannot initialize: {}", curl_easy_strerror(code)));
    }
  });
}

size_t append_to_string(char* data, size_t size, size_t count, void* body) {
  static_cast<std::string*>(body)->append(data, size * count);
  return size * count;
}

CURL* handle_of(void* curl) {
  return static_cast<CURL*>(curl);
}

struct HeaderListFree {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};

}  // namespace

HttpClient::HttpClient() {
  init_curl_once();
  curl_ = curl_easy_init();
  if (curl_ == nullptr) throw Error("libcurl: cannot create a handle");
}

HttpClient::~HttpClient() {
  curl_easy_cleanup(handle_of(curl_));
}

HttpResponse HttpClient::post_json(const std::string& url, std::string_view json,
                                   std::chrono::milliseconds timeout) {
  return perform("POST", url, &json, timeout);
}

HttpResponse HttpClient::get(const std::string& url, std::chrono::milliseconds timeout) {
  return perform("GET", url, nullptr, timeout);
}

std::string HttpClient::escape(std::string_view text) {
  std::unique_ptr<char, decltype(&curl_free)> escaped(
      curl_easy_escape(handle_of(curl_), text.data(), static_cast<int>(text.size())), &curl_free);
  if (!escaped) throw Error("libcurl: out of memory escaping a URL");
  return escaped.get();
}

HttpResponse HttpClient::perform(const char* method, const std::string& url,
                                 const std::string_view* json, std::chrono::milliseconds timeout) {
  CURL* curl = handle_of(curl_);
  // Options reset between requests; the connection to the server stays open for the next one.
  curl_easy_reset(curl);
  HttpResponse response;
  char reason[CURL_ERROR_SIZE] = "";
  const long timeout_ms = std::max<long>(1, static_cast<long>(timeout.count()));
  std::unique_ptr<curl_slist, HeaderListFree> headers;
  auto add_header = [&headers](const char* header) {
    curl_slist* list = curl_slist_append(headers.get(), header);
    if (list == nullptr) throw Error("libcurl: out of memory building headers");
    if (!headers) headers.reset(list);  // appending keeps the head of a list
  };
  add_header("Accept: application/json");
  if (json != nullptr) {
    add_header("Content-Type: application/json");
    // libcurl would otherwise ask larger bodies to wait for "100 Continue", a round trip that
    // servers which never send it turn into a second's stall.
    add_header("Expect:");
  }
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers.get());
  curl_easy_setopt(curl, CURLOPT_USERAGENT, "fp8train/" FP8TRAIN_VERSION);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
  // Time limits without SIGALRM, which a program with several threads cannot use safely.
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, reason);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append_to_string);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response.body);
  if (json != nullptr) {
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, json->data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(json->size()));
  } else {
    curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
  }
  const CURLcode code = curl_easy_perform(curl);
  if (code != CURLE_OK) {
    throw Error(fmt::format("{} {}: {}", method, url,
                            reason[0] != '\0' ? reason : curl_easy_strerror(code)));
  }
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

}  // namespace fp8t::io
