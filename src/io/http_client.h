// JSON over HTTP(S) through libcurl: the requests a tracking server's REST API takes (POST a
// JSON body, GET with a query), each with its own time limit.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace fp8t::io {

struct HttpResponse {
  long status = 0;  // the HTTP status code (libcurl's type)
  std::string body;
};

// One libcurl handle: requests to the same server reuse its connection. Not for use by two
// threads at once; a handle may move from one thread to another between requests.
class HttpClient {
 public:
  HttpClient();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Any status the server answers with is returned; fp8t::Error "POST URL: REASON" (libcurl's
  // reason: refused, timed out, unknown host, malformed URL, ...) when no answer came within
  // `timeout`.
  HttpResponse post_json(const std::string& url, std::string_view json,
                         std::chrono::milliseconds timeout);
  HttpResponse get(const std::string& url, std::chrono::milliseconds timeout);

  // `text` percent-encoded for a URL's query ("a b/c" -> "a%20b%2Fc").
  std::string escape(std::string_view text);

 private:
  HttpResponse perform(const char* method, const std::string& url, const std::string_view* json,
                       std::chrono::milliseconds timeout);

  void* curl_;  // CURL*: curl.h stays out of this header
};

}  // namespace fp8t::io
