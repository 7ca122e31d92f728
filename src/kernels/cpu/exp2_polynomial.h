#pragma once
// 2^f for |f| <= 1/2 as a degree-6 polynomial (relative error below 1.3e-7, under one float32
// ulp), highest power first for Horner's rule. The vector exp2 of the MLA kernel (AVX2 and
// AVX-512) split x = i + f with i = round(x) and add i to the exponent bits of 2^f.
namespace tandem::kernels {

inline constexpr float kExp2Polynomial[7] = {1.5403530393381608e-4f,
                                             1.3333558146428443e-3f,
                                             9.6181291076284772e-3f,
                                             5.5504108664821580e-2f,
                                             2.4022650695910071e-1f,
                                             6.9314718055994531e-1f,
                                             1.0f};

}  // namespace tandem::kernels
