#include "gateway/topology.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <set>
#include <string_view>
#include <utility>

#include "net/http.h"
#include "net/http_server.h"
#include "util/error.h"
#include "util/file.h"
#include "util/utf8.h"

namespace tandem::gateway {
namespace {

constexpr const char* kEndpointForms = "HOST:PORT, http://HOST:PORT or HOST:PORT@BOOTSTRAP_PORT";
constexpr const char* kServerForms = "HOST:PORT or http://HOST:PORT";
constexpr const char* kModes = "aggregated, sequential (vllm) or parallel (sglang)";
constexpr const char* kDialects = "auto, tandem, vllm or sglang";

std::string duration_expected(int64_t min) {
  return "a duration in milliseconds " + std::to_string(min) + ".." +
         std::to_string(kMaxMilliseconds) + " (at most about 24.8 days)";
}

std::string shutdown_timeout_expected() {
  return "a number of seconds 0.." + std::to_string(kMaxMilliseconds / 1000) +
         " (0: no drain; at most about 24.8 days)";
}

std::string quoted(const std::string& text) {
  return "'" + text + "'";
}

constexpr const char* kHostExpected =
    "a host name or address (letters, digits and . - _ : %; IPv6 without brackets)";

bool is_host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '-' || c == '_' || c == ':' || c == '%';
}

// A host goes into the Host header of every call to its engine: only the characters of names
// and addresses (IPv6 with a zone included), so that none can end that header and start another.
bool valid_host(std::string_view host) {
  return !host.empty() && std::all_of(host.begin(), host.end(), is_host_char);
}

// How an invalid host appears in an error: its first offending character, escaped, since
// echoing control characters would carry the very injection the check refuses.
std::string describe_host(std::string_view host) {
  const auto bad = std::find_if_not(host.begin(), host.end(), is_host_char);
  if (bad == host.end()) return "nothing";
  const auto c = static_cast<unsigned char>(*bad);
  char text[8] = {static_cast<char>(c), 0};
  if (c < 0x20 || c >= 0x7f) std::snprintf(text, sizeof text, "\\x%02x", c);
  return std::string("a host with '") + text + "' in it";
}

constexpr const char* kZmqEndpointExpected =
    "a ZMQ endpoint to connect to: tcp://HOST:PORT, ipc://PATH or inproc://NAME";

// Of a value that is not what was expected, what an error shows (utf8::quote_escaped): a value
// echoed raw could carry a line break into logs and answers.
constexpr size_t kQuotedBytes = 80;

// A whole decimal number, nothing else (no sign other than '-', no spaces, no suffix).
bool parse_integer(std::string_view text, long long& value) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  return ec == std::errc() && ptr == end && !text.empty();
}

// Whether a KV-event consumer can connect to `text`. ZMQ would refuse a malformed endpoint only
// as the engine joins, when a reload has already drained the engines it replaces; checked as the
// file is read, a typo is an error with nothing changed. Stricter than ZMQ where it would accept
// and then never connect: a wildcard host is a bind address (vLLM's default tcp://*:5557).
bool valid_zmq_endpoint(std::string_view text) {
  if (utf8::has_control_bytes(text)) return false;
  if (text.starts_with("inproc://")) return text.size() > 9;
  // A Unix socket's path is at most 107 bytes (sun_path); "@name" is an abstract one.
  if (text.starts_with("ipc://")) return text.size() > 6 && text.size() - 6 < 108;
  if (!text.starts_with("tcp://")) return false;
  const std::string_view rest = text.substr(6);
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos) return false;
  std::string_view host = rest.substr(0, colon);
  long long port = 0;
  if (!parse_integer(rest.substr(colon + 1), port) || port < 1 || port > 65535) return false;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  else if (host.find(':') != std::string_view::npos)
    return false;
  return valid_host(host);
}

uint16_t parse_port(const std::string& digits, const std::string& what, const std::string& text) {
  long long value = 0;
  if (!parse_integer(digits, value) || value < 1 || value > 65535)
    throw Error(what + ": expected a port 1..65535 in " + quoted(text) + ", got " + quoted(digits));
  return static_cast<uint16_t>(value);
}

// parse_endpoint with the error prefix `what` (a key path in topology files); without
// `bootstrap`, parse_server_address.
Endpoint parse_endpoint_as(const std::string& text, const std::string& what,
                           bool bootstrap = true) {
  const char* forms = bootstrap ? kEndpointForms : kServerForms;
  auto malformed = [&] { return Error(what + ": expected " + forms + ", got " + quoted(text)); };
  Endpoint e;
  std::string rest = text, scheme_text;
  if (const auto scheme = rest.find("://"); scheme != std::string::npos) {
    // Engines speak plain HTTP; any other scheme would silently be wrong.
    if (rest.substr(0, scheme) != "http") throw malformed();
    scheme_text = "http://";
    rest = rest.substr(scheme + 3);
    if (!rest.empty() && rest.back() == '/') rest.pop_back();
  }
  // A URL with a path (an OpenAI base URL, .../v1) names more than an address: said with
  // the address to give, as a pasted base URL is the likely case.
  if (const auto slash = rest.find('/'); slash != std::string::npos)
    throw Error(what + ": expected " + forms + ", got " + quoted(text) +
                ": give the address without a path, " +
                quoted(scheme_text + rest.substr(0, slash)));
  if (const auto at = rest.find('@'); at != std::string::npos) {
    if (!bootstrap) throw malformed();
    e.bootstrap_port = parse_port(rest.substr(at + 1), what, text);
    rest = rest.substr(0, at);
  }
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos) throw malformed();
  e.host = rest.substr(0, colon);
  // IPv6 addresses come in brackets, as in URLs: [::1]:8000.
  if (e.host.size() >= 2 && e.host.front() == '[' && e.host.back() == ']')
    e.host = e.host.substr(1, e.host.size() - 2);
  else if (e.host.find(':') != std::string::npos)
    throw malformed();
  if (!valid_host(e.host)) throw malformed();
  e.port = parse_port(rest.substr(colon + 1), what, text);
  return e;
}

