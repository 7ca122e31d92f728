#include "text/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

#include <unicode/uchar.h>

#include "util/utf8.h"

namespace tandem::text::jinja {

// ---- the render budget ----

namespace {
thread_local RenderBudget* current_budget = nullptr;
}  // namespace

RenderBudget::RenderBudget(int64_t max_steps) : max_steps_(max_steps), outer_(current_budget) {
  current_budget = this;
}

int64_t render_step_budget(size_t context_bytes) {
  const int64_t scaled =
      context_bytes > static_cast<size_t>(kMaxRenderSteps / kRenderStepsPerContextByte)
          ? kMaxRenderSteps
          : static_cast<int64_t>(context_bytes) * kRenderStepsPerContextByte;
  return std::clamp(scaled, kBaseRenderSteps, kMaxRenderSteps);
}

size_t json_size(const nlohmann::ordered_json& j) {
  size_t n = 8;
  if (j.is_string()) {
    n += j.get_ref<const std::string&>().size();
  } else if (j.is_array()) {
    for (const auto& e : j) n += json_size(e);
  } else if (j.is_object()) {
    for (const auto& [k, v] : j.items()) n += k.size() + json_size(v);
  }
  return n;
}

RenderBudget::~RenderBudget() {
  current_budget = outer_;
}

void charge_steps(int64_t n) {
  RenderBudget* b = current_budget;
  if (!b) return;
  b->stats_.steps += n;
  if (b->stats_.steps > b->max_steps_)
    throw RuntimeError{"the template exceeded " + std::to_string(b->max_steps_) +
                       " evaluation steps (a runaway loop?)"};
}

void charge_bytes(int64_t n) {
  RenderBudget* b = current_budget;
  if (!b) return;
  b->stats_.bytes += n;
  if (b->stats_.bytes > kMaxRenderBytes)
    throw RuntimeError{"the template built or scanned more than " +
                       std::to_string(kMaxRenderBytes >> 20) +
                       " MiB of strings and lists, the limit of one render (a runaway loop?)"};
}

void charge_items(size_t n) {
  charge_steps(static_cast<int64_t>(n));
  charge_bytes(static_cast<int64_t>(n * sizeof(Value)));
}

// ---- strings ----

Str::Str(std::string text) {
  if (text.empty()) return;
  charge_bytes(static_cast<int64_t>(text.size()));
  buf_ = std::make_shared<Buffer>();
  buf_->text = std::move(text);
  buf_->data = buf_->text.data();
  buf_->size = buf_->text.size();
  len_ = buf_->size;
}

Str::Str(std::string_view text) : Str(std::string(text)) {}

Str Str::concat(const Str& a, std::string_view b) {
  if (b.empty()) return a;
  Str out;
  Buffer* ab = a.buf_.get();
  if (ab && ab->capacity && a.len_ == ab->size && ab->capacity - ab->size >= b.size()) {
    // a ends where its buffer's text ends: write b after it. b may be a view of the same
    // buffer; it lies before `size`, so the ranges do not overlap.
    charge_bytes(static_cast<int64_t>(b.size()));
    std::memcpy(ab->room.get() + ab->size, b.data(), b.size());
    ab->size += b.size();
    out.buf_ = a.buf_;
    out.len_ = ab->size;
    return out;
  }
  const size_t total = a.len_ + b.size();
  // Twice what is needed: a string grown piece by piece is copied O(log n) times in all.
  const size_t capacity = std::max<size_t>(2 * total, 64);
  charge_bytes(static_cast<int64_t>(total));
  auto nb = std::make_shared<Buffer>();
  nb->room = std::make_unique_for_overwrite<char[]>(capacity);
  nb->capacity = capacity;
  nb->data = nb->room.get();
  if (a.len_) std::memcpy(nb->room.get(), a.view().data(), a.len_);
  std::memcpy(nb->room.get() + a.len_, b.data(), b.size());
  nb->size = total;
  out.buf_ = std::move(nb);
  out.len_ = total;
  return out;
}

namespace {

void check_nesting(int depth) {
  if (depth > kMaxNesting)
    throw UnsupportedError{"unsupported lists and dicts nested more than " +
                           std::to_string(kMaxNesting) + " deep"};
}

}  // namespace

int nesting(const Value& v) {
  if (v.kind == Kind::kSequence) return v.seq->depth;
  if (v.kind == Kind::kDict) return v.dict->depth;
  return 0;
}

Value Value::undefined(Str message) {
  Value v;
  v.kind = Kind::kUndefined;
  v.s = std::move(message);
  return v;
}

Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}

