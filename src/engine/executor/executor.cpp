#include "engine/executor/executor.h"

#include "util/error.h"

namespace tandem::engine {

void Executor::stage_expert_placement(const placement::Placement&, std::function<void()>) {
  throw Error("this engine does not place experts (start it with --expert-parallel N)");
}

PlacementSwitch Executor::switch_expert_placement() {
  throw Error("this engine does not place experts");
}

}  // namespace tandem::engine