PdMode parse_mode_as(const std::string& text, const std::string& what) {
  if (text == "aggregated") return PdMode::kAggregated;
  if (text == "sequential" || text == "vllm") return PdMode::kSequential;
  if (text == "parallel" || text == "sglang") return PdMode::kParallel;
  throw Error(what + ": expected " + kModes + ", got " + quoted(text));
}

Dialect parse_dialect_as(const std::string& text, const std::string& what) {
  if (text == "auto") return Dialect::kAuto;
  if (text == "tandem") return Dialect::kTandem;
  if (text == "vllm") return Dialect::kVllm;
  if (text == "sglang") return Dialect::kSglang;
  throw Error(what + ": expected " + kDialects + ", got " + quoted(text));
}

constexpr const char* kEndpointNameExpected =
    "a name of 1..256 bytes of UTF-8 text without control characters";

std::string host_port(const Endpoint& e) {
  return net::url_host(e.host) + ":" + std::to_string(e.port);
}

std::string io_threads_expected() {
  return "a whole number 1.." + std::to_string(kMaxIoThreads);
}

std::string retries_expected() {
  return "a whole number 0.." + std::to_string(kMaxPrefillRetries);
}

std::string held_bytes_expected() {
  return "a size in bytes 1.." + std::to_string(kMaxHeldBytesLimit) + " (at most " +
         std::to_string(kMaxHeldBytesLimit >> 30) + " GiB)";
}

// ---------------------------------------------------------------------------------------------
// Reading the YAML tree. Every function takes the key path of the node it reads, so that every
// error can say where it is; Reader::fail adds the source.

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& expected,
                         const std::string& got) const {
    throw Error(where(path) + ": expected " + expected + ", got " + got);
  }

  // A key path as errors give it: after the source, when there is one.
  std::string where(const std::string& path) const {
    return source_.empty() ? path : source_ + ": " + path;
  }

  // How a node looks in an error message.
  static std::string describe(const YAML::Node& node) {
    if (!node.IsDefined() || node.IsNull()) return "nothing";
    if (node.IsSequence()) return "a list";
    if (node.IsMap()) return "a mapping";
    if (is_plain(node)) return node.Scalar();
    return "\"" + node.Scalar() + "\" (a quoted string)";
  }

  // The keys of a mapping, checked against `allowed` (each at most once).
  std::map<std::string, YAML::Node> mapping(const YAML::Node& node, const std::string& path,
                                            std::initializer_list<const char*> allowed) const {
    std::string names;
    for (const char* name : allowed) names += std::string(names.empty() ? "" : ", ") + name;
    // A key with nothing after it ("prefill:" whose keys were not indented under it): said so,
    // with the keys it takes, where "expected a mapping, got nothing" left both to guess.
    if (node.IsNull() && !path.empty())
      fail(path, "a mapping of " + names + " (indented under it)", "an empty value");
    if (!node.IsMap()) fail(path.empty() ? "(top level)" : path, "a mapping", describe(node));
    std::map<std::string, YAML::Node> result;
    for (const auto& item : node) {
      const std::string key = item.first.IsScalar() ? item.first.Scalar() : "";
      const std::string key_path = path.empty() ? key : path + "." + key;
      if (!item.first.IsScalar())
        fail(path.empty() ? "(top level)" : path, "names as keys",
             describe(item.first) + " as a key");
      bool known = false;
      for (const char* name : allowed) known = known || key == name;
      if (!known) fail(key_path, "one of " + names, "an unknown key");
      if (!result.emplace(key, item.second).second) fail(key_path, "each key once", "it twice");
    }
    return result;
  }

  std::string string(const YAML::Node& node, const std::string& path,
                     const char* expected = "a string") const {
    if (!node.IsScalar()) fail(path, expected, describe(node));
    return node.Scalar();
  }

  std::string non_empty_string(const YAML::Node& node, const std::string& path,
                               const char* expected) const {
    std::string text = string(node, path, expected);
    if (text.empty()) fail(path, expected, "an empty string");
    return text;
  }

  long long integer(const YAML::Node& node, const std::string& path, long long min, long long max,
                    const std::string& expected) const {
    long long value = 0;
    if (!node.IsScalar() || !is_plain(node) || !parse_integer(node.Scalar(), value) ||
        value < min || value > max)
      fail(path, expected, describe(node));
    return value;
  }

  double number(const YAML::Node& node, const std::string& path, double min, double max,
                const std::string& expected) const {
    double value = 0;
    if (!node.IsScalar() || !is_plain(node) || !YAML::convert<double>::decode(node, value) ||
        !(value >= min) || !(value <= max))
      fail(path, expected, describe(node));
    return value;
  }

  int count(const YAML::Node& node, const std::string& path, int min) const {
    return static_cast<int>(integer(node, path, min, std::numeric_limits<int>::max(),
                                    "a whole number >= " + std::to_string(min)));
  }

  // A byte limit on what the gateway holds for one client: 1..kMaxHeldBytesLimit.
  size_t held_bytes(const YAML::Node& node, const std::string& path) const {
    return static_cast<size_t>(
        integer(node, path, 1, static_cast<long long>(kMaxHeldBytesLimit), held_bytes_expected()));
  }

  uint16_t port(const YAML::Node& node, const std::string& path) const {
    return static_cast<uint16_t>(integer(node, path, 1, 65535, "a port 1..65535"));
  }

  // A duration setting: min (0 or 1) ..kMaxMilliseconds.
  std::chrono::milliseconds milliseconds(const YAML::Node& node, const std::string& path,
                                         int64_t min = 1) const {
    return std::chrono::milliseconds(
        integer(node, path, min, kMaxMilliseconds, duration_expected(min)));
  }

  bool boolean(const YAML::Node& node, const std::string& path) const {
    if (node.IsScalar() && is_plain(node)) {
      if (node.Scalar() == "true") return true;
      if (node.Scalar() == "false") return false;
    }
    fail(path, "true or false", describe(node));
  }

  // A path in the file, relative to the file's folder; "-" and "" stay as they are.
  std::string file_path(const std::string& text) const {
    if (text.empty() || text == "-") return text;
    const std::filesystem::path path(text);
    if (path.is_absolute()) return text;
    const auto folder = std::filesystem::path(source_).parent_path();
    return (folder / path).lexically_normal().string();
  }

  const std::string& source() const { return source_; }

 private:
  // A plain scalar is untagged and unquoted: the only kind that may be a number or a boolean.
  static bool is_plain(const YAML::Node& node) { return node.Tag() == "?"; }

  std::string source_;
};

