#include "util/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "util/error.h"
#include "util/utf8.h"

namespace tandem::metrics {
namespace {

bool valid_metric_name(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

// Label names may not contain ':' and names starting with "__" are reserved for Prometheus.
bool valid_label_name(std::string_view name) {
  if (name.empty() || name.starts_with("__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

// Shortest text that parses back to the same double; Prometheus spellings for the specials.
void append_double(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
  } else {
    char buf[64];
    const auto result = std::to_chars(buf, buf + sizeof buf, v);
    out.append(buf, result.ptr);
  }
}

}  // namespace

// Python's repr(float): the shortest round-trip digits, positional with at least one decimal
// ("100000.0", "0.0001") while the decimal exponent is in [-4, 16), else "1e-05", "1.5e+16".
static std::string python_repr(double v) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  const std::string_view sci(buf, size_t(result.ptr - buf));  // "-1.2345e+06"
  const size_t e = sci.find('e');
  const bool negative = sci.front() == '-';
  std::string digits;
  for (char c : sci.substr(negative ? 1 : 0, e - (negative ? 1 : 0)))
    if (c != '.') digits += c;
  int exponent = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exponent);
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp[16];  // room for any int, as -Wformat-truncation asks (a double's exponent has 3)
    std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + exp;
  }
  if (exponent < 0) return out + "0." + std::string(size_t(-exponent - 1), '0') + digits;
  const size_t whole = size_t(exponent) + 1;
  if (digits.size() <= whole) return out + digits + std::string(whole - digits.size(), '0') + ".0";
  return out + digits.substr(0, whole) + "." + digits.substr(whole);
}

// prometheus_client's floatToGoString (utils.py), which writes vLLM's bucket bounds, so queries
// that match le="1.0" or le="100000.0" against vLLM also match Tandem: Python's repr, except
// that a positive value with more than six digits before the point takes Go's exponent form,
// spelt as that function spells it ("1e+06", "2.5e+06", and "1e+015" for 1e15).
std::string format_le(double bound) {
  if (std::isnan(bound)) return "NaN";
  if (std::isinf(bound)) return bound > 0 ? "+Inf" : "-Inf";
  const std::string s = python_repr(bound);
  const size_t dot = s.find('.');
  if (bound <= 0 || dot == std::string::npos || dot <= 6) return s;
  std::string mantissa = s.substr(0, 1) + "." + s.substr(1, dot - 1) + s.substr(dot + 1);
  while (!mantissa.empty() && (mantissa.back() == '0' || mantissa.back() == '.'))
    mantissa.pop_back();
  return mantissa + "e+0" + std::to_string(dot - 1);
}

namespace {

void append_u64(std::string& out, uint64_t v) {
  char buf[24];
  const auto result = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, result.ptr);
}

void append_escaped_label_value(std::string& out, std::string_view value) {
  // The exposition is UTF-8 and a label value may be a client's text: an ill-formed sequence
  // would make a scraper refuse the whole page, so it is U+FFFD, as Python's errors="replace".
  std::string valid;
  if (!utf8::is_valid(value)) {
    valid = utf8::to_valid_lossy(value);
    value = valid;
  }
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out.push_back(c);
    }
  }
}

void append_escaped_help(std::string& out, std::string_view help) {
  for (char c : help) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out.push_back(c);
    }
  }
}

// `{a="x",b="y"` without the closing brace (empty when there are no labels), so histograms can
// append `le` before closing.
std::string open_label_set(const LabelPairs& const_labels, const std::vector<std::string>& names,
                           const std::vector<std::string>& values) {
  std::string out;
  auto add = [&](const std::string& name, const std::string& value) {
    out += out.empty() ? "{" : ",";
    out += name;
    out += "=\"";
    append_escaped_label_value(out, value);
    out += '"';
  };
  for (const auto& [name, value] : const_labels) add(name, value);
  for (size_t i = 0; i < names.size(); ++i) add(names[i], values[i]);
  return out;
}

void append_sample(std::string& out, const std::string& name, const std::string& open_labels,
                   auto&& append_value) {
  out += name;
  if (!open_labels.empty()) {
    out += open_labels;
    out += '}';
  }
  out += ' ';
  append_value(out);
  out += '\n';
}