Value Value::boolean(bool b) {
  Value v;
  v.kind = Kind::kBool;
  v.b = b;
  v.i = b ? 1 : 0;
  return v;
}

Value Value::integer(int64_t i) {
  Value v;
  v.kind = Kind::kInt;
  v.i = i;
  return v;
}

Value Value::big_integer(uint64_t u) {
  Value v;
  v.kind = Kind::kBigInt;
  v.i = static_cast<int64_t>(u);
  return v;
}

Value Value::floating(double f) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = f;
  return v;
}

Value Value::string(Str s, bool markup) {
  Value v;
  v.kind = Kind::kString;
  v.s = std::move(s);
  v.markup = markup;
  return v;
}

Value Value::list(std::vector<Value> items, SeqKind kind) {
  Value v;
  v.kind = Kind::kSequence;
  charge_items(items.size());
  int depth = 1;
  for (const auto& item : items) depth = std::max(depth, 1 + nesting(item));
  check_nesting(depth);
  v.seq = std::make_shared<Sequence>();
  v.seq->kind = kind;
  v.seq->depth = depth;
  v.seq->items = std::move(items);
  return v;
}

Value Value::tuple(std::vector<Value> items) {
  return list(std::move(items), SeqKind::kTuple);
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return big_integer(u);
      return integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return floating(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value v;
      v.kind = Kind::kDict;
      v.dict = std::make_shared<Dict>();
      v.dict->items.reserve(j.size());
      // JSON object keys are unique strings, so they are appended without a lookup.
      for (const auto& [k, e] : j.items()) v.dict->append(string(k), from_json(e));
      return v;
    }
    default:
      throw UnsupportedError{"unsupported: JSON value in the template context"};
  }
}

bool Value::is_seq(SeqKind k) const {
  return kind == Kind::kSequence && seq->kind == k;
}

double Value::as_double() const {
  if (kind == Kind::kBigInt) return static_cast<double>(big());
  return kind == Kind::kFloat ? f : static_cast<double>(i);
}

const Value* Dict::find(const Value& key) const {
  // A linear search: a step per key passed, so looking every key of a large dict up in a loop
  // over it meets the step budget instead of running quadratically.
  int64_t passed = 0;
  for (const auto& [k, v] : items) {
    if (key.is_string() && k.is_string()) {
      if (k.s.view() == key.s.view()) {
        charge_steps(passed);
        return &v;
      }
    } else if (py_equal(k, key)) {
      charge_steps(passed);
      return &v;
    }
    ++passed;
  }
  charge_steps(passed);
  return nullptr;
}

void Dict::set(Value key, Value value) {
  for (auto& [k, v] : items) {
    charge_steps(1);  // a key passed, as in find
    if (py_equal(k, key)) {
      depth = std::max(depth, 1 + nesting(value));
      check_nesting(depth);
      v = std::move(value);
      return;
    }
  }
  append(std::move(key), std::move(value));
}

void Dict::append(Value key, Value value) {
  depth = std::max({depth, 1 + nesting(key), 1 + nesting(value)});
  check_nesting(depth);
  charge_items(2);
  items.emplace_back(std::move(key), std::move(value));
}

// ---- freeing ----
//
// Freeing a holder frees the values it holds, which may hold more: a chain of namespaces or
// bound methods as long as a template's loop made it. Instead of recursing per link, the first
// holder freed on a thread sweeps: holders freed while it runs hand it what they hold, and it
// frees those one at a time, so the stack stays a link deep however long the chain is.

namespace {

struct Sweep {
  std::vector<Value> values;
  std::vector<std::function<Value(CallArgs&)>> functions;
};
thread_local Sweep* active_sweep = nullptr;

void hand_over(Sweep& sweep, Value& v) {
  if (!(v.seq || v.dict || v.ns || v.fn || v.loop)) return;
  try {
    sweep.values.push_back(std::move(v));
  } catch (const std::bad_alloc&) {
    // Out of memory: freed here, recursing, rather than ending the process from a destructor.
    Value gone = std::move(v);
  }
}

// give(sweep) moves a holder's values into the sweep; the outermost holder then frees them.
template <class Give>
void sweep_out(Give give) {
  if (active_sweep) {
    give(*active_sweep);
    return;
  }
  Sweep sweep;
  active_sweep = &sweep;
  give(sweep);
  while (!sweep.values.empty() || !sweep.functions.empty()) {
    if (!sweep.values.empty()) {
      Value last = std::move(sweep.values.back());
      sweep.values.pop_back();
    } else {
      auto last = std::move(sweep.functions.back());
      sweep.functions.pop_back();
    }
  }
  active_sweep = nullptr;
}

}  // namespace

