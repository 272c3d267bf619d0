// AMX-BF16 kernels (compiled with the AVX-512 BF16 flags plus -mamx-tile
// -mamx-bf16): a 32 x 32 microkernel on the CPU's tile registers. Four 16 x 16
// float32 accumulator tiles (C), two 16-row tiles of A and two 16-pair tiles
// of B: each tdpbf16ps multiplies a 16 x 32 bfloat16 tile of A by a 32 x 16
// one of B into a C tile, 16 x 16 x 32 multiply-adds in one instruction.
// A block of at most 16 rows (a few tokens of an expert) or 16 columns runs
// only the tiles it fills.
// Used, like the avx512_bf16 kernels, when B (the weight) is bfloat16 or FP8:
// A is rounded to bfloat16 (round to nearest even) as it is packed, FP8 x
// scale too. The tile unit treats bfloat16 subnormals as zero and rounds
// its float32 sums to nearest even whatever MXCSR says.
//
// Panels (packed_kernels.h, pairs mode with k_pad_pairs 16): B's is the
// avx512_bf16 layout [kp][32] pairs, so a 16-column B tile is 16 pair-rows
// read with a stride of 128 bytes; A's is [kp / 16][32][16] pairs, so an A
// tile is 16 rows of 64 contiguous bytes. k is padded with zeros to whole
// tiles (32 values).
#include <cstring>

#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/bf16_rows_avx512.h"
#include "experts/kernels/internal/pack_pairs_avx512.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 32;
constexpr int kNr = 32;
constexpr int kTilePairs = 16;                     // k pairs per tile (32 bfloat16 values)
constexpr int kTileRowBytes = 64;                  // one tile row: 16 pairs or 16 floats
constexpr int kBRowBytes = kNr * 4;                // one pair-row of a B panel
constexpr int kAChunkBytes = kMr * kTileRowBytes;  // one k tile of an A panel

// The tile configuration (palette 1): tiles 0-3 accumulate C, 4-5 hold A,
// 6-7 B; every tile is 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig MakeConfig() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = kTileRowBytes;
    c.rows[t] = 16;
  }
  return c;
}

void BeginTiles() {
  static const TileConfig config = MakeConfig();
  _tile_loadconfig(&config);
}

void EndTiles() { _tile_release(); }

// 16 consecutive rows of column k of a transposed A (row_stride 1), rounded
// to bfloat16 in the low half of each 32-bit lane; zero past `rows` or when
// k is past the block.
__m512i LoadColumnBf16(const Operand& a, int64_t k, bool inside, int64_t row0, int rows) {
  if (!inside || rows <= 0) return _mm512_setzero_si512();
  const __mmask16 mask = rows >= 16 ? __mmask16(0xffff) : __mmask16((1u << rows) - 1);
  const int64_t idx = k * a.col_stride + row0;
  if (a.type == ElemType::kBF16) {
    return _mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(a.data) + idx));
  }
  const __m512 f = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(a.data) + idx);
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f));
}

// A panels from a transposed float32 or bfloat16 A (a weight gradient's dYᵀ
// or xᵀ): each k gives a panel's rows in a run. Per 16 rows and 16 pairs:
// the pairs of those rows as 16 vectors (one per pair), then a 16 x 16
// transpose of 32-bit words gives each row's 16 pairs, one tile row.
void PackATransposed(const Operand& a, int64_t m0, int64_t m_size, int64_t k0, int64_t k_size,
                     void* out) {
  const int64_t panels = (m_size + kMr - 1) / kMr;
  const int64_t chunks = ((k_size + 1) / 2 + kTilePairs - 1) / kTilePairs;
  char* base = static_cast<char*>(out);
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t c = 0; c < chunks; ++c) {
      char* o = base + (p * chunks + c) * kAChunkBytes;
      for (int h = 0; h < kMr; h += 16) {
        const int64_t row0 = p * kMr + h;
        const int rows = static_cast<int>(MinI(16, m_size - row0));
        VecF r[16];
        for (int q = 0; q < kTilePairs; ++q) {
          const int64_t k = 32 * c + 2 * q;
          const __m512i lo = LoadColumnBf16(a, k0 + k, k < k_size, m0 + row0, rows);
          const __m512i hi = LoadColumnBf16(a, k0 + k + 1, k + 1 < k_size, m0 + row0, rows);
          r[q] = _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        Transpose(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(o + (h + j) * kTileRowBytes, r[j]);
      }
    }
  }
}