std::string at(const std::string& path, size_t index) {
  return path + "[" + std::to_string(index) + "]";
}

Endpoint read_endpoint(const Reader& r, const YAML::Node& node, const std::string& path) {
  if (node.IsScalar()) return parse_endpoint_as(r.string(node, path), r.where(path));
  if (node.IsNull())  // "- " with nothing after it: either form may be meant
    r.fail(path, std::string(kEndpointForms) + ", or a mapping with url, or host and port",
           "an empty value");
  const auto keys = r.mapping(node, path,
                              {"url", "host", "port", "bootstrap_port", "group", "name",
                               "max_in_flight", "kv_events", "kv_events_replay"});
  Endpoint e;
  if (keys.count("url")) {
    if (keys.count("host") || keys.count("port"))
      r.fail(path + "." + (keys.count("host") ? "host" : "port"), "either url or host and port",
             "both");
    e = parse_endpoint_as(r.string(keys.at("url"), path + ".url"), r.where(path + ".url"));
  } else {
    if (!keys.count("host") || !keys.count("port"))
      r.fail(path, "url, or host and port", keys.count("host") ? "no port" : "no host");
    e.host = r.non_empty_string(keys.at("host"), path + ".host", kHostExpected);
    if (!valid_host(e.host)) r.fail(path + ".host", kHostExpected, describe_host(e.host));
    e.port = r.port(keys.at("port"), path + ".port");
  }
  for (const auto& [key, field] :
       {std::pair{"kv_events", &e.kv_events}, std::pair{"kv_events_replay", &e.kv_events_replay}}) {
    if (!keys.count(key)) continue;
    const std::string key_path = path + "." + key;
    *field = r.non_empty_string(keys.at(key), key_path, kZmqEndpointExpected);
    if (!valid_zmq_endpoint(*field))
      r.fail(key_path, kZmqEndpointExpected, utf8::quote_escaped(*field, kQuotedBytes));
  }
  if (keys.count("bootstrap_port")) {
    if (e.bootstrap_port != 0)
      r.fail(path + ".bootstrap_port", "one bootstrap port", "one in url as well");
    e.bootstrap_port = r.port(keys.at("bootstrap_port"), path + ".bootstrap_port");
  }
  if (keys.count("group")) e.group = r.count(keys.at("group"), path + ".group", 0);
  if (keys.count("name")) {
    // The name labels the engine's metric series and every mention of it (the dashboard, the
    // access log): bounded, and text.
    e.name = r.non_empty_string(keys.at("name"), path + ".name", kEndpointNameExpected);
    if (e.name.size() > kMaxEndpointNameBytes || utf8::has_control_bytes(e.name) ||
        !utf8::is_valid(e.name))
      r.fail(path + ".name", kEndpointNameExpected, utf8::quote_escaped(e.name, kQuotedBytes));
  }
  if (keys.count("max_in_flight"))
    e.max_in_flight = r.count(keys.at("max_in_flight"), path + ".max_in_flight", 1);
  return e;
}

Pool read_pool(const Reader& r, const YAML::Node& node, const std::string& path, bool required) {
  const auto keys = r.mapping(node, path, {"dialect", "tokens_in", "max_in_flight", "endpoints"});
  Pool pool;
  if (keys.count("dialect"))
    pool.dialect = parse_dialect_as(r.string(keys.at("dialect"), path + ".dialect", kDialects),
                                    r.source() + ": " + path + ".dialect");
  if (keys.count("tokens_in"))
    pool.tokens_in = r.boolean(keys.at("tokens_in"), path + ".tokens_in");
  if (keys.count("max_in_flight"))
    pool.max_in_flight = r.count(keys.at("max_in_flight"), path + ".max_in_flight", 1);
  const std::string list_path = path + ".endpoints";
  if (!keys.count("endpoints")) {
    if (required) r.fail(list_path, "a list of engines", "nothing");
    return pool;
  }
  const YAML::Node& list = keys.at("endpoints");
  if (!list.IsSequence()) r.fail(list_path, "a list of engines", Reader::describe(list));
  for (size_t i = 0; i < list.size(); ++i)
    pool.endpoints.push_back(read_endpoint(r, list[i], at(list_path, i)));
  return pool;
}

void read_cache_aware(const Reader& r, const YAML::Node& node, CacheAwareOptions& o) {
  const std::string path = "scheduling.cache_aware";
  const auto keys = r.mapping(node, path,
                              {"cache_threshold", "balance_abs_threshold", "balance_rel_threshold",
                               "eviction_interval_ms", "max_tree_size"});
  if (keys.count("cache_threshold"))
    o.cache_threshold =
        r.number(keys.at("cache_threshold"), path + ".cache_threshold", 0, 1, "a fraction 0..1");
  if (keys.count("balance_abs_threshold"))
    o.balance_abs_threshold =
        r.integer(keys.at("balance_abs_threshold"), path + ".balance_abs_threshold", 0,
                  std::numeric_limits<int32_t>::max(), "a whole number >= 0");
  if (keys.count("balance_rel_threshold"))
    o.balance_rel_threshold = r.number(keys.at("balance_rel_threshold"),
                                       path + ".balance_rel_threshold", 1, 1e6, "a number >= 1");
  if (keys.count("eviction_interval_ms"))
    o.eviction_interval =
        r.milliseconds(keys.at("eviction_interval_ms"), path + ".eviction_interval_ms");
  if (keys.count("max_tree_size"))
    o.max_tree_size = r.integer(keys.at("max_tree_size"), path + ".max_tree_size", 1,
                                std::numeric_limits<int64_t>::max(), "a whole number >= 1");
}

