// FP8 weights streamed through per-block lookup tables (compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vbmi -mfma -mf16c); see
// internal/fp8_tables.h for why.
//
// A table holds, for one scale block, the bfloat16 of each byte value below
// 128 as two byte planes (low and high byte), 128 entries each in two
// registers. A byte with the sign bit set stands for the negated value of the
// byte without it (e4m3 is sign and magnitude, and rounding to nearest even
// is symmetric), so its bfloat16 is the table's with the sign bit flipped --
// except the NaN byte 0xff, which must give 0x7f's NaN, as the decoder does.
// Decoding 64 weight bytes: one vpermt2b per plane looks each byte up by its
// low 7 bits, one masked byte add flips the sign of the high bytes of the
// negative non-NaN ones; then four vpermt2b lay the two planes' bytes into the
// upper half of each float32 lane, a bfloat16 widened exactly. Six byte
// permutes and two other instructions per 64 elements, where the arithmetic
// decoder takes about 12 instructions per 16.
//
// The loops are SmallRows<true>'s (pack_x86.h), reordered so that one table
// serves a run of its block, with each element of C still summed in the same
// order: along k in 16-lane partial sums reduced at the end (k-contiguous B),
// or one float32 sum per element in k order (n-contiguous B).
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include <cstring>
#include <vector>

#include "experts/kernels/internal/fp8_tables.h"
#include "experts/kernels/internal/pack_x86.h"

namespace moefit::experts::kernels::internal {
namespace {

struct alignas(64) Fp8Table {
  uint8_t lo[128];  // bits 16-23 of the float32 of byte v's bfloat16
  uint8_t hi[128];  // bits 24-31
};

// Byte v's entry is RoundBf16F(LoadF8(v, scale)), the value SmallRows<true>
// multiplies by, made by those functions: the NaN byte, subnormals and any
// scale give its bits. RoundBf16F clears the low 16 bits, so the two planes
// hold the whole float.
void MakeTable(float scale, Fp8Table* t) {
  alignas(64) uint8_t bytes[128];
  for (int v = 0; v < 128; ++v) bytes[v] = static_cast<uint8_t>(v);
  for (int q = 0; q < 8; ++q) {
    const __m512i bits = _mm512_castps_si512(RoundBf16F(LoadF8(bytes, 16 * q, scale)));
    _mm_store_si128(reinterpret_cast<__m128i*>(t->lo + 16 * q),
                    _mm512_cvtepi32_epi8(_mm512_srli_epi32(bits, 16)));
    _mm_store_si128(reinterpret_cast<__m128i*>(t->hi + 16 * q),
                    _mm512_cvtepi32_epi8(_mm512_srli_epi32(bits, 24)));
  }
}

// The tables of every scale block that a call's k_size x n of B touches.
class Tables {
 public:
  void Make(const Operand& b, int64_t k_size, int64_t n) {
    const int64_t num_kb = (k_size + kScaleBlock - 1) / kScaleBlock;
    num_jb_ = (n + kScaleBlock - 1) / kScaleBlock;
    if (static_cast<int64_t>(tables_.size()) < num_kb * num_jb_) tables_.resize(num_kb * num_jb_);
    for (int64_t kb = 0; kb < num_kb; ++kb) {
      for (int64_t jb = 0; jb < num_jb_; ++jb) {
        MakeTable(Scale<ElemType::kF8E4M3>(b, kb * kScaleBlock, jb * kScaleBlock),
                  &tables_[kb * num_jb_ + jb]);
      }
    }
  }
  // The table of element (k, j)'s block.
  const Fp8Table& At(int64_t k, int64_t j) const {
    return tables_[(k / kScaleBlock) * num_jb_ + j / kScaleBlock];
  }

