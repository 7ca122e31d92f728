#pragma once
// Runtime values of the chat-template interpreter. They model the Python objects a Jinja2
// template sees when transformers renders it (None, bool, int, float, str, list, tuple, dict,
// jinja2's Undefined and Namespace, generators returned by filters such as `select`), because
// printing, comparing and serialising must follow Python's rules exactly.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::text::jinja {

struct Value;
struct Sequence;
struct Dict;
struct Namespace;
struct Callable;
struct LoopInfo;

// Thrown by builtins for Python-level errors (TypeError, UndefinedError, ...); the interpreter
// adds the template line and rethrows it as tandem::Error.
struct RuntimeError {
  std::string message;
};

// A construct Jinja2 accepts but this interpreter does not implement. Raised instead of guessing,
// so a template never renders silently differently from transformers.
struct UnsupportedError {
  std::string message;
};

enum class Kind {
  kUndefined,
  kNone,
  kBool,
  kInt,
  // An integer above INT64_MAX that a request's JSON brought (up to UINT64_MAX, in `i`'s bits; a
  // tool schema's "maximum": 18446744073709551615). It prints and serialises exactly, compares
  // exactly and mixes with floats; integer arithmetic on it is refused (Python would go on).
  kBigInt,
  kFloat,
  kString,
  kSequence,
  kDict,
  kNamespace,
  kCallable,
  kLoop,
};

// Python distinguishes these sequence-like objects when printing, indexing and taking len().
enum class SeqKind {
  kList,
  kTuple,
  kGenerator,  // single-use iterator: truthy even when empty, no len(), prints as an address
  kDictView,   // dict.items()/keys()/values(): has len(), not subscriptable
  kRange,      // range(): indexable like a tuple, printed as "range(a, b)"
};

// The text of a string value. Copies share one immutable buffer, so reading a variable, passing
// a string to a filter or storing it copies a pointer, never the text. A buffer made by
// concatenation keeps spare room at its end, and `a + b` writes b there when a reaches the end
// of what the buffer holds (nothing has been appended after a since): the loop
// `ns.text = ns.text + piece` (DeepSeek-V3's template runs it per system message) then costs
// the piece, not the whole text so far, and doubling the room keeps the copies linear. The bytes
// a Str covers never change and a buffer never moves, so views of them stay valid. Buffers with
// room are made only while a template renders and belong to that render; text from the parser
// (shared by renders on several threads) has none, so it is never written to.
class Str {
 public:
  Str() = default;
  Str(std::string text);       // NOLINT(google-explicit-constructor): any text is a Str
  Str(std::string_view text);  // NOLINT(google-explicit-constructor)
  Str(const char* text) : Str(std::string_view(text)) {}  // NOLINT(google-explicit-constructor)

  std::string_view view() const {
    return buf_ ? std::string_view(buf_->data, len_) : std::string_view();
  }
  operator std::string_view() const { return view(); }  // NOLINT(google-explicit-constructor)
  size_t size() const { return len_; }
  bool empty() const { return len_ == 0; }
  std::string str() const { return std::string(view()); }

  // a + b. Charges the bytes it writes to the render's budget.
  static Str concat(const Str& a, std::string_view b);