std::vector<double> checked_bounds(std::vector<double> bounds, std::string_view what) {
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      throw Error(std::string(what) + ": bucket bound " + std::to_string(i) +
                  " must be finite (only a last bound may be +Inf)");
    }
    if (i > 0 && !(bounds[i] > bounds[i - 1])) {
      throw Error(std::string(what) + ": bucket bounds must be strictly increasing (bound " +
                  std::to_string(i) + " is not greater than bound " + std::to_string(i - 1) + ")");
    }
  }
  return bounds;
}

template <class Metric>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<Metric, Gauge>) {
    return "gauge";
  } else if constexpr (std::is_same_v<Metric, Histogram>) {
    return "histogram";
  } else {
    return "counter";
  }
}

}  // namespace

void Counter::inc(double amount) {
  if (!(amount >= 0)) {
    throw Error("counter increment must be non-negative, got " + std::to_string(amount));
  }
  value_.fetch_add(amount, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(checked_bounds(std::move(bounds), "histogram")), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  observe(value, 1);
}

void Histogram::observe(double value, uint64_t times) {
  if (times == 0) return;
  // NaN belongs in no finite bucket (it compares false with every bound; lower_bound would put
  // it in the first): it is counted in the +Inf bucket, and kept out of the sum, which it would
  // make NaN for good.
  const bool nan = std::isnan(value);
  const size_t bucket =
      nan ? bounds_.size()
          : static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                bounds_.begin());
  std::lock_guard lock(mutex_);
  counts_[bucket] += times;
  if (!nan) sum_ += value * static_cast<double>(times);
  count_ += times;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot snap;
  snap.bounds = bounds_;
  snap.cumulative.resize(counts_.size());
  std::lock_guard lock(mutex_);
  uint64_t running = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    running += counts_[i];
    snap.cumulative[i] = running;
  }
  snap.sum = sum_;
  snap.count = count_;
  return snap;
}

template <class Metric>
Family<Metric>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                       LabelPairs const_labels, std::vector<double> bounds)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      const_labels_(std::move(const_labels)),
      bounds_(std::move(bounds)) {}

template <class Metric>
Metric& Family<Metric>::labels(const std::vector<std::string>& values) {
  if (values.size() != label_names_.size()) {
    throw Error("metric " + name_ + ": expected " + std::to_string(label_names_.size()) +
                " label value(s), got " + std::to_string(values.size()));
  }
  std::lock_guard lock(mutex_);
  if (auto it = index_.find(values); it != index_.end()) return *it->second;
  std::unique_ptr<Metric> child;
  if constexpr (std::is_same_v<Metric, Histogram>) {
    child = std::make_unique<Histogram>(bounds_);
  } else {
    child = std::make_unique<Metric>();
  }
  Metric* raw = child.get();
  children_.emplace_back(values, std::move(child));
  index_.emplace(values, raw);
  return *raw;
}

template <class Metric>
bool Family<Metric>::remove(const std::vector<std::string>& values) {
  std::lock_guard lock(mutex_);
  const auto it = index_.find(values);
  if (it == index_.end()) return false;
  const Metric* child = it->second;
  index_.erase(it);
  children_.erase(std::find_if(children_.begin(), children_.end(),
                               [child](const auto& c) { return c.second.get() == child; }));
  return true;
}

template <class Metric>
void Family<Metric>::render_header(std::string& out) const {
  out += "# HELP ";
  out += name_;
  if (!help_.empty()) {
    out += ' ';
    append_escaped_help(out, help_);
  }
  out += "\n# TYPE ";
  out += name_;
  out += ' ';
  out += type_name<Metric>();
  out += '\n';
}

template <class Metric>
void Family<Metric>::render_samples(std::string& out) const {
  std::lock_guard lock(mutex_);
  for (const auto& [values, child] : children_) {
    const std::string labels = open_label_set(const_labels_, label_names_, values);
    if constexpr (std::is_same_v<Metric, Histogram>) {
      const Histogram::Snapshot snap = child->snapshot();
      const std::string bucket_name = name_ + "_bucket";
      for (size_t i = 0; i <= snap.bounds.size(); ++i) {
        std::string bucket_labels = labels.empty() ? "{" : labels + ",";
        bucket_labels += "le=\"";
        bucket_labels += i < snap.bounds.size() ? format_le(snap.bounds[i]) : "+Inf";
        bucket_labels += '"';
        append_sample(out, bucket_name, bucket_labels,
                      [&](std::string& o) { append_u64(o, snap.cumulative[i]); });
      }
      append_sample(out, name_ + "_sum", labels,
                    [&](std::string& o) { append_double(o, snap.sum); });
      append_sample(out, name_ + "_count", labels,
                    [&](std::string& o) { append_u64(o, snap.count); });
    } else if constexpr (std::is_same_v<Metric, IntCounter>) {
      // (The value is read before the lambda: clang 14 cannot capture a structured binding.)
      const auto value = child->value();
      append_sample(out, name_, labels, [&](std::string& o) { append_u64(o, value); });
    } else {
      const auto value = child->value();
      append_sample(out, name_, labels, [&](std::string& o) { append_double(o, value); });
    }
  }
}

