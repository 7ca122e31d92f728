#pragma once
// The project's one metrics registry. Engines and the gateway register counters, gauges and
// histograms once at start-up, update them from any thread, and serve `Registry::render()` on
// GET /metrics in the Prometheus text exposition format 0.0.4 (content type `kContentType`).
//
// - Names are used verbatim, so vLLM's names work unchanged (`vllm:num_requests_running`,
//   `vllm:prompt_tokens_total`); by Prometheus convention counter names end in `_total`.
// - Every metric belongs to a family: a name, help text, optional constant labels (rendered on
//   every sample) and label names. A registry may have constant labels of its own, rendered
//   first on every sample of every family (e.g. {gateway_replica="1"} for replicas that share a
//   port, so that their series stay apart). `Family::labels(values)` returns the child for one set
//   of label values, created on first use; the unlabeled helpers (`Registry::counter` ...) return
//   the single child of a family without label names.
// - Registries in one RegistryGroup (replicas of one server in one process, behind one port) are
//   scraped together: each one's render() shows every member's series, whichever replica the
//   scrape reached, as vLLM's API servers merge their processes into one /metrics.
// - Updates are lock-free atomics for counters and gauges and take a per-histogram mutex for
//   histograms (so a scrape always sees `_count` equal to the `+Inf` bucket). Child lookup takes
//   a per-family mutex: keep the returned reference instead of looking it up per event.
// - References stay valid as long as the registry lives, unless their child is removed
//   (`Family::remove`, for series whose subject is gone, e.g. an engine that left the gateway).
// - Bad names, label names, label counts, bucket bounds or negative counter increments throw
//   tandem::Error naming the metric and what was expected.
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::metrics {

// Constant labels: (name, value) pairs in rendering order.
using LabelPairs = std::vector<std::pair<std::string, std::string>>;

// A monotonic counter of a real quantity (seconds, ...).
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;
  // Throws tandem::Error when `amount` is negative or NaN (counters never go down).
  void inc(double amount = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A monotonic counter of whole things (tokens, requests); exact up to 2^64 - 1.
class IntCounter {
 public:
  IntCounter() = default;
  IntCounter(const IntCounter&) = delete;
  IntCounter& operator=(const IntCounter&) = delete;
  void inc(uint64_t amount = 1) { value_.fetch_add(amount, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;
  void set(double value) { value_.store(value, std::memory_order_relaxed); }
  void inc(double amount = 1.0) { value_.fetch_add(amount, std::memory_order_relaxed); }
  void dec(double amount = 1.0) { value_.fetch_sub(amount, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Fixed buckets; a value v falls in the first bucket whose upper bound `le` satisfies v <= le.
// NaN falls in the +Inf bucket only (it compares false with every bound) and is counted, but not
// added to the sum, which it would make NaN for good.
class Histogram {
 public:
  // `bounds`: finite upper bounds in strictly increasing order; a trailing +Inf is accepted and
  // dropped (the +Inf bucket is always there). Throws tandem::Error otherwise.
  explicit Histogram(std::vector<double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void observe(double value);
  // `times` observations of the same value, under one lock.
  void observe(double value, uint64_t times);

  struct Snapshot {
    std::vector<double> bounds;        // finite upper bounds
    std::vector<uint64_t> cumulative;  // bounds.size() + 1 entries; the last is the +Inf bucket
    double sum = 0.0;
    uint64_t count = 0;  // equals cumulative.back()
  };
  Snapshot snapshot() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is the overflow bucket
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

namespace detail {
// What the registry needs from a family of any metric type.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  virtual const std::string& name() const = 0;
  // `# HELP` and `# TYPE`, then the samples.
  void render(std::string& out) const {
    render_header(out);
    render_samples(out);
  }
  virtual void render_header(std::string& out) const = 0;
  virtual void render_samples(std::string& out) const = 0;
};
}  // namespace detail

// All metrics of one name: one child per distinct tuple of label values.
template <class Metric>
class Family final : public detail::FamilyBase {
 public:
  // The child for `values` (one per label name, in order), created on first use. Throws
  // tandem::Error when the number of values differs from the number of label names.
  Metric& labels(const std::vector<std::string>& values);
  // Removes the child for `values` (false if there is none): its series is rendered no more,
  // and a later labels(values) makes a new child starting at 0 (for a counter, a reset, which
  // Prometheus's rate() handles). References to the removed child dangle: call it only once
  // nothing writes to that child any more.
  bool remove(const std::vector<std::string>& values);

  const std::string& name() const override { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  void render_header(std::string& out) const override;
  void render_samples(std::string& out) const override;

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         LabelPairs const_labels, std::vector<double> bounds);

  std::string name_, help_;
  std::vector<std::string> label_names_;
  LabelPairs const_labels_;
  std::vector<double> bounds_;  // histograms only
  mutable std::mutex mutex_;
  // Children in creation order (the rendering order) and an index by label values.
  std::vector<std::pair<std::vector<std::string>, std::unique_ptr<Metric>>> children_;
  std::map<std::vector<std::string>, Metric*> index_;
};

class Registry;

// Registries scraped as one: every member's render() shows the families of all members, merged
// by name (a family's `# HELP` and `# TYPE` once, from the member that registered it first, then
// every member's samples of it, so that its lines stay together as the text format requires).
// Members tell their series apart by their constant labels (gateway_replica); a name must be
// the same kind of metric in every member. Registries join when built with the group and leave
// when destroyed; the group may outlive them.
class RegistryGroup {
 public:
  RegistryGroup() = default;
  RegistryGroup(const RegistryGroup&) = delete;
  RegistryGroup& operator=(const RegistryGroup&) = delete;

 private:
  friend class Registry;
  std::string render() const;

  mutable std::mutex mutex_;              // held while a member is rendered or leaves
  std::vector<const Registry*> members_;  // in joining order
};

class Registry {
 public:
  static constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

  Registry();
  // `const_labels`: on every sample of every family, before the family's own labels. Throws
  // tandem::Error for an invalid or repeated label name; a family that names one of them too
  // is refused when it registers.
  explicit Registry(LabelPairs const_labels);
  // A member of `group` (null: alone) from now until destroyed.
  Registry(LabelPairs const_labels, std::shared_ptr<RegistryGroup> group);
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Metrics without label names. Each registers a family; a name may be registered once (the
  // sample names a histogram adds, `<name>_bucket`, `_sum`, `_count`, count as registered too).
  Counter& counter(std::string name, std::string help, LabelPairs const_labels = {});
  IntCounter& int_counter(std::string name, std::string help, LabelPairs const_labels = {});
  Gauge& gauge(std::string name, std::string help, LabelPairs const_labels = {});
  Histogram& histogram(std::string name, std::string help, std::vector<double> bounds,
                       LabelPairs const_labels = {});

  // Families with label names (e.g. {"finished_reason"}); children are created by labels().
  Family<Counter>& counter_family(std::string name, std::string help,
                                  std::vector<std::string> label_names,
                                  LabelPairs const_labels = {});
  Family<IntCounter>& int_counter_family(std::string name, std::string help,
                                         std::vector<std::string> label_names,
                                         LabelPairs const_labels = {});
  Family<Gauge>& gauge_family(std::string name, std::string help,
                              std::vector<std::string> label_names, LabelPairs const_labels = {});
  Family<Histogram>& histogram_family(std::string name, std::string help,
                                      std::vector<std::string> label_names,
                                      std::vector<double> bounds, LabelPairs const_labels = {});

  // All families in registration order: `# HELP`, `# TYPE`, then one line per sample (children
  // in creation order; histograms as cumulative `_bucket{le=...}` incl. "+Inf", `_sum`, `_count`).
  // In a group: every member's, merged (RegistryGroup).
  std::string render() const;

 private:
  friend class RegistryGroup;
  // The families, in registration order (a family, once registered, lives as long as this).
  std::vector<const detail::FamilyBase*> families() const;

  template <class Metric>
  Family<Metric>& add_family(std::string name, std::string help,
                             std::vector<std::string> label_names, LabelPairs const_labels,
                             std::vector<double> bounds);

  const LabelPairs const_labels_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<detail::FamilyBase>> families_;
  std::set<std::string> sample_names_;  // every sample name in use, to refuse collisions
  const std::shared_ptr<RegistryGroup> group_;
};

// vLLM's default buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger), so dashboards and
// SLO queries written for vLLM read Tandem's histograms unchanged.
// vllm:time_to_first_token_seconds
const std::vector<double>& vllm_ttft_buckets();
// vllm:time_per_output_token_seconds (also used for inter-token latency)
const std::vector<double>& vllm_tpot_buckets();
// vllm:e2e_request_latency_seconds and the queue/prefill/decode/inference time histograms
const std::vector<double>& vllm_request_latency_buckets();
// vllm:iteration_tokens_total (tokens per engine step)
const std::vector<double>& vllm_iteration_tokens_buckets();
// vllm:request_params_n (choices per prompt)
const std::vector<double>& vllm_n_buckets();
// A histogram bound's le="..." text, as prometheus_client (and so vLLM) writes it: "1.0",
// "100000.0", "1e+06", "+Inf".
std::string format_le(double bound);
// 1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's build_1_2_5_buckets, used for
// prompt/generation token counts with max_value = max_model_len).
std::vector<double> buckets_1_2_5(double max_value);

}  // namespace tandem::metrics