Sequence::~Sequence() {
  sweep_out([this](Sweep& s) {
    for (auto& v : items) hand_over(s, v);
  });
}

Dict::~Dict() {
  sweep_out([this](Sweep& s) {
    for (auto& [k, v] : items) {
      hand_over(s, k);
      hand_over(s, v);
    }
  });
}

Namespace::~Namespace() {
  sweep_out([this](Sweep& s) {
    for (auto& [name, v] : attrs) hand_over(s, v);
  });
}

Callable::~Callable() {
  sweep_out([this](Sweep& s) {
    try {
      s.functions.push_back(std::move(fn));
    } catch (const std::bad_alloc&) {
      fn = nullptr;  // as in hand_over
    }
  });
}

const Value& LoopInfo::item(size_t k) const {
  return source.seq->items[begin + k];
}

LoopInfo::~LoopInfo() {
  sweep_out([this](Sweep& s) { hand_over(s, source); });
}

// A step per attribute passed, as Dict::find charges: namespace(d) of a large dict makes a
// namespace that long.
const Value* Namespace::find(std::string_view name) const {
  for (const auto& [k, v] : attrs) {
    charge_steps(1);
    if (k == name) return &v;
  }
  return nullptr;
}

void Namespace::set(const std::string& name, Value value) {
  for (auto& [k, v] : attrs) {
    charge_steps(1);
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  attrs.emplace_back(name, std::move(value));
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i != 0;
    case Kind::kBigInt:
      return true;
    case Kind::kFloat:
      return v.f != 0.0;
    case Kind::kString:
      return !v.s.empty();
    case Kind::kSequence:
      // A generator object is always true in Python, even when it will yield nothing.
      return v.seq->kind == SeqKind::kGenerator || !v.seq->items.empty();
    case Kind::kDict:
      return !v.dict->items.empty();
    default:
      return true;
  }
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
    case Kind::kBigInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return v.markup ? "Markup" : "str";
    case Kind::kSequence:
      switch (v.seq->kind) {
        case SeqKind::kList:
          return "list";
        case SeqKind::kTuple:
          return "tuple";
        case SeqKind::kGenerator:
          return "generator";
        case SeqKind::kDictView:
          return "dict_items";
        case SeqKind::kRange:
          return "range";
      }
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
    case Kind::kLoop:
      return "LoopContext";
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  switch (v.kind) {
    case Kind::kNone:
      return "None";
    case Kind::kUndefined:
      return "jinja2.runtime.Undefined object";
    case Kind::kNamespace:
      return "jinja2.utils.Namespace object";
    case Kind::kLoop:
      return "jinja2.runtime.LoopContext object";
    case Kind::kString:
      if (v.markup) return "markupsafe.Markup object";
      return "str object";
    default:
      return type_name(v) + " object";
  }
}

std::u32string to_u32(std::string_view s) {
  // Indexing, slicing and most str methods decode the whole string: `s[i]` in a loop over a
  // long string is that string's size per step.
  charge_bytes(static_cast<int64_t>(4 * s.size()));
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t len = utf8::valid_sequence_length(s, i);
    if (len == 0) throw RuntimeError{"invalid UTF-8 in a template string"};
    out += utf8::decode_at(s, i, len);
    i += len;
  }
  return out;
}

std::string from_u32(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8::append(out, c);
  return out;
}

size_t code_points(std::string_view s) {
  charge_bytes(static_cast<int64_t>(s.size()));
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) {
    size_t len = utf8::valid_sequence_length(s, i);
    if (len == 0) throw RuntimeError{"invalid UTF-8 in a template string"};
    i += len;
  }
  return n;
}

