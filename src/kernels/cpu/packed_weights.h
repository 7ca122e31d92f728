#pragma once
// The one packed copy of a BF16 or INT8 weight matrix: the blocked layout oneDNN's AVX-512 BF16
// and VNNI GEMMs read (its BA16a64b2a and BA16a64b4a formats of the [cols, rows] operand), which
// the few-token decode kernels (packed_matvec_avx512.h) read too, so the plain rows need not stay
// resident beside it.
//
// Rows come in blocks of 64 (the last one zero-padded); each block holds all columns, in groups of
// `group` consecutive columns (2 for BF16, the pairs vdpbf16ps multiplies; 4 for INT8, the quads of
// vpdpbusd), and a group's 64 rows x `group` values are contiguous. Element (r, c) is at
//   (r / 64) * 64 * cols_padded + (c / group) * 64 * group + (r % 64) * group + c % group,
// so a decode kernel streams one row block front to back, 64 outputs in four vector registers.
#include <cstdint>

#include "util/huge_pages.h"

namespace tandem::kernels {

struct PackedLayout {
  static constexpr int64_t kBlockRows = 64;
  int64_t rows = 0, cols = 0;                // the matrix
  int64_t rows_padded = 0, cols_padded = 0;  // rows to a multiple of 64, columns as oneDNN pads
  int group = 0;                             // columns interleaved per row: 2 (BF16), 4 (INT8)

  int64_t blocks() const { return rows_padded / kBlockRows; }
  int64_t block_elements() const { return kBlockRows * cols_padded; }
  int64_t offset(int64_t r, int64_t c) const {
    return (r / kBlockRows) * block_elements() + (c / group) * kBlockRows * group +
           (r % kBlockRows) * group + c % group;
  }
};

struct PackedWeights {
  PackedLayout layout;
  size_t bytes = 0;
  // On huge pages (decode streams it front to back every token), padding zeroed; a loader's
  // matrices share an arena's mappings (see HugePageArena).
  util::HugePageSlice data;
};

}  // namespace tandem::kernels
