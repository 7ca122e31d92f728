#pragma once
// Python/Jinja2 semantics of operators, attribute and item access (as the immutable sandbox
// performs them), filters, tests, string/dict methods and the globals transformers provides.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "text/jinja/value.h"

namespace tandem::text::jinja {

// raise_exception(message) from a template; surfaces as tandem::Error carrying the message.
struct RaisedError {
  std::string message;
};

// indent and tojson's indent: no template indents by more than a few spaces.
inline constexpr int64_t kMaxIndentWidth = 4096;

bool is_supported_filter(std::string_view name);
bool is_supported_test(std::string_view name);

Value apply_filter(const std::string& name, const Value& input, CallArgs& args);
bool apply_test(const std::string& name, const Value& value, CallArgs& args);

// environment.getattr / environment.getitem of jinja2's ImmutableSandboxedEnvironment.
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
// Where obj[start:stop:step] takes consecutive items of a list, tuple or range (step 1 or none):
// true, with the first item's index and the number of items; false for other objects and steps.
// Bad indices raise as get_slice raises them.
bool contiguous_slice(const Value& obj, const Value& start, const Value& stop, const Value& step,
                      size_t& begin, size_t& count);

Value binary_op(const std::string& op, const Value& a, const Value& b);
Value negate(const Value& v);
Value unary_plus(const Value& v);
// `item in container`
bool contains(const Value& container, const Value& item);
Value call_value(const Value& callee, CallArgs& args);

// Jinja2's default globals plus transformers' raise_exception and strftime_now. Returns false
// when `name` is not a global.
bool lookup_global(const std::string& name, Value& out);

}  // namespace tandem::text::jinja