 private:
  std::vector<Fp8Table> tables_;
  int64_t num_jb_ = 0;
};

// One table in registers.
struct Planes {
  __m512i lo[2], hi[2];
};

inline Planes LoadPlanes(const Fp8Table& t) {
  Planes p;
  for (int r = 0; r < 2; ++r) {
    p.lo[r] = _mm512_load_si512(t.lo + 64 * r);
    p.hi[r] = _mm512_load_si512(t.hi + 64 * r);
  }
  return p;
}

// Output lane l of vector q takes the planes' bytes of element 16q + l into
// its bytes 2 and 3 (vpermt2b's index bit 6 picks the second source, hi);
// bytes 0 and 1 are zeroed by kUpperHalves.
struct Spread {
  __m512i idx[4];
};
constexpr __mmask64 kUpperHalves = 0xccccccccccccccccull;

Spread MakeSpread() {
  alignas(64) uint8_t b[4][64] = {};
  for (int q = 0; q < 4; ++q) {
    for (int l = 0; l < 16; ++l) {
      b[q][4 * l + 2] = static_cast<uint8_t>(16 * q + l);
      b[q][4 * l + 3] = static_cast<uint8_t>(64 + 16 * q + l);
    }
  }
  Spread s;
  for (int q = 0; q < 4; ++q) s.idx[q] = _mm512_load_si512(b[q]);
  return s;
}

// 64 bytes x looked up in both planes: the low and the high byte of each
// one's bfloat16. vpermt2b reads an index's low 7 bits only; the bytes
// 0x80-0xfe, negative as int8 and below -1 (0xff), get the sign flipped.
struct Looked {
  __m512i lo, hi;
};
inline Looked LookUpBytes(const Planes& p, __m512i x) {
  const __mmask64 negative = _mm512_cmplt_epi8_mask(x, _mm512_set1_epi8(-1));
  const __m512i hi = _mm512_permutex2var_epi8(p.hi[0], x, p.hi[1]);
  return {_mm512_permutex2var_epi8(p.lo[0], x, p.lo[1]),
          _mm512_mask_add_epi8(hi, negative, hi, _mm512_set1_epi8(-128))};
}

// Elements 16q.. 16q + 15 of the 64 looked up, as float32 weights.
inline __m512 Widen(const Looked& v, const Spread& s, int q) {
  return _mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(kUpperHalves, v.lo, s.idx[q], v.hi));
}

// Runs fn.template operator()<kNv>() for the kNv = run / 16 vectors of a run
// of 16 to 64 elements: the loops over them unrolled, their registers named.
template <typename Fn>
inline void WithVectors(int64_t run, const Fn& fn) {
  switch (run / kVl) {
    case 4:
      fn.template operator()<4>();
      break;
    case 3:
      fn.template operator()<3>();
      break;
    case 2:
      fn.template operator()<2>();
      break;
    default:
      fn.template operator()<1>();
      break;
  }
}

// The first `bytes` (at most 64) bytes at p, the rest zero.
inline __m512i LoadBytes(const uint8_t* p, int64_t bytes) {
  if (bytes >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((1ull << bytes) - 1, p);
}

// A's rows as float32 (its values exactly), laid out so that one pointer
// and constant offsets reach every row: the loops below then keep their
// registers for the table, the weights and the sums.
//   k-contiguous B: [k / 16][kM][16], the 16-lane vectors of all rows of one
//     k step side by side (the whole vectors only; tails read A itself);
//   n-contiguous B: [k][kM], the values the rows broadcast at one k.
template <int kM, ElemType TA>
const float* VectorsOfA(const Operand& a, int64_t k_size, std::vector<float>& buf) {
  const int64_t steps = k_size / kVl;
  if (static_cast<int64_t>(buf.size()) < steps * kM * kVl) buf.resize(steps * kM * kVl);
  for (int64_t v = 0; v < steps; ++v) {
    for (int i = 0; i < kM; ++i) {
      StoreF(buf.data() + (v * kM + i) * kVl, LoadF<TA>(a.data, i * a.row_stride + v * kVl));
    }
  }
  return buf.data();
}
template <int kM, ElemType TA>
const float* ValuesOfA(const Operand& a, int64_t k_size, std::vector<float>& buf) {
  if (static_cast<int64_t>(buf.size()) < k_size * kM) buf.resize(k_size * kM);
  for (int64_t k = 0; k < k_size; ++k) {
    for (int i = 0; i < kM; ++i) buf[k * kM + i] = ValueAs<TA>(a, i, k);
  }
  return buf.data();
}

// B(k, j) = data[j * col_stride + k]: StreamColumns' sums for kC columns
// [j0, j0 + kC) of one scale block, 64 k values of a column decoded at once;
// xv from VectorsOfA.
template <int kM, int kC, ElemType TA>
void Columns(int64_t j0, int64_t k_size, const float* xv, const Operand& a, const Operand& b,
             const Output& c, bool accumulate, const Tables& tables, const Spread& s) {
  const auto* bytes = static_cast<const uint8_t*>(b.data);
  const int64_t k_full = k_size / kVl * kVl;
  VecF acc[kM][kC];
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kC; ++j) acc[i][j] = ZeroF();
  for (int64_t kb = 0; kb < k_full; kb += kScaleBlock) {
    const Planes p = LoadPlanes(tables.At(kb, j0));
    const int64_t kb_end = MinI(kb + kScaleBlock, k_full);
    for (int64_t k = kb; k < kb_end; k += 64) {
      const int64_t run = MinI(64, kb_end - k);
      const float* x = xv + k * kM;  // the vectors of step k / 16
      WithVectors(run, [&]<int kNv>() {
#pragma GCC unroll 4
        for (int j = 0; j < kC; ++j) {
          const uint8_t* col = bytes + (j0 + j) * b.col_stride + k;
          _mm_prefetch(reinterpret_cast<const char*>(col + kC * b.col_stride), _MM_HINT_T0);
          const Looked v = LookUpBytes(p, LoadBytes(col, run));
#pragma GCC unroll 4
          for (int q = 0; q < kNv; ++q) {
            const VecF w = Widen(v, s, q);
#pragma GCC unroll 8
            for (int i = 0; i < kM; ++i) {
              acc[i][j] = FmaF(LoadPlainF(x + (q * kM + i) * kVl), w, acc[i][j]);
            }
          }
        }
      });
    }
  }
  StoreColumns<kM, kC, true, TA, ElemType::kF8E4M3>(j0, k_full, k_size, a, b, c, accumulate, acc);
}

template <int kM, ElemType TA>
void KContiguous(int64_t n, int64_t k_size, const Operand& a, const Operand& b, const Output& c,
                 bool accumulate, const Tables& tables, const Spread& s) {
  // Sums, table and spread within the 32 vector registers. More columns at
  // once keep more independent sums and weight rows in flight, up to where
  // the registers run out (benchmarks/README.md gives the measurements
  // behind the counts).
  constexpr int kC = kM <= 2 ? 8 : kM <= 4 ? 4 : 2;
  thread_local std::vector<float> buf;
  const float* xv = VectorsOfA<kM, TA>(a, k_size, buf);
  for (int64_t jb = 0; jb < n; jb += kScaleBlock) {
    const int64_t end = MinI(jb + kScaleBlock, n);
    int64_t j = jb;
    for (; j + kC <= end; j += kC) {
      Columns<kM, kC, TA>(j, k_size, xv, a, b, c, accumulate, tables, s);
    }
    for (; j < end; ++j) Columns<kM, 1, TA>(j, k_size, xv, a, b, c, accumulate, tables, s);
  }
}

// B(k, j) = data[k * row_stride + j]: AddRows' sums, kK rows k0.. (of one
// scale block) added into acc[i][0, width) for the columns j0.. of a strip
// (j0 a multiple of the scale block, width of vectors), 64 columns of a row
// decoded at once; xs from ValuesOfA.
template <int kM, int kK>
inline void AddRowsByTables(int64_t k0, int64_t j0, int64_t width, const float* xs,
                            const Operand& b, float* acc, int64_t acc_stride, const Tables& tables,
                            const Spread& s) {
  const float* x = xs + k0 * kM;
  const uint8_t* rows = static_cast<const uint8_t*>(b.data) + k0 * b.row_stride + j0;
  for (int64_t jb = 0; jb < width; jb += kScaleBlock) {
    const Planes p = LoadPlanes(tables.At(k0, j0 + jb));
    const int64_t jb_end = MinI(jb + kScaleBlock, width);
    for (int64_t j = jb; j < jb_end; j += 64) {
      const int64_t run = MinI(64, jb_end - j);
      WithVectors(run, [&]<int kNv>() {
        Looked v[kK];
#pragma GCC unroll 4
        for (int kk = 0; kk < kK; ++kk) {
          _mm_prefetch(reinterpret_cast<const char*>(rows + (kK + kk) * b.row_stride + j),
                       _MM_HINT_T0);
          v[kk] = LookUpBytes(p, LoadBytes(rows + kk * b.row_stride + j, run));
        }
#pragma GCC unroll 4
        for (int q = 0; q < kNv; ++q) {
          VecF w[kK];
#pragma GCC unroll 4
          for (int kk = 0; kk < kK; ++kk) w[kk] = Widen(v[kk], s, q);
#pragma GCC unroll 8
          for (int i = 0; i < kM; ++i) {
            float* dst = acc + i * acc_stride + j + kVl * q;
            VecF sum = LoadPlainF(dst);
#pragma GCC unroll 4
            for (int kk = 0; kk < kK; ++kk) sum = FmaF(SetF(x[kk * kM + i]), w[kk], sum);
            StoreF(dst, sum);
          }
        }
      });
    }
  }
}

template <int kM, ElemType TA>
void NContiguous(int64_t n, int64_t k_size, const Operand& a, const Operand& b, const Output& c,
                 bool accumulate, const Tables& tables, const Spread& s) {
  // kM rows of C for a strip in 16 KiB of L1, the strip whole scale blocks.
  constexpr int64_t kStrip = 4096 / kM / kScaleBlock * kScaleBlock > kScaleBlock
                                 ? 4096 / kM / kScaleBlock * kScaleBlock
                                 : kScaleBlock;
  thread_local std::vector<float> buf;
  const float* xs = ValuesOfA<kM, TA>(a, k_size, buf);
  SumStrips<kM, kStrip, true, TA, ElemType::kF8E4M3>(
      n, k_size, a, b, c, accumulate,
      [&]<int kK>(int64_t k, int64_t j0, int64_t width, float(&acc)[kM][kStrip]) {
        AddRowsByTables<kM, kK>(k, j0, width, xs, b, &acc[0][0], kStrip, tables, s);
      });
}

// Output byte 2w of vector h takes plane lo's byte 32h + w, byte 2w + 1
// plane hi's: the bfloat16 words of the 64 looked-up bytes, in their order.
struct Interleave {
  __m512i idx[2];
};

Interleave MakeInterleave() {
  alignas(64) uint8_t b[2][64];
  for (int h = 0; h < 2; ++h) {
    for (int w = 0; w < 32; ++w) {
      b[h][2 * w] = static_cast<uint8_t>(32 * h + w);
      b[h][2 * w + 1] = static_cast<uint8_t>(64 + 32 * h + w);
    }
  }
  return {{_mm512_load_si512(b[0]), _mm512_load_si512(b[1])}};
}

}  // namespace