 private:
  struct Buffer {
    std::string text;              // what Str(std::string) adopted; never changed
    std::unique_ptr<char[]> room;  // a concatenation's buffer, `capacity` bytes
    const char* data = nullptr;    // text.data() or room.get()
    size_t size = 0;               // bytes written (room) / text.size()
    size_t capacity = 0;           // 0: nothing may be appended in place
  };
  std::shared_ptr<Buffer> buf_;
  size_t len_ = 0;
};

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  // kString: UTF-8 text; kUndefined: the UndefinedError message raised when it is misused.
  Str s;
  // markupsafe.Markup (from `safe`/`escape`): concatenation with plain str escapes the other side.
  bool markup = false;
  std::shared_ptr<Sequence> seq;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Namespace> ns;
  std::shared_ptr<Callable> fn;
  std::shared_ptr<LoopInfo> loop;

  static Value undefined(Str message);
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value big_integer(uint64_t v);  // v > INT64_MAX
  static Value floating(double v);
  static Value string(Str v, bool markup = false);
  static Value list(std::vector<Value> items, SeqKind kind = SeqKind::kList);
  static Value tuple(std::vector<Value> items);
  static Value from_json(const nlohmann::ordered_json& j);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_int_like() const { return kind == Kind::kInt || kind == Kind::kBool; }
  bool is_number() const { return is_int_like() || kind == Kind::kFloat || kind == Kind::kBigInt; }
  uint64_t big() const { return static_cast<uint64_t>(i); }  // kBigInt
  bool is_seq(SeqKind k) const;
  double as_double() const;
};

// Lists and dicts inside each other deeper than this are refused when they are built: printing,
// serialising, comparing and freeing them recurse per level (a loop doing `set l = [l]` would
// otherwise overflow the stack of the thread that renders). Python's own repr and json.dumps
// give up near 1000 levels; requests are parsed 64 levels deep at most.
inline constexpr int kMaxNesting = 512;

// 1 + the deepest list or dict in it; 0 for anything else.
int nesting(const Value& v);

// The objects that hold values free them iteratively (value.cpp, "freeing"): a template can
// chain namespaces, bound methods and loop objects arbitrarily long (the nesting limit counts
// only lists and dicts, which cannot change once built), and freeing such a chain one level
// per call would overflow the stack of the thread that renders.
struct Sequence {
  SeqKind kind = SeqKind::kList;
  std::vector<Value> items;
  size_t consumed = 0;  // generators: items already taken by an earlier iteration
  int depth = 1;
  ~Sequence();
};

struct Dict {
  std::vector<std::pair<Value, Value>> items;
  int depth = 1;
  const Value* find(const Value& key) const;
  void set(Value key, Value value);
  // Appends an entry the caller knows is not there yet.
  void append(Value key, Value value);
  ~Dict();
};

struct Namespace {
  std::vector<std::pair<std::string, Value>> attrs;
  const Value* find(std::string_view name) const;
  void set(const std::string& name, Value value);
  ~Namespace();
};

struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
};

struct Callable {
  std::string name;
  std::function<Value(CallArgs&)> fn;  // a bound method holds its object
  ~Callable();
};

// A for loop walks items [begin, begin + length) of `source`'s sequence: the list, tuple or range
// it loops over, shared rather than copied (lists never change once built), or the items it took
// from anything else (a generator, a dict, a string, a loop with a filter).
struct LoopInfo {
  Value source;
  size_t begin = 0;
  size_t length = 0;
  size_t index0 = 0;
  int depth = 1;
  const Value& item(size_t k) const;
  ~LoopInfo();
};

