// The blocked GEMM driver and the choice of kernels; see gemm.h.
//
// Loop nest (GotoBLAS): for each block of nb columns, for each block of kb of
// the reduction, B's kb x nb block is packed once; then for each block of mb
// rows A's block is packed and the microkernel runs over every (column panel,
// row panel) pair, a B panel staying in L1 while the A panels stream past it.
// With nb covering the whole of an expert's output width, each weight element
// is read and converted once per call, whatever the number of rows. A few
// rows take narrow column blocks (strips) instead, with A packed once for all
// k blocks (see kStripMaxRows).
#include "experts/kernels/gemm.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "experts/kernels/internal/packed_kernels.h"

namespace moefit::experts::kernels {
namespace {

using internal::PackedKernels;

// Rows of a bfloat16 output computed at a time (a multiple of 128, the FP8
// scale block): the float32 block they are summed in stays a few MB.
constexpr int64_t kMaxBufferedRows = 256;

// Bytes of one element, for the types stored a byte or more each (not int4).
int64_t ElementBytes(ElemType t) {
  TORCH_CHECK(t != ElemType::kI4, "Gemm: int4 elements are half a byte");
  return t == ElemType::kF32 ? 4 : t == ElemType::kBF16 ? 2 : 1;
}

// Columns of B packed at a time when A is a single block of rows (a multiple
// of every microkernel's nr; 512 x kb float32 fits in L2).
constexpr int64_t kSmallBlockColumns = 512;

const PackedKernels& Select(Isa isa, const Operand& a, const Operand& b) {
  return internal::KernelsFor(isa, a.type != ElemType::kF32 || b.type != ElemType::kF32);
}

// Per-thread scratch, grown to the largest call seen and kept: the expert
// layer calls this thousands of times per step. a, b: packed panels; c: a
// bfloat16 output's float32 block; rows_a, rows_b: rows of an operand read
// by index, copied out before packing.
struct Workspace {
  std::vector<float> a, b, c, rows_a, rows_b;
};

Workspace& ThreadWorkspace() {
  thread_local Workspace ws;
  return ws;
}

float* Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Where row i of an operand starts, in elements of its type.
int64_t RowStart(const Operand& op, int64_t i) {
  return (op.row_index != nullptr ? op.row_index[i] : i) * op.row_stride;
}

// Rows [r0, r0 + rows) x columns [c0, c0 + cols) of an operand read by
// index, copied into `buf` one row after another (row stride cols) in the
// operand's own type: a plain operand the packers read as they read any.
Operand CopyIndexedRows(const Operand& op, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                        std::vector<float>& buf) {
  const int64_t bytes = ElementBytes(op.type);
  char* out =
      reinterpret_cast<char*>(Grow(buf, static_cast<size_t>((rows * cols * bytes + 3) / 4)));
  const char* src = static_cast<const char*>(op.data);
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = src + (RowStart(op, r0 + i) + c0 * op.col_stride) * bytes;
    char* to = out + i * cols * bytes;
    if (op.col_stride == 1) {
      std::memcpy(to, row, static_cast<size_t>(cols * bytes));
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        std::memcpy(to + j * bytes, row + j * op.col_stride * bytes, static_cast<size_t>(bytes));
      }
    }
  }
  Operand plain;
  plain.data = out;
  plain.type = op.type;
  plain.row_stride = cols;
  plain.col_stride = 1;
  return plain;
}

// c10's conversion: the reference the kernels' own (pack_common.h) are
// tested against.
float FromBf16(uint16_t b) {
  return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
}

// Rows [i, ...) of A and of C: the operands of a chunk of rows that starts at
// row i (with FP8 A, i is a multiple of the scale block).
Operand RowsFrom(const Operand& a, int64_t i) {
  Operand rows = a;
  if (a.row_index != nullptr) {
    rows.row_index = a.row_index + i;
  } else {
    rows.data = static_cast<const char*>(a.data) + i * a.row_stride * ElementBytes(a.type);
  }
  if (a.type == ElemType::kF8E4M3) {
    TORCH_CHECK(i % kScaleBlock == 0, "Gemm: row chunks must align with the FP8 scale blocks");
    rows.scales = a.scales + (i / kScaleBlock) * a.scale_row_stride;
  }
  return rows;
}

