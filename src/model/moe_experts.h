#pragma once
// The feed-forward arithmetic every MoE family shares on CPU: a SwiGLU MLP over a batch of rows,
// and routed experts run over the rows routed to them (one expert per thread, BF16 activations
// where the BF16 GEMM takes them, thread-local buffers so no layer pays page faults), their
// weighted results summed in expert order so the result does not depend on the threads.
#include <cstdint>
#include <utility>
#include <vector>

#include "model/tensor_binder.h"

namespace tandem::model {

// out[n, hidden] = down(silu(gate x) * up x). `xb`: the rows already rounded to BF16 when the BF16
// GEMM takes them (else null; `xn` is then read).
void swiglu(const MlpWeights& w, const float* xn, const uint16_t* xb, int64_t n, float* out);

// out[n, h] = sum over experts e, in order, of weight * experts[e](xn[row]) for each (row, weight)
// of by_expert[e], plus extra[n, h] when given (shared experts).
void routed_experts(const std::vector<MlpWeights>& experts,
                    const std::vector<std::vector<std::pair<int64_t, float>>>& by_expert,
                    const float* xn, int64_t n, int64_t h, const float* extra, float* out);

}  // namespace tandem::model