// A panels (see the top): rows [m0, m0 + m_size) x k [k0, k0 + k_size), rows
// past the block and k past k_size zero. Row-major float32 and bfloat16 A
// (the activations) take vector loads, 32 k-values at a time, transposed
// ones PackATransposed; other layouts and FP8 the scalar loop.
void PackA(const Operand& a, int64_t m0, int64_t m_size, int64_t k0, int64_t k_size, void* out) {
  const int64_t panels = (m_size + kMr - 1) / kMr;
  const int64_t chunks = ((k_size + 1) / 2 + kTilePairs - 1) / kTilePairs;
  const int64_t panel_bytes = chunks * kAChunkBytes;
  char* base = static_cast<char*>(out);
  if (a.col_stride == 1 && (a.type == ElemType::kF32 || a.type == ElemType::kBF16)) {
    for (int64_t p = 0; p < panels; ++p) {
      for (int r = 0; r < kMr; ++r) {
        const int64_t row = p * kMr + r;
        char* o = base + p * panel_bytes + r * kTileRowBytes;
        if (row >= m_size) {
          for (int64_t c = 0; c < chunks; ++c) {
            _mm512_storeu_si512(o + c * kAChunkBytes, _mm512_setzero_si512());
          }
          continue;
        }
        const int64_t src = (m0 + row) * a.row_stride + k0;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t k = 32 * c;
          const int64_t left = k_size - k;  // > 0
          __m512i v;
          if (a.type == ElemType::kBF16) {
            const __mmask32 mask = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
            v = _mm512_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(a.data) + src + k);
          } else {
            const float* f = static_cast<const float*>(a.data) + src + k;
            const __mmask16 lo = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
            const __mmask16 hi = left >= 32  ? __mmask16(0xffff)
                                 : left > 16 ? __mmask16((1u << (left - 16)) - 1)
                                             : __mmask16(0);
            v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, f + 16),
                                             _mm512_maskz_loadu_ps(lo, f));
          }
          _mm512_storeu_si512(o + c * kAChunkBytes, v);
        }
      }
    }
    return;
  }
  if (a.row_stride == 1 && (a.type == ElemType::kF32 || a.type == ElemType::kBF16)) {
    PackATransposed(a, m0, m_size, k0, k_size, out);
    return;
  }
  DispatchType(a.type, [&]<ElemType T>() {
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t c = 0; c < chunks; ++c) {
        auto* o = reinterpret_cast<uint16_t*>(base + p * panel_bytes + c * kAChunkBytes);
        for (int r = 0; r < kMr; ++r) {
          const int64_t row = p * kMr + r;
          for (int j = 0; j < 32; ++j) {
            const int64_t k = 32 * c + j;
            o[r * 32 + j] = row < m_size && k < k_size ? F32ToBf16(ValueAs<T>(a, m0 + row, k0 + k))
                                                       : uint16_t{0};
          }
        }
      }
    }
  });
}