Output RowsFrom(const Output& c, int64_t i) {
  Output rows = c;
  rows.data = static_cast<char*>(c.data) + i * c.row_stride * ElementBytes(c.type);
  return rows;
}

void CheckOperand(const Operand& op, const char* name) {
  TORCH_CHECK(op.data != nullptr, "Gemm: operand ", name, " has no data");
  TORCH_CHECK(op.type != ElemType::kF8E4M3 || op.scales != nullptr, "Gemm: FP8 operand ", name,
              " needs its block scales");
  TORCH_CHECK(!WeightOnly(op.type) || op.row_index == nullptr, "Gemm: FP8 or int4 operand ", name,
              " cannot be read by row index");
  if (op.type == ElemType::kI4) {
    TORCH_CHECK(op.group_scales != nullptr, "Gemm: int4 operand ", name, " needs its group scales");
    TORCH_CHECK(op.group_rows >= 1 && op.group_cols >= 1, "Gemm: int4 operand ", name,
                " has groups of ", op.group_rows, " x ", op.group_cols);
    // Rows (or columns) of nibbles start on a byte: the stride between them
    // and a group's extent along the nibbles are even.
    const bool along_cols = op.col_stride == 1;
    TORCH_CHECK((along_cols ? op.row_stride : op.col_stride) % 2 == 0 &&
                    (along_cols ? op.group_cols : op.group_rows) % 2 == 0,
                "Gemm: int4 operand ", name, " must have even strides and group extents");
  }
}

// A few rows (m <= kStripMaxRows) take B in strips of columns that each
// run along the whole reduction before the next starts, with A packed once
// for all k blocks (instead of once per strip and block). Per k block the
// same microkernel calls on the same panels as with wide column blocks, in
// the same k order for each element of C: the same bits. What differs is how
// B is read: a k-contiguous weight (Wᵀ) a strip's columns at a time along
// their whole length, instead of 256-value runs of 512 columns at once,
// which the hardware reads at well below a sequential pass's speed.
constexpr int64_t kStripMaxRows = 32;
// A strip's packed bytes over all of k (at least one panel): narrow enough
// that its columns are read together, one k block of it in L2 at a time.
constexpr int64_t kStripBytes = int64_t{128} << 10;