bool py_isspace(char32_t c) {
  // Python's str.isspace(): bidirectional class WS/B/S or category Zs.
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Shortest round-trip digits, then Python's repr layout: exponent form when the decimal
  // point position is <= -4 or > 16, else fixed notation with at least one fractional digit.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (!sci.empty() && sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t epos = sci.find('e');
  std::string mant = sci.substr(0, epos);
  int exp = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits += c;
  }
  int ndigits = static_cast<int>(digits.size());
  int decpt = exp + 1;
  std::string out;
  if (decpt <= -4 || decpt > 16) {
    out = digits.substr(0, 1);
    if (ndigits > 1) out += "." + digits.substr(1);
    int e = decpt - 1;
    out += e < 0 ? "e-" : "e+";
    std::string es = std::to_string(std::abs(e));
    if (es.size() < 2) es = "0" + es;
    out += es;
  } else if (decpt <= 0) {
    out = "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  } else if (decpt < ndigits) {
    out = digits.substr(0, static_cast<size_t>(decpt)) + "." +
          digits.substr(static_cast<size_t>(decpt));
  } else {
    out = digits + std::string(static_cast<size_t>(decpt - ndigits), '0') + ".0";
  }
  return sign + out;
}

namespace {

bool py_isprintable(char32_t c) {
  if (c == ' ') return true;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

std::string hex(uint32_t v, int width) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%0*x", width, v);
  return buf;
}

std::string repr_string(std::string_view s) {
  std::u32string u = to_u32(s);
  bool has_single = u.find(U'\'') != std::u32string::npos;
  bool has_double = u.find(U'"') != std::u32string::npos;
  char32_t quote = has_single && !has_double ? U'"' : U'\'';
  std::string out(1, static_cast<char>(quote));
  for (char32_t c : u) {
    if (c == quote || c == U'\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == U'\t') {
      out += "\\t";
    } else if (c == U'\n') {
      out += "\\n";
    } else if (c == U'\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      out += "\\x" + hex(c, 2);
    } else if (c < 0x7F) {
      out += static_cast<char>(c);
    } else if (!py_isprintable(c)) {
      if (c <= 0xFF) {
        out += "\\x" + hex(c, 2);
      } else if (c <= 0xFFFF) {
        out += "\\u" + hex(c, 4);
      } else {
        out += "\\U" + hex(c, 8);
      }
    } else {
      utf8::append(out, c);
    }
  }
  out += static_cast<char>(quote);
  return out;
}

}  // namespace

namespace {

// A list shared by many lists (`set l = [l, l]` in a loop) prints 2^n times over: every element
// visited is a step of the render, and the text stops at the size of any one string.
void check_built(const std::string& out, const char* what) {
  if (out.size() > kMaxStringBytes)
    throw UnsupportedError{std::string("unsupported ") + what + " beyond 64 MiB"};
}

void repr_into(std::string& out, const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      out += "Undefined";
      return;
    case Kind::kNone:
      out += "None";
      return;
    case Kind::kBool:
      out += v.b ? "True" : "False";
      return;
    case Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Kind::kBigInt:
      out += std::to_string(v.big());
      return;
    case Kind::kFloat:
      out += float_repr(v.f);
      return;
    case Kind::kString:
      if (v.markup) {
        out += "Markup(" + repr_string(v.s) + ")";
      } else {
        out += repr_string(v.s);
      }
      return;
    case Kind::kSequence: {
      const auto& sq = *v.seq;
      if (sq.kind == SeqKind::kGenerator || sq.kind == SeqKind::kDictView ||
          sq.kind == SeqKind::kRange) {
        throw UnsupportedError{"unsupported: printing a " + type_name(v) +
                               " object (Python shows its address or type)"};
      }
      bool tuple = sq.kind == SeqKind::kTuple;
      out += tuple ? "(" : "[";
      for (size_t k = 0; k < sq.items.size(); ++k) {
        charge_steps(1);
        if (k) out += ", ";
        repr_into(out, sq.items[k]);
        check_built(out, "printing a list");
      }
      if (tuple && sq.items.size() == 1) out += ",";
      out += tuple ? ")" : "]";
      return;
    }
    case Kind::kDict: {
      out += "{";
      bool first = true;
      for (const auto& [k, e] : v.dict->items) {
        charge_steps(1);
        if (!first) out += ", ";
        first = false;
        repr_into(out, k);
        out += ": ";
        repr_into(out, e);
        check_built(out, "printing a dict");
      }
      out += "}";
      return;
    }
    default:
      throw UnsupportedError{"unsupported: printing a " + type_name(v) +
                             " object (Python shows its address)"};
  }
}

}  // namespace

