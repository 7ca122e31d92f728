#pragma once
// Which priority class a request belongs to (topology.h PriorityClasses; docs/gateway.md,
// "Priority classes"). A pure function of the classes, the request's `priority` field and its API
// key:
//   - a key mapped to a class puts its requests in that class; a request may ask for a lower
//     class than its key's (a later one in the list), never a higher one;
//   - without a mapped key, the request's `priority` chooses, else the default class;
//   - `priority` is vLLM's integer (it must be one of the classes' priorities) or a class name.
#include <cstddef>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "gateway/topology.h"

namespace tandem::gateway {

// The class's index. `priority`: the request's field (null or absent: none). Throws
// api::ApiError (400, param "priority") for a value that names no class. `classes` must be
// enabled.
size_t request_class(const PriorityClasses& classes, const nlohmann::json& priority,
                     std::string_view api_key);

// Whether an engine should schedule by the requests' priority (`--scheduling-policy priority`):
// every engine when there are classes (each request carries its class's), else an engine that
// computes prompts (prefill, or aggregated) when the policy sets prefill deadlines.
bool engine_schedules_by_priority(const PriorityClasses& classes, const Policy& policy,
                                  bool computes_prompts);

}  // namespace tandem::gateway