// The blocked path (see the loop nest above). b_block_at(k0, kb, n0, nb,
// scratch) returns B's kb x nb block at (k0, n0) in the kernels' panels:
// packed into `scratch` (room for the largest block) or found packed ahead.
template <typename BBlockAt>
void Blocked(const PackedKernels& kern, int64_t m, int64_t n, int64_t k_size, const Operand& a,
             const Output& c, bool accumulate, const BBlockAt& b_block_at) {
  Workspace& ws = ThreadWorkspace();
  // Panel sizes in floats (a bfloat16 pair is one float's 4 bytes); every k
  // block but the last is kern.kb long.
  auto k_slots = [&](int64_t kb) { return internal::PanelSlots(kern, kb); };
  const int64_t block_slots = k_slots(kern.kb);
  const int64_t num_kb = (k_size + kern.kb - 1) / kern.kb;
  const int64_t all_slots = (num_kb - 1) * block_slots + k_slots(k_size - (num_kb - 1) * kern.kb);
  const bool strips = m <= kStripMaxRows;
  // With one block of rows, each packed B block is used once, right after it
  // is packed: keep it small enough to stay in L2 instead of travelling to
  // memory and back. With more rows, wide blocks pack A fewer times.
  const int64_t nb_block =
      strips         ? std::max<int64_t>(kern.nr, kStripBytes / (all_slots * 4) / kern.nr * kern.nr)
      : m <= kern.mb ? std::min<int64_t>(kern.nb, kSmallBlockColumns)
                     : kern.nb;
  const int64_t nb_max = std::min(nb_block, n);
  const int64_t kb_max = std::min(kern.kb, k_size + (k_size & 1));
  const int64_t mb_max = std::min(kern.mb, m);
  const int64_t a_panels = (mb_max + kern.mr - 1) / kern.mr;
  const int64_t b_panels = (nb_max + kern.nr - 1) / kern.nr;
  // A's panels: of one block of rows and k, or, in strips, of every k block
  // (block i at i * a_block_floats).
  const int64_t a_block_floats = a_panels * kern.mr * block_slots;
  float* ap =
      Grow(ws.a, static_cast<size_t>(a_panels * kern.mr * (strips ? all_slots : k_slots(kb_max))));
  float* bp = Grow(ws.b, static_cast<size_t>(b_panels * kern.nr * k_slots(kb_max)));
  // float32 output: the microkernel accumulates into it directly; bfloat16:
  // into a float32 block that is rounded once, after the whole reduction.
  const bool direct = c.type == ElemType::kF32;
  float* cbuf = direct ? nullptr : Grow(ws.c, static_cast<size_t>(m * nb_max));
  auto pack_a = [&](int64_t m0, int64_t mb, int64_t k0, int64_t kb, float* out) {
    if (a.row_index != nullptr) {
      kern.pack_a(CopyIndexedRows(a, m0, mb, k0, kb, ws.rows_a), 0, mb, 0, kb, out);
    } else {
      kern.pack_a(a, m0, mb, k0, kb, out);
    }
  };
  if (strips) {
    for (int64_t k0 = 0; k0 < k_size; k0 += kern.kb) {
      pack_a(0, m, k0, std::min(kern.kb, k_size - k0), ap + (k0 / kern.kb) * a_block_floats);
    }
  }

  if (kern.begin != nullptr) kern.begin();
  for (int64_t n0 = 0; n0 < n; n0 += nb_block) {
    const int64_t nb = std::min(nb_block, n - n0);
    float* cblk = direct ? static_cast<float*>(c.data) + n0 : cbuf;
    const int64_t ldc = direct ? c.row_stride : nb;
    for (int64_t k0 = 0; k0 < k_size; k0 += kern.kb) {
      const int64_t kb = std::min(kern.kb, k_size - k0);
      const int64_t slots = k_slots(kb);
      const float* b_block = b_block_at(k0, kb, n0, nb, bp);
      const bool acc = k0 > 0 || (direct && accumulate);
      for (int64_t m0 = 0; m0 < m; m0 += kern.mb) {
        const int64_t mb = std::min(kern.mb, m - m0);
        const float* a_block = ap;
        if (strips) {
          a_block += (k0 / kern.kb) * a_block_floats;
        } else {
          pack_a(m0, mb, k0, kb, ap);
        }
        for (int64_t j = 0; j < nb; j += kern.nr) {
          const int cols = static_cast<int>(std::min<int64_t>(kern.nr, nb - j));
          const float* b_panel = b_block + (j / kern.nr) * kern.nr * slots;
          for (int64_t i = 0; i < mb; i += kern.mr) {
            const int rows = static_cast<int>(std::min<int64_t>(kern.mr, mb - i));
            kern.micro(kb, a_block + (i / kern.mr) * kern.mr * slots, b_panel,
                       cblk + (m0 + i) * ldc + j, ldc, rows, cols, acc);
          }
        }
      }
    }
    if (!direct) {
      for (int64_t i = 0; i < m; ++i) {
        uint16_t* out = static_cast<uint16_t*>(c.data) + i * c.row_stride + n0;
        kern.store_bf16(cbuf + i * ldc, out, nb, accumulate);
      }
    }
  }
  if (kern.end != nullptr) kern.end();
}

}  // namespace

float ElementValue(const Operand& op, int64_t i, int64_t j) {
  TORCH_CHECK(!WeightOnly(op.type) || op.row_index == nullptr,
              "ElementValue: FP8 and int4 operands cannot be read by row index");
  const int64_t idx = RowStart(op, i) + j * op.col_stride;
  switch (op.type) {
    case ElemType::kF32:
      return static_cast<const float*>(op.data)[idx];
    case ElemType::kBF16:
      return FromBf16(static_cast<const uint16_t*>(op.data)[idx]);
    case ElemType::kF8E4M3: {
      const uint8_t b = static_cast<const uint8_t*>(op.data)[idx];
      const float v = static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
      return v * op.scales[(i / kScaleBlock) * op.scale_row_stride +
                           (j / kScaleBlock) * op.scale_col_stride];
    }
    case ElemType::kI4: {
      const uint8_t b = static_cast<const uint8_t*>(op.data)[idx / 2];
      const int q = (idx % 2 == 0 ? b & 0xf : b >> 4) - 8;
      const int64_t g =
          (i / op.group_rows) * op.scale_row_stride + (j / op.group_cols) * op.scale_col_stride;
      const int z = op.zero_points != nullptr ? op.zero_points[g] : 0;
      const float scale = FromBf16(op.group_scales[g]);
      return static_cast<float>(c10::BFloat16(static_cast<float>(q - z) * scale));
    }
  }
  return 0;
}