void ExpandFp8PairsByTables(int k_pad_pairs, const uint8_t* compact, const Operand& b, int64_t k0,
                            int64_t k_size, int64_t n0, int64_t n_size, void* out) {
  constexpr int64_t kNr = 32;  // a pair-row: 32 columns x 2 bytes, one 64-byte vector
  const int64_t kp = k_size / 2;
  const int64_t kp_padded = (kp + k_pad_pairs - 1) / k_pad_pairs * k_pad_pairs;
  // The tables of the scale blocks from (k0, the block holding column n0).
  const int64_t j_base = n0 / kScaleBlock * kScaleBlock;
  Operand from = b;
  from.scales +=
      (k0 / kScaleBlock) * b.scale_row_stride + (j_base / kScaleBlock) * b.scale_col_stride;
  thread_local Tables tables;
  tables.Make(from, k_size, n0 + n_size - j_base);
  const Interleave mix = MakeInterleave();
  for (int64_t p = 0; p < (n_size + kNr - 1) / kNr; ++p) {
    const uint8_t* in = compact + p * kp_padded * kNr * 2;
    auto* o = static_cast<uint8_t*>(out) + p * kp_padded * kNr * 4;
    // A scale block is 64 pair-rows.
    for (int64_t q0 = 0; q0 < kp; q0 += kScaleBlock / 2) {
      const Planes planes = LoadPlanes(tables.At(2 * q0, n0 + p * kNr - j_base));
      const int64_t q_end = MinI(q0 + kScaleBlock / 2, kp);
      for (int64_t q = q0; q < q_end; ++q) {
        // 8 KiB ahead: far enough for packs in memory to arrive in time,
        // near enough not to evict what the next pair-rows need.
        _mm_prefetch(reinterpret_cast<const char*>(in + (q + 128) * kNr * 2), _MM_HINT_T0);
        const Looked v = LookUpBytes(planes, _mm512_loadu_si512(in + q * kNr * 2));
        _mm512_storeu_si512(o + q * kNr * 4, _mm512_permutex2var_epi8(v.lo, mix.idx[0], v.hi));
        _mm512_storeu_si512(o + q * kNr * 4 + 64, _mm512_permutex2var_epi8(v.lo, mix.idx[1], v.hi));
      }
    }
    std::memset(o + kp * kNr * 4, 0, (kp_padded - kp) * kNr * 4);
  }
}