std::string py_repr(const Value& v) {
  std::string out;
  repr_into(out, v);
  return out;
}

std::string py_str(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return v.s.str();
    default:
      return py_repr(v);
  }
}

namespace {

// Python compares ints and floats exactly. A long double holds every int64, uint64 and double
// exactly (64-bit mantissa on x86-64, 113 bits on AArch64), so comparing there is exact.
long double exact(const Value& v) {
  if (v.kind == Kind::kFloat) return v.f;
  if (v.kind == Kind::kBigInt) return static_cast<long double>(v.big());
  return static_cast<long double>(v.i);
}

}  // namespace

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_int_like() && b.is_int_like()) return a.i == b.i;
    return exact(a) == exact(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      if (a.s.size() != b.s.size()) return false;
      charge_bytes(static_cast<int64_t>(a.s.size()));  // scanned
      return a.s.view() == b.s.view();
    case Kind::kSequence: {
      if (a.seq == b.seq) return true;
      if (a.seq->kind != b.seq->kind) return false;
      if (a.seq->kind != SeqKind::kList && a.seq->kind != SeqKind::kTuple) return false;
      if (a.seq->items.size() != b.seq->items.size()) return false;
      for (size_t k = 0; k < a.seq->items.size(); ++k) {
        charge_steps(1);
        if (!py_equal(a.seq->items[k], b.seq->items[k])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, e] : a.dict->items) {
        charge_steps(1);
        const Value* other = b.dict->find(k);
        if (!other || !py_equal(e, *other)) return false;
      }
      return true;
    }
    case Kind::kNamespace:
      return a.ns == b.ns;
    case Kind::kCallable:
      return a.fn == b.fn;
    case Kind::kLoop:
      return a.loop == b.loop;
    default:
      return false;
  }
}

bool py_less(const Value& a, const Value& b) {
  if (a.is_undefined()) throw RuntimeError{a.s.str()};
  if (b.is_undefined()) throw RuntimeError{b.s.str()};
  if (a.is_number() && b.is_number()) {
    if (a.is_int_like() && b.is_int_like()) return a.i < b.i;
    return exact(a) < exact(b);
  }
  // UTF-8 byte order = code point order
  if (a.is_string() && b.is_string()) {
    charge_bytes(static_cast<int64_t>(std::min(a.s.size(), b.s.size())));  // scanned
    return a.s.view() < b.s.view();
  }
  if (a.kind == Kind::kSequence && b.kind == Kind::kSequence && a.seq->kind == b.seq->kind &&
      (a.seq->kind == SeqKind::kList || a.seq->kind == SeqKind::kTuple)) {
    const auto& x = a.seq->items;
    const auto& y = b.seq->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      charge_steps(1);
      if (!py_equal(x[k], y[k])) return py_less(x[k], y[k]);
    }
    return x.size() < y.size();
  }
  throw RuntimeError{"'<' not supported between instances of '" + type_name(a) + "' and '" +
                     type_name(b) + "'"};
}

bool py_less_in_sort(const Value& a, const Value& b) {
  charge_steps(1);
  return py_less(a, b);
}

int64_t py_len(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      return static_cast<int64_t>(code_points(v.s));
    case Kind::kSequence:
      if (v.seq->kind == SeqKind::kGenerator) break;
      return static_cast<int64_t>(v.seq->items.size());
    case Kind::kDict:
      return static_cast<int64_t>(v.dict->items.size());
    case Kind::kLoop:
      return static_cast<int64_t>(v.loop->length);
    default:
      break;
  }
  throw RuntimeError{"object of type '" + type_name(v) + "' has no len()"};
}