void read_kv_router(const Reader& r, const YAML::Node& node, KvRouterOptions& o) {
  const std::string path = "scheduling.kv_router";
  const auto keys = r.mapping(node, path, {"overlap_score_weight", "block_size"});
  if (keys.count("overlap_score_weight"))
    o.overlap_score_weight = r.number(keys.at("overlap_score_weight"),
                                      path + ".overlap_score_weight", 0, 1e6, "a number >= 0");
  if (keys.count("block_size"))
    o.block_size =
        r.integer(keys.at("block_size"), path + ".block_size", 1, 1 << 20, "a whole number >= 1");
}

void read_scheduling(const Reader& r, const YAML::Node& node, SchedulingOptions& s) {
  const auto keys =
      r.mapping(node, "scheduling",
                {"queue_length_weight", "queue_wait_weight", "starvation_ms", "load_interval_ms",
                 "max_queued_prefill_tokens", "max_prefill_seqs", "max_batch_tokens", "max_hold_ms",
                 "prefill_deadline_slack", "prefill_deadline_cap_s", "cache_aware", "kv_router"});
  if (keys.count("cache_aware")) read_cache_aware(r, keys.at("cache_aware"), s.cache_aware);
  if (keys.count("kv_router")) read_kv_router(r, keys.at("kv_router"), s.kv_router);
  auto weight = [&](const char* key, double& out) {
    if (keys.count(key))
      out = r.number(keys.at(key), std::string("scheduling.") + key, 0, 1e6, "a number >= 0");
  };
  weight("queue_length_weight", s.queue.length_weight);
  weight("queue_wait_weight", s.queue.wait_weight);
  weight("prefill_deadline_slack", s.tandem.prefill_deadline_slack);
  weight("prefill_deadline_cap_s", s.tandem.prefill_deadline_cap_s);
  auto ms = [&](const char* key) {
    return r.milliseconds(keys.at(key), std::string("scheduling.") + key, 0);
  };
  if (keys.count("starvation_ms")) s.queue.starvation_after = ms("starvation_ms");
  if (keys.count("load_interval_ms")) s.load_interval = ms("load_interval_ms");
  if (keys.count("max_hold_ms")) s.tandem.max_hold = ms("max_hold_ms");
  auto tokens = [&](const char* key, int64_t& out, long long min) {
    if (keys.count(key))
      out = r.integer(keys.at(key), std::string("scheduling.") + key, min,
                      std::numeric_limits<int32_t>::max(),
                      "a whole number >= " + std::to_string(min));
  };
  tokens("max_queued_prefill_tokens", s.tandem.max_queued_prefill_tokens, 0);
  tokens("max_prefill_seqs", s.tandem.max_prefill_seqs, 0);
  tokens("max_batch_tokens", s.tandem.max_batch_tokens, 1);
}

PriorityClasses read_priority_classes(const Reader& r, const YAML::Node& node,
                                      const std::string& path) {
  const auto keys = r.mapping(node, path, {"classes", "default", "api_keys"});
  const auto sub = [&](const std::string& key) { return path.empty() ? key : path + "." + key; };
  PriorityClasses pc;
  if (!keys.count("classes")) r.fail(sub("classes"), "a list of classes", "nothing");
  const YAML::Node& list = keys.at("classes");
  if (!list.IsSequence() || list.size() == 0)
    r.fail(sub("classes"), "a list of at least one class", Reader::describe(list));
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string item = at(sub("classes"), i);
    const auto c = r.mapping(list[i], item, {"name", "priority", "max_wait_ms", "hold_ms"});
    PriorityClass k;
    if (!c.count("name")) r.fail(item + ".name", "a class name", "nothing");
    k.name = r.non_empty_string(c.at("name"), item + ".name", "a class name");
    if (c.count("priority"))
      k.priority =
          r.integer(c.at("priority"), item + ".priority", std::numeric_limits<int32_t>::min(),
                    std::numeric_limits<int32_t>::max(), "a whole number");
    else
      k.priority = static_cast<int64_t>(i);
    if (c.count("max_wait_ms"))
      k.max_wait = r.milliseconds(c.at("max_wait_ms"), item + ".max_wait_ms");
    if (c.count("hold_ms")) k.hold = r.milliseconds(c.at("hold_ms"), item + ".hold_ms", 0);
    pc.classes.push_back(std::move(k));
  }
  const auto class_named = [&](const YAML::Node& n, const std::string& where) {
    const std::string name = r.non_empty_string(n, where, "a class name");
    for (size_t i = 0; i < pc.classes.size(); ++i)
      if (pc.classes[i].name == name) return i;
    r.fail(where, "the name of a class in " + sub("classes"), quoted(name));
  };
  if (keys.count("default")) pc.default_class = class_named(keys.at("default"), sub("default"));
  if (keys.count("api_keys")) {
    const YAML::Node& map = keys.at("api_keys");
    if (!map.IsMap())
      r.fail(sub("api_keys"), "a mapping of API key to class", Reader::describe(map));
    // Paths name entries by position: an error message must not show a key.
    size_t i = 0;
    for (const auto& kv : map) {
      const std::string where = sub("api_keys") + " (entry " + std::to_string(++i) + ")";
      const std::string key = r.non_empty_string(kv.first, where, "an API key");
      pc.api_keys[key] = class_named(kv.second, where);
    }
  }
  return pc;
}