void Gemm(int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b, const Output& c,
          bool accumulate, RowPath path) {
  Gemm(ActiveIsa(), m, n, k_size, a, b, c, accumulate, path);
}

void Gemm(Isa isa, int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b,
          const Output& c, bool accumulate, RowPath path) {
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(DetectIsa()), "Gemm: ", IsaName(isa),
              " kernels cannot run on this CPU (", CpuFlags(), ")");
  TORCH_CHECK(m >= 0 && n >= 0 && k_size >= 0, "Gemm: negative size");
  TORCH_CHECK(path != RowPath::kStreamed || m <= kMaxStreamedRows, "Gemm: ", m,
              " rows cannot be streamed (at most ", kMaxStreamedRows, ")");
  TORCH_CHECK(c.type == ElemType::kF32 || c.type == ElemType::kBF16,
              "Gemm: the output is float32 or bfloat16");
  if (m == 0 || n == 0) return;
  TORCH_CHECK(c.data != nullptr, "Gemm: output has no data");
  if (k_size == 0) {
    if (accumulate) return;
    for (int64_t i = 0; i < m; ++i) {
      if (c.type == ElemType::kF32) {
        std::fill_n(static_cast<float*>(c.data) + i * c.row_stride, n, 0.0f);
      } else {
        std::fill_n(static_cast<uint16_t*>(c.data) + i * c.row_stride, n, uint16_t{0});
      }
    }
    return;
  }
  CheckOperand(a, "A");
  CheckOperand(b, "B");
  TORCH_CHECK(a.type != ElemType::kI4, "Gemm: A cannot be int4");
  // A bfloat16 output is summed in a float32 block of all its rows: bound
  // that block by taking the rows in chunks (each packs B again, which a
  // chunk this tall amortizes).
  if (c.type != ElemType::kF32 && m > kMaxBufferedRows) {
    for (int64_t i = 0; i < m; i += kMaxBufferedRows) {
      Gemm(isa, std::min(kMaxBufferedRows, m - i), n, k_size, RowsFrom(a, i), b, RowsFrom(c, i),
           accumulate, RowPath::kBlocked);
    }
    return;
  }
  const PackedKernels& kern = Select(isa, a, b);
  const bool streamed =
      path == RowPath::kStreamed || (path == RowPath::kAuto && m <= kMaxStreamedRows);
  // small_rows reads A's rows along k and declines other layouts of A: an
  // operand read by index is copied out whole (a few rows of A; all of B)
  // only for a call it can take.
  const bool a_along_k = a.row_index != nullptr || (a.col_stride == 1 && !WeightOnly(a.type));
  if (streamed && kern.small_rows != nullptr && a_along_k) {
    Workspace& ws = ThreadWorkspace();
    const Operand sa = a.row_index != nullptr ? CopyIndexedRows(a, 0, m, 0, k_size, ws.rows_a) : a;
    const Operand sb = b.row_index != nullptr ? CopyIndexedRows(b, 0, k_size, 0, n, ws.rows_b) : b;
    if (kern.small_rows(m, n, k_size, sa, sb, c, accumulate)) return;
  }
  Blocked(kern, m, n, k_size, a, c, accumulate,
          [&](int64_t k0, int64_t kb, int64_t n0, int64_t nb, float* scratch) {
            if (b.row_index != nullptr) {
              kern.pack_b(CopyIndexedRows(b, k0, kb, n0, nb, ThreadWorkspace().rows_b), 0, kb, 0,
                          nb, scratch);
            } else {
              kern.pack_b(b, k0, kb, n0, nb, scratch);
            }
            return static_cast<const float*>(scratch);
          });
}

// Whether `kern` keeps an FP8 B of k_size x n compactly (PackedKernels::
// expand_fp8): whole panels, whole pairs.
bool KeptCompact(const PackedKernels& kern, ElemType b_type, int64_t k_size, int64_t n) {
  return kern.expand_fp8 != nullptr && b_type == ElemType::kF8E4M3 && k_size % 2 == 0 &&
         n % kern.nr == 0;
}