// ---- what one render may spend ----
//
// Work and memory of one render. A real chat template takes well under 10^6 steps and builds a
// few times its output for a long conversation with tools. Steps are statements executed,
// expressions evaluated, items of lists built or walked and elements visited by comparisons,
// the comparisons sorts make (sort, dictsort, tojson's sort_keys), searches (`in`, count, index,
// unique, dict keys and namespace attributes looked up) and serialisation; bytes are text written
// (concatenations, filters, the output) or scanned (comparisons, `in`, decoding for indexing and
// str methods) plus sizeof(Value) per item of a list or dict built. Bytes count what was allocated
// or read, not what is still alive. Both only grow, so nested loops over range(100000), a list that
// contains itself many times over or a loop that doubles a string stop at an error long before they
// would exhaust the time or the memory of the thread that renders.
//
// The step budget grows with the context, since some real templates are quadratic in the
// conversation: gpt-oss's looks ahead from every assistant message with tool calls through the
// rest (`for future_message in loop_messages[loop.index:]`), ~10.6 n^2 steps for n tool-call
// turns, 10.6M for 1,000. A render may take kBaseRenderSteps, or kRenderStepsPerContextByte per
// byte of its context (render_step_budget, json_size) when that is more, never more than
// kMaxRenderSteps: the most a request can make a render cost, 8-11 s of one thread on this
// project's machine at the 30-45 ns a step of a loop takes there (work that builds values is
// bounded by the bytes, which do not grow: 1 GiB). gpt-oss turns take 30 tokens or more, so the
// ~4,400 that fit its 128K-token context need ~205M steps, within the cap; turns of small
// messages (~220 bytes of context each) get what they need from the context's size up to ~5,300.
inline constexpr int64_t kBaseRenderSteps = 10'000'000;
inline constexpr int64_t kRenderStepsPerContextByte = 256;
inline constexpr int64_t kMaxRenderSteps = 250'000'000;
// The steps a render of a context of `context_bytes` may take (json_size below).
int64_t render_step_budget(size_t context_bytes);
// The size that budget counts: the bytes of the context's strings and keys, plus 8 per value.
size_t json_size(const nlohmann::ordered_json& j);

// What one value of a render may grow to: far beyond any real chat template (a long conversation
// with tool schemas renders a few MB), low enough that a template multiplying or doubling strings
// and lists meets an error instead of exhausting memory. The rendered text has the same cap.
inline constexpr size_t kMaxStringBytes = size_t{1} << 26;    // 64 MiB
inline constexpr size_t kMaxListItems = size_t{1} << 22;      // 4M items
inline constexpr int64_t kMaxRenderBytes = int64_t{1} << 30;  // 1 GiB

struct RenderStats {
  int64_t steps = 0;
  int64_t bytes = 0;
};

// Makes a render's budget the one this thread charges while the object lives (the interpreter
// creates one per render). Without one, charging does nothing.
class RenderBudget {
 public:
  explicit RenderBudget(int64_t max_steps = kBaseRenderSteps);
  ~RenderBudget();
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;
  const RenderStats& stats() const { return stats_; }

 private:
  friend void charge_steps(int64_t n);
  friend void charge_bytes(int64_t n);
  RenderStats stats_;
  int64_t max_steps_;
  RenderBudget* outer_;
};

// Throw RuntimeError naming the limit once the render's total passes it.
void charge_steps(int64_t n);
void charge_bytes(int64_t n);
// n values built into a list: a step and sizeof(Value) bytes each.
void charge_items(size_t n);

// Python semantics.
bool truthy(const Value& v);
std::string type_name(const Value& v);         // Python's type(x).__name__
std::string object_type_repr(const Value& v);  // jinja2.utils.object_type_repr
std::string py_str(const Value& v);            // str(x)
std::string py_repr(const Value& v);           // repr(x)
std::string float_repr(double d);
bool py_equal(const Value& a, const Value& b);
// a < b; throws RuntimeError (TypeError) for unorderable types.
bool py_less(const Value& a, const Value& b);
// py_less as a sort calls it: a step each. A sort of n items makes some n log2 n comparisons
// and builds only n items, so without this a loop of sorts of a long list or dict ran ~log2 n
// times the work its budget allows.
bool py_less_in_sort(const Value& a, const Value& b);
// len(x); throws RuntimeError for objects without a length.
int64_t py_len(const Value& v);
// iter(x) materialised; throws RuntimeError for non-iterables. Consumes generators.
std::vector<Value> py_iterate(const Value& v);

struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // json.dumps indent (an int n means n spaces)
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
// json.dumps(x, ...) as transformers' tojson calls it.
std::string py_json_dumps(const Value& v, const JsonOptions& options);

// UTF-8 <-> code points (Python str indexing is by code point).
std::u32string to_u32(std::string_view s);
std::string from_u32(std::u32string_view s);
size_t code_points(std::string_view s);  // len() of a str
bool py_isspace(char32_t c);

}  // namespace tandem::text::jinja