Topology read_topology(const Reader& r, const YAML::Node& root) {
  const auto keys = r.mapping(root, "",
                              {"listen",
                               "mode",
                               "model",
                               "served_model_name",
                               "api_keys",
                               "admin_api_key",
                               "metrics_api_key",
                               "max_queue",
                               "max_queued_body_bytes",
                               "max_answer_bytes",
                               "prefill_retries",
                               "retry_backoff_ms",
                               "retry_backoff_max_ms",
                               "policy",
                               "scheduling",
                               "access_log",
                               "health",
                               "max_tokens_limit",
                               "default_max_tokens",
                               "engine_api_key",
                               "timeouts",
                               "prefill",
                               "decode",
                               "priority_classes",
                               "shutdown_timeout"});
  auto has = [&](const char* key) { return keys.count(key) != 0; };
  Topology t;
  if (has("listen")) {
    const auto listen = r.mapping(
        keys.at("listen"), "listen",
        {"host", "port", "io_threads", "reuse_port", "max_body_bytes", "max_unsent_bytes",
         "max_connections", "max_connections_per_address", "max_body_time_ms", "allowed_origins"});
    if (listen.count("host"))
      t.host = r.non_empty_string(listen.at("host"), "listen.host", "a host name or address");
    if (listen.count("port")) t.port = r.port(listen.at("port"), "listen.port");
    if (listen.count("io_threads"))
      t.io_threads = static_cast<int>(r.integer(listen.at("io_threads"), "listen.io_threads", 1,
                                                kMaxIoThreads, io_threads_expected()));
    if (listen.count("reuse_port"))
      t.reuse_port = r.boolean(listen.at("reuse_port"), "listen.reuse_port");
    if (listen.count("max_body_bytes"))
      t.max_body_bytes = static_cast<size_t>(
          r.integer(listen.at("max_body_bytes"), "listen.max_body_bytes", 1,
                    std::numeric_limits<long long>::max(), "a size in bytes >= 1"));
    if (listen.count("max_body_time_ms"))
      t.max_body_time = r.milliseconds(listen.at("max_body_time_ms"), "listen.max_body_time_ms");
    if (listen.count("max_unsent_bytes"))
      t.max_unsent_bytes = r.held_bytes(listen.at("max_unsent_bytes"), "listen.max_unsent_bytes");
    if (listen.count("max_connections"))
      t.max_connections =
          static_cast<size_t>(r.count(listen.at("max_connections"), "listen.max_connections", 1));
    if (listen.count("max_connections_per_address"))
      t.max_connections_per_address = static_cast<size_t>(r.count(
          listen.at("max_connections_per_address"), "listen.max_connections_per_address", 0));
    if (listen.count("allowed_origins")) {
      const YAML::Node& list = listen.at("allowed_origins");
      const char* expected = "a list of origins (https://app.example.com, or \"*\" for any)";
      if (!list.IsSequence()) r.fail("listen.allowed_origins", expected, Reader::describe(list));
      t.allowed_origins.clear();
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string path = at("listen.allowed_origins", i);
        std::string origin = r.non_empty_string(list[i], path, "an origin");
        if (const std::string why = net::allowed_origin_error(origin); !why.empty())
          throw Error(r.where(path) + ": '" + origin + "': " + why);
        t.allowed_origins.push_back(std::move(origin));
      }
    }
  }
  if (has("prefill")) t.prefill = read_pool(r, keys.at("prefill"), "prefill", false);
  if (!has("decode")) r.fail("decode.endpoints", "a list of engines", "nothing");
  t.decode = read_pool(r, keys.at("decode"), "decode", true);
  if (has("mode")) {
    t.mode = parse_mode_as(r.string(keys.at("mode"), "mode", kModes), r.source() + ": mode");
  } else if (t.prefill.endpoints.empty()) {
    t.mode = PdMode::kAggregated;
  } else {
    const bool vllm = t.prefill.dialect == Dialect::kVllm || t.decode.dialect == Dialect::kVllm;
    t.mode = vllm ? PdMode::kSequential : PdMode::kParallel;
  }
  if (has("model"))
    t.model = r.file_path(r.non_empty_string(keys.at("model"), "model", "a model folder"));
  if (has("policy"))
    t.policy = r.non_empty_string(keys.at("policy"), "policy", "a scheduling policy name");
  if (has("served_model_name"))
    t.served_model_name =
        r.non_empty_string(keys.at("served_model_name"), "served_model_name", "a model name");
  if (has("api_keys")) {
    const YAML::Node& list = keys.at("api_keys");
    if (!list.IsSequence()) r.fail("api_keys", "a list of keys", Reader::describe(list));
    for (size_t i = 0; i < list.size(); ++i)
      t.api_keys.push_back(r.non_empty_string(list[i], at("api_keys", i), "a key"));
  }
  if (has("admin_api_key"))
    t.admin_api_key = r.non_empty_string(keys.at("admin_api_key"), "admin_api_key", "a key");
  if (has("metrics_api_key"))
    t.metrics_api_key = r.non_empty_string(keys.at("metrics_api_key"), "metrics_api_key", "a key");
  if (has("engine_api_key"))
    t.engine_api_key = r.non_empty_string(keys.at("engine_api_key"), "engine_api_key", "a key");
  for (auto [key, value] : {std::pair{"max_tokens_limit", &t.max_tokens_limit},
                            std::pair{"default_max_tokens", &t.default_max_tokens}})
    if (has(key))
      *value = r.integer(keys.at(key), key, 0, std::numeric_limits<int32_t>::max(),
                         "a number of tokens >= 0 (0: no limit)");
  if (has("max_queue"))
    t.max_queue = static_cast<size_t>(r.count(keys.at("max_queue"), "max_queue", 1));
  if (has("max_queued_body_bytes"))
    t.max_queued_body_bytes = static_cast<size_t>(
        r.integer(keys.at("max_queued_body_bytes"), "max_queued_body_bytes", 0,
                  std::numeric_limits<long long>::max(), "a size in bytes >= 0 (0: no bound)"));
  if (has("max_answer_bytes"))
    t.max_answer_bytes = r.held_bytes(keys.at("max_answer_bytes"), "max_answer_bytes");
  if (has("prefill_retries"))
    t.prefill_retries = static_cast<int>(r.integer(keys.at("prefill_retries"), "prefill_retries", 0,
                                                   kMaxPrefillRetries, retries_expected()));
  if (has("retry_backoff_ms")) {
    t.retry_backoff.first = r.milliseconds(keys.at("retry_backoff_ms"), "retry_backoff_ms");
    // Given alone, its max follows it (Envoy's: ten times the base), never below the default:
    // `retry_backoff_ms: 2000` must not be refused for a max of 1000 ms it never set.
    if (!has("retry_backoff_max_ms"))
      t.retry_backoff.max = std::clamp(10 * t.retry_backoff.first, RetryBackoff{}.max,
                                       std::chrono::milliseconds(kMaxMilliseconds));
  }
  if (has("retry_backoff_max_ms"))
    t.retry_backoff.max = r.milliseconds(keys.at("retry_backoff_max_ms"), "retry_backoff_max_ms");
  if (has("access_log"))
    t.access_log = r.file_path(r.non_empty_string(keys.at("access_log"), "access_log",
                                                  "a file path or \"-\" (standard output)"));
  if (has("scheduling")) read_scheduling(r, keys.at("scheduling"), t.scheduling);
  if (has("shutdown_timeout"))
    t.shutdown_timeout = std::chrono::milliseconds(std::llround(
        r.number(keys.at("shutdown_timeout"), "shutdown_timeout", 0,
                 static_cast<double>(kMaxMilliseconds) / 1000, shutdown_timeout_expected()) *
        1000));
  if (has("priority_classes"))
    t.priority = read_priority_classes(r, keys.at("priority_classes"), "priority_classes");
  if (has("health")) {
    const auto health =
        r.mapping(keys.at("health"), "health",
                  {"probe_interval_ms", "probe_timeout_ms", "failures_to_eject", "slow_start_ms"});
    if (health.count("probe_interval_ms"))
      t.health.probe_interval =
          r.milliseconds(health.at("probe_interval_ms"), "health.probe_interval_ms");
    if (health.count("probe_timeout_ms"))
      t.health.probe_timeout =
          r.milliseconds(health.at("probe_timeout_ms"), "health.probe_timeout_ms");
    if (health.count("failures_to_eject"))
      t.health.failures_to_eject =
          r.count(health.at("failures_to_eject"), "health.failures_to_eject", 1);
    if (health.count("slow_start_ms"))
      t.health.slow_start = r.milliseconds(health.at("slow_start_ms"), "health.slow_start_ms", 0);
  }
  if (has("timeouts")) {
    const auto timeouts = r.mapping(
        keys.at("timeouts"), "timeouts",
        {"queue_ms", "connect_ms", "prefill_ms", "first_token_ms", "idle_ms", "decode_queue_ms"});
    const std::pair<const char*, std::chrono::milliseconds*> fields[] = {
        {"queue_ms", &t.timeouts.queue},     {"connect_ms", &t.timeouts.connect},
        {"prefill_ms", &t.timeouts.prefill}, {"first_token_ms", &t.timeouts.first_token},
        {"idle_ms", &t.timeouts.idle},       {"decode_queue_ms", &t.timeouts.decode_queue}};
    for (const auto& [key, field] : fields)
      if (timeouts.count(key))
        *field = r.milliseconds(timeouts.at(key), std::string("timeouts.") + key);
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Validation: each check names the key path (as in topology files) of what is wrong.

[[noreturn]] void invalid(const std::string& path, const std::string& expected,
                          const std::string& got) {
  throw Error(path + ": expected " + expected + ", got " + got);
}

// In whole milliseconds, never converting to a finer unit: a field of 10^13 ms is what this
// refuses, and as nanoseconds it would overflow first.
template <class Rep, class Period>
void check_duration(std::chrono::duration<Rep, Period> value, const std::string& path,
                    int64_t min = 1) {
  static_assert(Period::num == 1 && Period::den >= 1000, "milliseconds or finer");
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(value).count();
  if (ms < min || ms > kMaxMilliseconds) invalid(path, duration_expected(min), std::to_string(ms));
}

void check_at_least(long long value, long long min, const std::string& path) {
  if (value < min) invalid(path, "a whole number >= " + std::to_string(min), std::to_string(value));
}

// Whether `dialect` can serve `mode`'s flow; aggregated mode relays requests as they are, which
// every dialect serves.
bool serves(Dialect dialect, PdMode mode) {
  if (dialect == Dialect::kVllm) return mode != PdMode::kParallel;
  if (dialect == Dialect::kSglang) return mode != PdMode::kSequential;
  return true;
}

void validate_pool(Pool& pool, const std::string& path, PdMode mode) {
  check_at_least(pool.max_in_flight, 1, path + ".max_in_flight");
  if (!serves(pool.dialect, mode))
    invalid(path + ".dialect",
            std::string("a dialect that serves ") + mode_name(mode) + " mode (" +
                (mode == PdMode::kSequential ? "auto, tandem or vllm" : "auto, tandem or sglang") +
                ")",
            dialect_name(pool.dialect));
  for (size_t i = 0; i < pool.endpoints.size(); ++i) {
    Endpoint& e = pool.endpoints[i];
    const std::string e_path = at(path + ".endpoints", i);
    if (!valid_host(e.host)) invalid(e_path + ".host", kHostExpected, describe_host(e.host));
    if (e.port == 0) invalid(e_path + ".port", "a port 1..65535", "0");
    check_at_least(e.group, 0, e_path + ".group");
    check_at_least(e.max_in_flight, 0, e_path + ".max_in_flight");
    for (const auto& [key, value] : {std::pair{".kv_events", &e.kv_events},
                                     std::pair{".kv_events_replay", &e.kv_events_replay}})
      if (!value->empty() && !valid_zmq_endpoint(*value))
        invalid(e_path + key, kZmqEndpointExpected, utf8::quote_escaped(*value, kQuotedBytes));
    if (e.name.empty()) e.name = host_port(e);
  }
}

// In P/D modes a request's decode engine must be of its prefill engine's group, so every group
// that has engines in one pool needs engines in the other.
void check_groups(const Pool& from, const std::string& from_path, const Pool& other,
                  const char* other_name) {
  std::set<int> other_groups;
  for (const auto& e : other.endpoints) other_groups.insert(e.group);
  for (size_t i = 0; i < from.endpoints.size(); ++i) {
    const int group = from.endpoints[i].group;
    if (!other_groups.count(group))
      invalid(at(from_path + ".endpoints", i) + ".group",
              std::string("a group that also has a ") + other_name + " engine",
              "group " + std::to_string(group) + ", which has no " + other_name + " engine");
  }
}

}  // namespace