// Floats (4-byte units) of a pack of k_size x n: each k block's panels,
// a 4-byte slot each; compact, two bytes per slot.
int64_t PackFloats(const PackedKernels& kern, ElemType b_type, int64_t k_size, int64_t n) {
  const int64_t panels = (n + kern.nr - 1) / kern.nr;
  int64_t slots = 0;
  for (int64_t k0 = 0; k0 < k_size; k0 += kern.kb) {
    slots += panels * kern.nr * internal::PanelSlots(kern, std::min(kern.kb, k_size - k0));
  }
  // nr is even, so the compact bytes fill whole floats.
  return KeptCompact(kern, b_type, k_size, n) ? slots / 2 : slots;
}

// The compact FP8 pack of b's k block [k0, k0 + kb): each panel's pair-rows
// in the pairs panels' order, (k, k + 1) of a column in adjacent bytes, the
// padding rows zero.
void PackCompactFp8(const PackedKernels& kern, const Operand& b, int64_t k0, int64_t kb, int64_t n,
                    uint8_t* out) {
  const auto* src = static_cast<const uint8_t*>(b.data);
  const int64_t slots = internal::PanelSlots(kern, kb);
  for (int64_t p = 0; p < n / kern.nr; ++p) {
    uint8_t* o = out + p * slots * kern.nr * 2;
    std::fill_n(o, slots * kern.nr * 2, uint8_t{0});
    for (int64_t k = 0; k < kb; ++k) {
      for (int64_t j = 0; j < kern.nr; ++j) {
        o[((k / 2) * kern.nr + j) * 2 + k % 2] =
            src[(k0 + k) * b.row_stride + (p * kern.nr + j) * b.col_stride];
      }
    }
  }
}

PackedB::PackedB(Isa isa, ElemType a_type, int64_t k_size, int64_t n, const Operand& b)
    : isa_(isa), a_type_(a_type), k_size_(k_size), n_(n), source_(b) {
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(DetectIsa()), "PackedB: ", IsaName(isa),
              " kernels cannot run on this CPU (", CpuFlags(), ")");
  TORCH_CHECK(k_size >= 0 && n >= 0, "PackedB: negative size");
  CheckOperand(b, "B");
  TORCH_CHECK(b.row_index == nullptr, "PackedB: B cannot be read by row index");
  Operand a_like;
  a_like.type = a_type;
  const PackedKernels& kern = Select(isa, a_like, b);
  kern_ = &kern;
  compact_ = KeptCompact(kern, b.type, k_size, n);
  const int64_t panels = (n + kern.nr - 1) / kern.nr;
  const int64_t kb_full = std::min(kern.kb, k_size + (k_size & 1));
  block_slots_ = panels * kern.nr * internal::PanelSlots(kern, kb_full);
  num_floats_ = PackFloats(kern, b.type, k_size, n);
  data_ = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(num_floats_));
  if (n == 0) return;
  for (int64_t k0 = 0; k0 < k_size; k0 += kern.kb) {
    const int64_t kb = std::min(kern.kb, k_size - k0);
    if (compact_) {
      PackCompactFp8(kern, b, k0, kb, n,
                     reinterpret_cast<uint8_t*>(data_.get()) + (k0 / kern.kb) * block_slots_ * 2);
    } else {
      kern.pack_b(b, k0, kb, 0, n, data_.get() + (k0 / kern.kb) * block_slots_);
    }
  }
}

int64_t PackedB::Bytes(Isa isa, ElemType a_type, int64_t k_size, int64_t n, ElemType b_type) {
  Operand a_like, b_like;
  a_like.type = a_type;
  b_like.type = b_type;
  const PackedKernels& kern = Select(isa, a_like, b_like);
  return PackFloats(kern, b_type, k_size, n) * static_cast<int64_t>(sizeof(float));
}

const float* PackedB::Block(int64_t k0, int64_t n0, float* scratch, int64_t k_block,
                            int64_t n_block) const {
  const int64_t slots = internal::PanelSlots(*kern_, k_block);
  const int64_t block = k0 / kern_->kb, panel_offset = (n0 / kern_->nr) * kern_->nr * slots;
  if (!compact_) return data_.get() + block * block_slots_ + panel_offset;
  kern_->expand_fp8(
      reinterpret_cast<const uint8_t*>(data_.get()) + (block * block_slots_ + panel_offset) * 2,
      source_, k0, k_block, n0, n_block, scratch);
  return scratch;
}