template class Family<Counter>;
template class Family<IntCounter>;
template class Family<Gauge>;
template class Family<Histogram>;

Registry::Registry() = default;

Registry::Registry(LabelPairs const_labels) : Registry(std::move(const_labels), nullptr) {}

Registry::Registry(LabelPairs const_labels, std::shared_ptr<RegistryGroup> group)
    : const_labels_(std::move(const_labels)), group_(std::move(group)) {
  std::set<std::string> seen;
  for (const auto& [label, value] : const_labels_) {
    if (!valid_label_name(label)) {
      throw Error("metrics registry: label name \"" + label +
                  "\" is invalid: expected [a-zA-Z_][a-zA-Z0-9_]* not starting with __");
    }
    if (label == "le") {
      throw Error("metrics registry: label name \"le\" is reserved for histogram buckets");
    }
    if (!seen.insert(label).second) {
      throw Error("metrics registry: label name \"" + label + "\" appears twice");
    }
  }
  if (group_) {
    std::lock_guard lock(group_->mutex_);
    group_->members_.push_back(this);
  }
}

Registry::~Registry() {
  // Before the families go: a member's scrape may be rendering them.
  if (group_) {
    std::lock_guard lock(group_->mutex_);
    std::erase(group_->members_, this);
  }
}

template <class Metric>
Family<Metric>& Registry::add_family(std::string name, std::string help,
                                     std::vector<std::string> label_names, LabelPairs const_labels,
                                     std::vector<double> bounds) {
  if (!valid_metric_name(name)) {
    throw Error("metric name \"" + name + "\" is invalid: expected [a-zA-Z_:][a-zA-Z0-9_:]*");
  }
  std::set<std::string> seen;
  auto check_label = [&](const std::string& label) {
    if (!valid_label_name(label)) {
      throw Error("metric " + name + ": label name \"" + label +
                  "\" is invalid: expected [a-zA-Z_][a-zA-Z0-9_]* not starting with __");
    }
    if (std::is_same_v<Metric, Histogram> && label == "le") {
      throw Error("metric " + name + ": label name \"le\" is reserved for histogram buckets");
    }
    if (!seen.insert(label).second) {
      throw Error("metric " + name + ": label name \"" + label + "\" appears twice");
    }
  };
  // The registry's own constant labels come first on every sample.
  const_labels.insert(const_labels.begin(), const_labels_.begin(), const_labels_.end());
  for (const auto& [label, value] : const_labels) check_label(label);
  for (const auto& label : label_names) check_label(label);
  if constexpr (std::is_same_v<Metric, Histogram>) {
    bounds = checked_bounds(std::move(bounds), "metric " + name);
  }

  std::vector<std::string> samples = {name};
  if constexpr (std::is_same_v<Metric, Histogram>) {
    samples.push_back(name + "_bucket");
    samples.push_back(name + "_sum");
    samples.push_back(name + "_count");
  }

  std::lock_guard lock(mutex_);
  for (const auto& sample : samples) {
    if (sample_names_.count(sample)) {
      throw Error("metric " + name + ": the name " + sample + " is already registered");
    }
  }
  sample_names_.insert(samples.begin(), samples.end());
  auto* family = new Family<Metric>(std::move(name), std::move(help), std::move(label_names),
                                    std::move(const_labels), std::move(bounds));
  families_.emplace_back(family);
  return *family;
}

Counter& Registry::counter(std::string name, std::string help, LabelPairs const_labels) {
  return add_family<Counter>(std::move(name), std::move(help), {}, std::move(const_labels), {})
      .labels({});
}