int64_t PackFp8PairsByTables(int k_pad_pairs, const Operand& b, int64_t k0, int64_t k_size,
                             int64_t n0, int64_t panels, void* out) {
  constexpr int64_t kNr = 32;
  const bool n_contiguous = b.col_stride == 1;
  if (b.type != ElemType::kF8E4M3 || panels <= 0 || n0 % kNr != 0 || k0 % 2 != 0) return 0;
  if (!n_contiguous && (b.row_stride != 1 || k0 % 64 != 0)) return 0;
  const int64_t k_done = n_contiguous ? k_size / 2 * 2 : k_size / 64 * 64;
  if (k_done == 0) return 0;
  const int64_t kp = (k_size + 1) / 2;
  const int64_t kp_padded = (kp + k_pad_pairs - 1) / k_pad_pairs * k_pad_pairs;
  // The tables of the scale blocks from the one holding (k0, n0).
  const int64_t k_base = k0 / kScaleBlock * kScaleBlock;
  const int64_t j_base = n0 / kScaleBlock * kScaleBlock;
  Operand from = b;
  from.scales +=
      (k_base / kScaleBlock) * b.scale_row_stride + (j_base / kScaleBlock) * b.scale_col_stride;
  thread_local Tables tables;
  tables.Make(from, k0 + k_size - k_base, n0 + panels * kNr - j_base);
  const Interleave mix = MakeInterleave();
  const auto* bytes = static_cast<const uint8_t*>(b.data);
  // n-contiguous: byte 2c of the permuted vector is row k's column c, byte
  // 2c + 1 row k + 1's -- the compact packs' pair-row order.
  alignas(64) uint8_t order[64];
  for (int c = 0; c < 32; ++c) {
    order[2 * c] = static_cast<uint8_t>(c);
    order[2 * c + 1] = static_cast<uint8_t>(64 + c);
  }
  const __m512i pairs = _mm512_load_si512(order);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t col0 = n0 + p * kNr;
    auto* o = static_cast<uint8_t*>(out) + p * kp_padded * kNr * 4;
    if (n_contiguous) {
      for (int64_t q = 0; 2 * q < k_done;) {
        // One scale block's pair-rows (k0 is even, so no pair straddles two).
        const int64_t k_block = k0 + 2 * q - k_base;
        const Planes planes = LoadPlanes(tables.At(k_block, col0 - j_base));
        const int64_t q_end =
            MinI(k_done, k_block / kScaleBlock * kScaleBlock + kScaleBlock + k_base - k0) / 2;
        for (; q < q_end; ++q) {
          const uint8_t* row = bytes + (k0 + 2 * q) * b.row_stride + col0;
          const __m512i even =
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
          const __m512i odd = _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b.row_stride)));
          const Looked v = LookUpBytes(planes, _mm512_permutex2var_epi8(even, pairs, odd));
          _mm512_storeu_si512(o + q * kNr * 4, _mm512_permutex2var_epi8(v.lo, mix.idx[0], v.hi));
          _mm512_storeu_si512(o + q * kNr * 4 + 64,
                              _mm512_permutex2var_epi8(v.lo, mix.idx[1], v.hi));
        }
      }
      continue;
    }
    for (int64_t k = 0; k < k_done; k += 64) {
      const Planes planes = LoadPlanes(tables.At(k0 + k - k_base, col0 - j_base));
      for (int64_t v = 0; v < kNr; v += 16) {
        // Column j's 64 values as 32 bfloat16 pairs: pairs 0-15 in first[j],
        // 16-31 in second[j]; transposed, vector t holds pair t of all 16.
        VecF first[16], second[16];
        for (int j = 0; j < 16; ++j) {
          const uint8_t* col = bytes + (col0 + v + j) * b.col_stride + k0 + k;
          const Looked w = LookUpBytes(planes, _mm512_loadu_si512(col));
          first[j] = _mm512_castsi512_ps(_mm512_permutex2var_epi8(w.lo, mix.idx[0], w.hi));
          second[j] = _mm512_castsi512_ps(_mm512_permutex2var_epi8(w.lo, mix.idx[1], w.hi));
        }
        Transpose(first);
        Transpose(second);
        auto* pair_rows = reinterpret_cast<float*>(o) + (k / 2) * kNr + v;
        for (int t = 0; t < 16; ++t) {
          _mm512_storeu_ps(pair_rows + t * kNr, first[t]);
          _mm512_storeu_ps(pair_rows + (16 + t) * kNr, second[t]);
        }
      }
    }
  }
  return k_done;
}

bool StreamFp8ByTables(int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b,
                       const Output& c, bool accumulate) {
  if (b.type != ElemType::kF8E4M3) return false;
  // More rows go to the decoder where it measured as fast or faster
  // (fp8_tables.h): the tables leave room for few columns at a time, and
  // their time grows with the rows faster than the multiply-adds do.
  const Fp8TableRowLimits limits = Fp8TableRows();
  if (m > (b.row_stride == 1 ? limits.k_contiguous : limits.n_contiguous)) return false;
  thread_local Tables tables;
  const Spread spread = MakeSpread();
  tables.Make(b, k_size, n);
  DispatchType(a.type, [&]<ElemType TA>() {
    if constexpr (!WeightOnly(TA)) {
      if (b.row_stride == 1) {
        DispatchRows<kFp8TableMaxRows>(m, [&]<int kM>() {
          KContiguous<kM, TA>(n, k_size, a, b, c, accumulate, tables, spread);
        });
      } else {
        DispatchRows<kFp8TableMaxRows>(m, [&]<int kM>() {
          NContiguous<kM, TA>(n, k_size, a, b, c, accumulate, tables, spread);
        });
      }
    }
  });
  return true;
}

}  // namespace moefit::experts::kernels::internal