// C tiles 0 and 1 hold rows 0-15 (columns 0-15 and 16-31), 2 and 3 rows
// 16-31. A block of at most 16 rows or 16 columns (a few tokens of an expert,
// the last panel of an odd size) runs only the tiles it has: kRowTiles x
// kColTiles of the four, so it pays no multiplies by padding.
template <int kRowTiles, int kColTiles>
void MicroTiles(int64_t chunks, const char* ap, const char* bp, float* c, int64_t ldc, int rows,
                int cols, bool accumulate) {
  const bool whole = rows == 16 * kRowTiles && cols == 16 * kColTiles;
  const int64_t ldc_bytes = ldc * static_cast<int64_t>(sizeof(float));
  if (whole && accumulate) {
    _tile_loadd(0, c, ldc_bytes);
    if constexpr (kColTiles == 2) _tile_loadd(1, c + 16, ldc_bytes);
    if constexpr (kRowTiles == 2) _tile_loadd(2, c + 16 * ldc, ldc_bytes);
    if constexpr (kRowTiles == 2 && kColTiles == 2) _tile_loadd(3, c + 16 * ldc + 16, ldc_bytes);
  } else {
    _tile_zero(0);
    if constexpr (kColTiles == 2) _tile_zero(1);
    if constexpr (kRowTiles == 2) _tile_zero(2);
    if constexpr (kRowTiles == 2 && kColTiles == 2) _tile_zero(3);
  }
  for (int64_t t = 0; t < chunks; ++t) {
    const char* a = ap + t * kAChunkBytes;
    const char* b = bp + t * kTilePairs * kBRowBytes;
    _tile_loadd(4, a, kTileRowBytes);
    _tile_loadd(6, b, kBRowBytes);
    if constexpr (kColTiles == 2) _tile_loadd(7, b + kTileRowBytes, kBRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kColTiles == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a + 16 * kTileRowBytes, kTileRowBytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kColTiles == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (whole) {
    _tile_stored(0, c, ldc_bytes);
    if constexpr (kColTiles == 2) _tile_stored(1, c + 16, ldc_bytes);
    if constexpr (kRowTiles == 2) _tile_stored(2, c + 16 * ldc, ldc_bytes);
    if constexpr (kRowTiles == 2 && kColTiles == 2) _tile_stored(3, c + 16 * ldc + 16, ldc_bytes);
    return;
  }
  // A partial block: through a buffer, then only its rows x cols.
  alignas(64) float buf[kMr * kNr];
  _tile_stored(0, buf, kBRowBytes);
  if constexpr (kColTiles == 2) _tile_stored(1, buf + 16, kBRowBytes);
  if constexpr (kRowTiles == 2) _tile_stored(2, buf + 16 * kNr, kBRowBytes);
  if constexpr (kRowTiles == 2 && kColTiles == 2) _tile_stored(3, buf + 16 * kNr + 16, kBRowBytes);
  StoreTile<kNr>(buf, c, ldc, rows, cols, accumulate);
}

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  const int64_t chunks = ((k_size + 1) / 2 + kTilePairs - 1) / kTilePairs;
  const char* ap = static_cast<const char*>(a_panel);
  const char* bp = static_cast<const char*>(b_panel);
  if (rows > 16 && cols > 16) {
    MicroTiles<2, 2>(chunks, ap, bp, c, ldc, rows, cols, accumulate);
  } else if (rows > 16) {
    MicroTiles<2, 1>(chunks, ap, bp, c, ldc, rows, cols, accumulate);
  } else if (cols > 16) {
    MicroTiles<1, 2>(chunks, ap, bp, c, ldc, rows, cols, accumulate);
  } else {
    MicroTiles<1, 1>(chunks, ap, bp, c, ldc, rows, cols, accumulate);
  }
}

}  // namespace

const PackedKernels& AmxBf16Kernels() {
  static const PackedKernels k{"amx_bf16",
                               kMr,
                               kNr,
                               /*kb=*/512,
                               /*nb=*/2048,
                               /*mb=*/128,
                               /*pairs=*/true,
                               &PackA,
                               &PackBPairs<kNr, kTilePairs>,
                               &Micro,
                               &SmallRows</*kRoundFp8=*/true>,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2,
                               &ExpSumAvx2,
                               &StoreBf16RowAvx512,
                               /*k_pad_pairs=*/kTilePairs,
                               &BeginTiles,
                               &EndTiles,
                               &ExpandFp8Pairs<kNr, kTilePairs>};
  return k;
}

}  // namespace moefit::experts::kernels::internal