std::vector<Value> py_iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return {};
    case Kind::kString: {
      const std::u32string chars = to_u32(v.s);
      // One value per character costs ~100x the string; builtins cap lists at 4M items too.
      if (chars.size() > (size_t{1} << 22))
        throw UnsupportedError{"unsupported iterating over a string beyond 4M characters"};
      charge_items(chars.size());  // kept: each character is a new string
      std::vector<Value> out;
      out.reserve(chars.size());
      for (char32_t c : chars) out.push_back(Value::string(from_u32(std::u32string(1, c))));
      return out;
    }
    case Kind::kSequence: {
      auto& sq = *v.seq;
      if (sq.kind == SeqKind::kGenerator) {
        // A generator yields its items once; later iterations see it exhausted.
        charge_steps(static_cast<int64_t>(sq.items.size() - sq.consumed));
        std::vector<Value> out(sq.items.begin() + static_cast<std::ptrdiff_t>(sq.consumed),
                               sq.items.end());
        sq.consumed = sq.items.size();
        return out;
      }
      // A copy for the caller to walk and drop: work, but no memory that stays.
      charge_steps(static_cast<int64_t>(sq.items.size()));
      return sq.items;
    }
    case Kind::kDict: {
      charge_steps(static_cast<int64_t>(v.dict->items.size()));
      std::vector<Value> out;
      out.reserve(v.dict->items.size());
      for (const auto& [k, e] : v.dict->items) out.push_back(k);
      return out;
    }
    default:
      break;
  }
  throw RuntimeError{"'" + type_name(v) + "' object is not iterable"};
}

namespace {

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : to_u32(s)) {
    switch (c) {
      case U'"':
        out += "\\\"";
        continue;
      case U'\\':
        out += "\\\\";
        continue;
      case U'\n':
        out += "\\n";
        continue;
      case U'\r':
        out += "\\r";
        continue;
      case U'\t':
        out += "\\t";
        continue;
      case U'\b':
        out += "\\b";
        continue;
      case U'\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
      if (c >= 0x10000) {
        uint32_t n = c - 0x10000;
        out += "\\u" + hex(0xD800 | ((n >> 10) & 0x3FF), 4);
        out += "\\u" + hex(0xDC00 | (n & 0x3FF), 4);
      } else {
        out += "\\u" + hex(c, 4);
      }
    } else {
      utf8::append(out, c);
    }
  }
  out += '"';
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return float_repr(d);
}

std::string json_key(const Value& k) {
  switch (k.kind) {
    case Kind::kString:
      return k.s.str();
    case Kind::kFloat:
      return json_float(k.f);
    case Kind::kBool:
      return k.b ? "true" : "false";
    case Kind::kNone:
      return "null";
    case Kind::kInt:
      return std::to_string(k.i);
    case Kind::kBigInt:
      return std::to_string(k.big());
    default:
      throw RuntimeError{"keys must be str, int, float, bool or None, not " + type_name(k)};
  }
}

void json_dump(std::string& out, const Value& v, const JsonOptions& o, int level) {
  auto newline = [&](int lvl) {
    out += '\n';
    for (int k = 0; k < lvl; ++k) out += o.indent;
  };
  switch (v.kind) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Kind::kBigInt:
      out += std::to_string(v.big());
      return;
    case Kind::kFloat:
      out += json_float(v.f);
      return;
    case Kind::kString:
      json_string(out, v.s, o.ensure_ascii);
      return;
    case Kind::kSequence: {
      if (v.seq->kind != SeqKind::kList && v.seq->kind != SeqKind::kTuple) break;
      const auto& items = v.seq->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      if (o.has_indent) newline(level + 1);
      for (size_t k = 0; k < items.size(); ++k) {
        charge_steps(1);
        if (k) {
          out += o.item_separator;
          if (o.has_indent) newline(level + 1);
        }
        json_dump(out, items[k], o, level + 1);
        check_built(out, "tojson output");
      }
      if (o.has_indent) newline(level);
      out += ']';
      return;
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](const auto* a, const auto* b) {
          return py_less_in_sort(a->first, b->first);
        });
      }
      out += '{';
      if (o.has_indent) newline(level + 1);
      bool first = true;
      for (const auto* kv : items) {
        charge_steps(1);
        if (!first) {
          out += o.item_separator;
          if (o.has_indent) newline(level + 1);
        }
        first = false;
        json_string(out, json_key(kv->first), o.ensure_ascii);
        out += o.key_separator;
        json_dump(out, kv->second, o, level + 1);
        check_built(out, "tojson output");
      }
      if (o.has_indent) newline(level);
      out += '}';
      return;
    }
    default:
      break;
  }
  throw RuntimeError{"Object of type " + type_name(v) + " is not JSON serializable"};
}

}  // namespace

std::string py_json_dumps(const Value& v, const JsonOptions& options) {
  std::string out;
  json_dump(out, v, options, 0);
  return out;
}

}  // namespace tandem::text::jinja
