#include "gateway/priority.h"

#include <algorithm>
#include <optional>

#include <nlohmann/json.hpp>

#include "api/body_fields.h"
#include "api/error.h"

namespace tandem::gateway {

namespace {

[[noreturn]] void unknown_priority(const PriorityClasses& pc, const std::string& got) {
  std::string values, names;
  for (const auto& c : pc.classes) {
    values += (values.empty() ? "" : ", ") + std::to_string(c.priority);
    names += (names.empty() ? "" : ", ") + c.name;
  }
  throw api::ApiError{400,
                      "priority: expected one of the priority classes' values (" + values +
                          ") or names (" + names + "), got " + got,
                      "priority"};
}

size_t requested_class(const PriorityClasses& pc, const nlohmann::json& priority) {
  if (const std::optional<int64_t> value = api::whole_number_value(priority)) {
    // 1.0 as 1, as the engine reads vLLM's integer priority.
    for (size_t i = 0; i < pc.classes.size(); ++i)
      if (pc.classes[i].priority == *value) return i;
  } else if (priority.is_string()) {
    const auto& name = priority.get_ref<const std::string&>();
    for (size_t i = 0; i < pc.classes.size(); ++i)
      if (pc.classes[i].name == name) return i;
  }
  // Shown as JSON, cut short: the client's own text goes back to it.
  std::string got = priority.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (got.size() > 64) got = got.substr(0, 64) + "...";
  unknown_priority(pc, got);
}

}  // namespace

size_t request_class(const PriorityClasses& pc, const nlohmann::json& priority,
                     std::string_view api_key) {
  const auto mapped = pc.api_keys.find(std::string(api_key));
  const bool asked = !priority.is_null();
  const size_t requested = asked ? requested_class(pc, priority) : pc.default_class;
  if (mapped == pc.api_keys.end()) return requested;
  return asked ? std::max(requested, mapped->second) : mapped->second;
}

bool engine_schedules_by_priority(const PriorityClasses& classes, const Policy& policy,
                                  bool computes_prompts) {
  return classes.enabled() || (computes_prompts && policy.sets_prefill_deadlines());
}

}  // namespace tandem::gateway