IntCounter& Registry::int_counter(std::string name, std::string help, LabelPairs const_labels) {
  return add_family<IntCounter>(std::move(name), std::move(help), {}, std::move(const_labels), {})
      .labels({});
}

Gauge& Registry::gauge(std::string name, std::string help, LabelPairs const_labels) {
  return add_family<Gauge>(std::move(name), std::move(help), {}, std::move(const_labels), {})
      .labels({});
}

Histogram& Registry::histogram(std::string name, std::string help, std::vector<double> bounds,
                               LabelPairs const_labels) {
  return add_family<Histogram>(std::move(name), std::move(help), {}, std::move(const_labels),
                               std::move(bounds))
      .labels({});
}

Family<Counter>& Registry::counter_family(std::string name, std::string help,
                                          std::vector<std::string> label_names,
                                          LabelPairs const_labels) {
  return add_family<Counter>(std::move(name), std::move(help), std::move(label_names),
                             std::move(const_labels), {});
}

Family<IntCounter>& Registry::int_counter_family(std::string name, std::string help,
                                                 std::vector<std::string> label_names,
                                                 LabelPairs const_labels) {
  return add_family<IntCounter>(std::move(name), std::move(help), std::move(label_names),
                                std::move(const_labels), {});
}

Family<Gauge>& Registry::gauge_family(std::string name, std::string help,
                                      std::vector<std::string> label_names,
                                      LabelPairs const_labels) {
  return add_family<Gauge>(std::move(name), std::move(help), std::move(label_names),
                           std::move(const_labels), {});
}

Family<Histogram>& Registry::histogram_family(std::string name, std::string help,
                                              std::vector<std::string> label_names,
                                              std::vector<double> bounds, LabelPairs const_labels) {
  return add_family<Histogram>(std::move(name), std::move(help), std::move(label_names),
                               std::move(const_labels), std::move(bounds));
}

std::string Registry::render() const {
  if (group_) return group_->render();
  std::string out;
  for (const detail::FamilyBase* family : families()) family->render(out);
  return out;
}

std::vector<const detail::FamilyBase*> Registry::families() const {
  std::lock_guard lock(mutex_);
  std::vector<const detail::FamilyBase*> out;
  out.reserve(families_.size());
  for (const auto& family : families_) out.push_back(family.get());
  return out;
}

std::string RegistryGroup::render() const {
  std::lock_guard lock(mutex_);
  // Each name's families, by member, in the order the names first appear.
  std::vector<std::vector<const detail::FamilyBase*>> by_name;
  std::map<std::string_view, size_t> index;
  for (const Registry* member : members_)
    for (const detail::FamilyBase* family : member->families()) {
      const auto [it, added] = index.try_emplace(family->name(), by_name.size());
      if (added) by_name.emplace_back();
      by_name[it->second].push_back(family);
    }
  std::string out;
  for (const auto& families : by_name) {
    families.front()->render_header(out);
    for (const detail::FamilyBase* family : families) family->render_samples(out);
  }
  return out;
}

const std::vector<double>& vllm_ttft_buckets() {
  static const std::vector<double> buckets = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                              0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                              20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
  return buckets;
}

const std::vector<double>& vllm_tpot_buckets() {
  static const std::vector<double> buckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                              0.3,  0.4,   0.5,  0.75,  1.0, 2.5,  5.0,
                                              7.5,  10.0,  20.0, 40.0,  80.0};
  return buckets;
}

const std::vector<double>& vllm_request_latency_buckets() {
  static const std::vector<double> buckets = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                              5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                              60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  return buckets;
}

const std::vector<double>& vllm_iteration_tokens_buckets() {
  static const std::vector<double> buckets = {1,   8,    16,   32,   64,   128,  256,
                                              512, 1024, 2048, 4096, 8192, 16384};
  return buckets;
}

const std::vector<double>& vllm_n_buckets() {
  static const std::vector<double> buckets = {1, 2, 5, 10, 20};
  return buckets;
}

std::vector<double> buckets_1_2_5(double max_value) {
  std::vector<double> out;
  for (double scale = 1; scale <= max_value; scale *= 10) {
    for (double mantissa : {1.0, 2.0, 5.0}) {
      if (mantissa * scale > max_value) return out;
      out.push_back(mantissa * scale);
    }
  }
  return out;
}

}  // namespace tandem::metrics