std::chrono::milliseconds RetryBackoff::before(int retry) const {
  // Past 2^20 times `first` every wait is `max` (durations are at most 2^31 - 1 ms): no overflow.
  const int doublings = std::clamp(retry - 1, 0, 20);
  return std::min(first * (int64_t{1} << doublings), max);
}

std::chrono::milliseconds RetryBackoff::jittered(int retry, uint64_t random) const {
  const int64_t whole = before(retry).count();
  const int64_t least = whole / 2;
  return std::chrono::milliseconds(
      least + static_cast<int64_t>(random % static_cast<uint64_t>(whole - least + 1)));
}

Endpoint parse_endpoint(const std::string& text, const std::string& what) {
  return parse_endpoint_as(text, what);
}

Endpoint parse_server_address(const std::string& text, const std::string& what) {
  return parse_endpoint_as(text, what, false);
}

Endpoint parse_endpoint_entry(const std::string& text, const std::string& path) {
  YAML::Node node;
  try {
    node = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(path + ": expected YAML or JSON, got a syntax error: " + e.msg);
  }
  Endpoint e = read_endpoint(Reader(""), node, path);
  if (e.name.empty()) e.name = host_port(e);
  return e;
}

PdMode parse_mode(const std::string& text, const std::string& what) {
  return parse_mode_as(text, what);
}