void Gemm(Isa isa, int64_t m, const Operand& a, const PackedB& b, const Output& c, bool accumulate,
          RowPath path) {
  GemmColumns(isa, m, a, b, 0, b.n(), c, accumulate, path);
}

void GemmColumns(Isa isa, int64_t m, const Operand& a, const PackedB& b, int64_t col0,
                 int64_t num_cols, const Output& c, bool accumulate, RowPath path) {
  TORCH_CHECK(!b.empty(), "Gemm: the packed B is empty");
  TORCH_CHECK(col0 >= 0 && num_cols >= 0 && col0 + num_cols <= b.n(), "Gemm: columns [", col0, ", ",
              col0 + num_cols, ") outside the packed B's ", b.n());
  const int64_t k_size = b.k_size();
  const bool streamed =
      path == RowPath::kStreamed || (path == RowPath::kAuto && m <= kMaxStreamedRows);
  // Where the pack does not serve this call, the unpacked GEMM does (the
  // same bits): another instruction set or A type, the streamed path,
  // columns off the panel grid, or nothing to multiply.
  if (isa != b.isa_ || a.type != b.a_type_ || &Select(isa, a, b.source_) != b.kern_ || streamed ||
      m == 0 || num_cols == 0 || k_size == 0 || col0 % b.kern_->nr != 0) {
    Operand src = b.source_;
    if (col0 > 0) {
      if (src.type == ElemType::kI4) {
        TORCH_CHECK(col0 % src.group_cols == 0 && col0 * src.col_stride % 2 == 0,
                    "Gemm: int4 column ranges must start on a group and a byte");
        src.data = static_cast<const char*>(src.data) + col0 * src.col_stride / 2;
        src.group_scales += (col0 / src.group_cols) * src.scale_col_stride;
        if (src.zero_points != nullptr) {
          src.zero_points += (col0 / src.group_cols) * src.scale_col_stride;
        }
      } else {
        src.data =
            static_cast<const char*>(src.data) + col0 * src.col_stride * ElementBytes(src.type);
      }
      if (src.type == ElemType::kF8E4M3) {
        TORCH_CHECK(col0 % kScaleBlock == 0, "Gemm: FP8 column ranges must start on a scale block");
        src.scales += (col0 / kScaleBlock) * src.scale_col_stride;
      }
    }
    Gemm(isa, m, num_cols, k_size, a, src, c, accumulate, path);
    return;
  }
  TORCH_CHECK(c.type == ElemType::kF32 || c.type == ElemType::kBF16,
              "Gemm: the output is float32 or bfloat16");
  TORCH_CHECK(c.data != nullptr, "Gemm: output has no data");
  CheckOperand(a, "A");
  // A bfloat16 output in the row chunks the unpacked GEMM takes (the same
  // bits), each multiplied by the pack.
  if (c.type != ElemType::kF32 && m > kMaxBufferedRows) {
    for (int64_t i = 0; i < m; i += kMaxBufferedRows) {
      GemmColumns(isa, std::min(kMaxBufferedRows, m - i), RowsFrom(a, i), b, col0, num_cols,
                  RowsFrom(c, i), accumulate, RowPath::kBlocked);
    }
    return;
  }
  Blocked(*b.kern_, m, num_cols, k_size, a, c, accumulate,
          [&](int64_t k0, int64_t kb, int64_t n0, int64_t nb, float* scratch) {
            return b.Block(k0, col0 + n0, scratch, kb, nb);
          });
}

namespace internal {

const PackedKernels& KernelsFor(Isa isa, bool narrow) {
  switch (isa) {
    case Isa::kAmxBf16:
      return narrow ? AmxBf16Kernels() : Avx512F32Kernels();
    case Isa::kAvx512Bf16:
      if (!narrow) return Avx512F32Kernels();
      return MultipliesBf16Pairs(isa) ? Avx512Bf16PairKernels() : Avx512Bf16WidenedKernels();
    case Isa::kAvx512:
      return Avx512F32Kernels();
    case Isa::kAvx2:
      return Avx2F32Kernels();
    case Isa::kPortable:
      break;
  }
  return PortableF32Kernels();
}

}  // namespace internal
}  // namespace moefit::experts::kernels