Dialect parse_dialect(const std::string& text, const std::string& what) {
  return parse_dialect_as(text, what);
}

const char* mode_name(PdMode mode) {
  switch (mode) {
    case PdMode::kAggregated:
      return "aggregated";
    case PdMode::kSequential:
      return "sequential";
    case PdMode::kParallel:
      return "parallel";
  }
  return "unknown";
}

const char* dialect_name(Dialect dialect) {
  switch (dialect) {
    case Dialect::kAuto:
      return "auto";
    case Dialect::kTandem:
      return "tandem";
    case Dialect::kVllm:
      return "vllm";
    case Dialect::kSglang:
      return "sglang";
  }
  return "unknown";
}

Topology parse_topology_yaml(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(source + ":" + std::to_string(e.mark.line + 1) + ":" +
                std::to_string(e.mark.column + 1) +
                ": expected YAML, got a syntax error: " + e.msg);
  }
  const Reader reader(source);
  Topology topology = read_topology(reader, root);
  try {
    validate(topology);
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
  return topology;
}

Topology load_topology(const std::string& path) {
  return parse_topology_yaml(read_file(path), path);
}

PriorityClasses load_priority_classes(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(read_file(path));
  } catch (const YAML::Exception& e) {
    throw Error(path + ":" + std::to_string(e.mark.line + 1) + ":" +
                std::to_string(e.mark.column + 1) +
                ": expected YAML, got a syntax error: " + e.msg);
  }
  // As the topology file's section, or that section alone (classes, default, api_keys at the
  // top): docs/gateway.md shows the section, which a file of its own may copy as it is.
  if (root.IsMap() && root.size() == 1 && root.begin()->first.IsScalar() &&
      root.begin()->first.Scalar() == "priority_classes")
    return read_priority_classes(Reader(path), root.begin()->second, "priority_classes");
  return read_priority_classes(Reader(path), root, "");
}

std::string reload_refusal(const Topology& current, const Topology& next) {
  const auto restart = [](const std::string& what) {
    return "reload cannot change " + what + " (restart the gateway for that)";
  };
  if (next.mode != current.mode) return restart("the mode");
  if (next.prefill.tokens_in != current.prefill.tokens_in) return restart("prefill.tokens_in");
  if (next.decode.tokens_in != current.decode.tokens_in) return restart("decode.tokens_in");
  return {};
}

PolicyOptions policy_options(const Topology& t) {
  PolicyOptions o{t.scheduling.tandem, t.scheduling.cache_aware, t.scheduling.kv_router};
  if (t.priority.enabled()) o.tandem.prefill_deadline_slack = 0;
  return o;
}

void check_key_option(const std::string& value, const std::string& field,
                      const std::string& option) {
  if (value.empty()) invalid(field + " (" + option + ")", "a non-empty key", "an empty key");
}

std::string address_key(const Endpoint& e) {
  std::string key = e.host;
  std::transform(key.begin(), key.end(), key.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return key + ":" + std::to_string(e.port);
}

void validate(Topology& t) {
  if (t.host.empty()) invalid("listen.host", "a host name or address", "nothing");
  // listen.port 0 is allowed: the system picks a free port (tests use that).
  if (t.io_threads < 1 || t.io_threads > kMaxIoThreads)
    invalid("listen.io_threads", io_threads_expected(), std::to_string(t.io_threads));
  if (t.max_body_bytes == 0) invalid("listen.max_body_bytes", "a size in bytes >= 1", "0");
  check_duration(t.max_body_time, "listen.max_body_time_ms");
  for (const auto& [value, path] : {std::pair{t.max_unsent_bytes, "listen.max_unsent_bytes"},
                                    std::pair{t.max_answer_bytes, "max_answer_bytes"}})
    if (value < 1 || value > kMaxHeldBytesLimit)
      invalid(path, held_bytes_expected(), std::to_string(value));
  if (t.max_queue == 0) invalid("max_queue", "a whole number >= 1", "0");
  // `--api-key "$UNSET"`: a guarded-looking gateway must not be meant open.
  for (const std::string& key : t.api_keys)
    if (key.empty()) invalid("api_keys (--api-key)", "non-empty keys", "an empty key");
  if (t.prefill_retries < 0 || t.prefill_retries > kMaxPrefillRetries)
    invalid("prefill_retries", retries_expected(), std::to_string(t.prefill_retries));
  // Every duration, also of topologies built from flags or in code: each ends up in a timer.
  check_duration(t.retry_backoff.first, "retry_backoff_ms");
  check_duration(t.retry_backoff.max, "retry_backoff_max_ms");
  if (t.retry_backoff.max < t.retry_backoff.first)
    invalid(
        "retry_backoff_max_ms",
        "a duration >= retry_backoff_ms (" + std::to_string(t.retry_backoff.first.count()) + " ms)",
        std::to_string(t.retry_backoff.max.count()));
  check_duration(t.health.probe_interval, "health.probe_interval_ms");
  check_duration(t.health.probe_timeout, "health.probe_timeout_ms");
  check_duration(t.health.slow_start, "health.slow_start_ms", 0);
  check_at_least(t.health.failures_to_eject, 1, "health.failures_to_eject");
  check_duration(t.timeouts.queue, "timeouts.queue_ms");
  check_duration(t.timeouts.connect, "timeouts.connect_ms");
  check_duration(t.timeouts.prefill, "timeouts.prefill_ms");
  check_duration(t.timeouts.first_token, "timeouts.first_token_ms");
  check_duration(t.timeouts.idle, "timeouts.idle_ms");
  check_duration(t.timeouts.decode_queue, "timeouts.decode_queue_ms");
  check_duration(t.scheduling.queue.starvation_after, "scheduling.starvation_ms", 0);
  check_duration(t.scheduling.load_interval, "scheduling.load_interval_ms", 0);
  check_duration(t.scheduling.tandem.max_hold, "scheduling.max_hold_ms", 0);
  check_duration(t.scheduling.cache_aware.eviction_interval,
                 "scheduling.cache_aware.eviction_interval_ms");
  if (t.shutdown_timeout.count() < 0 || t.shutdown_timeout.count() > kMaxMilliseconds)
    invalid("shutdown_timeout", shutdown_timeout_expected(),
            std::to_string(t.shutdown_timeout.count()) + " ms");

  if (t.decode.endpoints.empty()) invalid("decode.endpoints", "at least one decode engine", "none");
  const bool pd = t.mode != PdMode::kAggregated;
  if (!pd && !t.prefill.endpoints.empty())
    invalid("prefill.endpoints",
            "no prefill engines in aggregated mode (choose sequential or "
            "parallel mode)",
            std::to_string(t.prefill.endpoints.size()));
  if (pd && t.prefill.endpoints.empty())
    invalid("prefill.endpoints",
            std::string("at least one prefill engine in ") + mode_name(t.mode) + " mode", "none");
  // Name the mismatch between the pools before the mismatch with the mode that follows from it.
  if (pd && ((t.prefill.dialect == Dialect::kVllm && t.decode.dialect == Dialect::kSglang) ||
             (t.prefill.dialect == Dialect::kSglang && t.decode.dialect == Dialect::kVllm)))
    invalid("decode.dialect",
            std::string("a dialect that works with the prefill pool's ") +
                dialect_name(t.prefill.dialect) + " (tandem or " + dialect_name(t.prefill.dialect) +
                ")",
            dialect_name(t.decode.dialect));
  validate_pool(t.prefill, "prefill", t.mode);
  validate_pool(t.decode, "decode", t.mode);

  if (t.mode == PdMode::kParallel) {
    for (size_t i = 0; i < t.prefill.endpoints.size(); ++i)
      if (t.prefill.endpoints[i].bootstrap_port == 0)
        invalid(at("prefill.endpoints", i) + ".bootstrap_port",
                "the engine's bootstrap (KV transfer) port in parallel mode "
                "(HOST:PORT@BOOTSTRAP_PORT)",
                "none");
  }
  if (pd) {
    check_groups(t.decode, "decode", t.prefill, "prefill");
    check_groups(t.prefill, "prefill", t.decode, "decode");
  }

  const auto& classes = t.priority.classes;
  for (size_t i = 0; i < classes.size(); ++i) {
    check_duration(classes[i].max_wait, at("priority_classes.classes", i) + ".max_wait_ms");
    if (classes[i].hold)
      check_duration(*classes[i].hold, at("priority_classes.classes", i) + ".hold_ms", 0);
  }
  for (size_t i = 0; i < classes.size(); ++i)
    for (size_t j = 0; j < i; ++j) {
      const std::string path = at("priority_classes.classes", i);
      if (classes[i].name == classes[j].name)
        invalid(path + ".name", "a class name used once", quoted(classes[i].name) + " twice");
      if (classes[i].priority == classes[j].priority)
        invalid(path + ".priority", "a priority no other class has",
                std::to_string(classes[i].priority) + ", as class " + quoted(classes[j].name));
    }
  if (t.priority.enabled() && t.priority.default_class >= classes.size())
    invalid("priority_classes.default", "a class", "none");
  for (const auto& [key, klass] : t.priority.api_keys) {
    if (klass >= classes.size()) invalid("priority_classes.api_keys", "classes", "none");
    if (!t.api_keys.empty() &&
        std::find(t.api_keys.begin(), t.api_keys.end(), key) == t.api_keys.end())
      invalid("priority_classes.api_keys", "keys the gateway accepts (listed in api_keys)",
              "a key that is not");
  }

  const std::pair<const Pool*, const char*> pools[] = {{&t.prefill, "prefill"},
                                                       {&t.decode, "decode"}};
  // One engine twice in a pool (under two names) would take twice its in-flight limit; the
  // admin API refuses it too (EndpointTable::admission_error). Checked before the names: an
  // engine given twice without names has its default name (HOST:PORT) twice as well, and the
  // error names the url the user wrote rather than a name they did not.
  for (const auto& [pool, name] : pools) {
    std::map<std::string, const Endpoint*> addresses;
    for (size_t i = 0; i < pool->endpoints.size(); ++i) {
      const Endpoint& e = pool->endpoints[i];
      const auto [it, inserted] = addresses.emplace(address_key(e), &e);
      if (!inserted)
        invalid(at(std::string(name) + ".endpoints", i) + ".url",
                std::string("an engine not yet in the ") + name + " pool",
                host_port(e) + " as " + quoted(e.name) + ", which the " + name + " pool has as " +
                    quoted(it->second->name));
    }
  }
  std::map<std::string, std::string> names;  // name -> key path of its endpoint
  for (const auto& [pool, name] : pools) {
    for (size_t i = 0; i < pool->endpoints.size(); ++i) {
      const std::string path = at(std::string(name) + ".endpoints", i);
      const auto [it, inserted] = names.emplace(pool->endpoints[i].name, path);
      if (!inserted)
        invalid(path + ".name", "a name unique in the topology",
                quoted(pool->endpoints[i].name) + ", as " + it->second + " has");
    }
  }
}

}  // namespace tandem::gateway
