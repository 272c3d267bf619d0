// Natural ordering of names: digit runs compare by value (see natural_order.h).
//
// A name is read as a sequence of tokens, each either one non-digit byte or one
// maximal run of digits. Tokens compare lexicographically; a digit run against a
// non-digit byte compares as the byte '0' would, which is consistent because no
// non-digit byte lies between '0' and '9'. Values are compared without parsing
// (strip leading zeros, then shorter is smaller, then digit by digit), so runs of
// any length work and nothing can overflow.
#include "checkpoint/natural_order.h"

#include <cstddef>

namespace moefit::checkpoint {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Length of the digit run starting at `s[pos]`.
size_t DigitRunLength(std::string_view s, size_t pos) {
  size_t end = pos;
  while (end < s.size() && IsDigit(s[end])) ++end;
  return end - pos;
}

// Compares two digit runs by numeric value: <0, 0, >0.
int CompareDigitRuns(std::string_view a, std::string_view b) {
  size_t a_zeros = 0;
  while (a_zeros + 1 < a.size() && a[a_zeros] == '0') ++a_zeros;
  size_t b_zeros = 0;
  while (b_zeros + 1 < b.size() && b[b_zeros] == '0') ++b_zeros;
  a.remove_prefix(a_zeros);
  b.remove_prefix(b_zeros);
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  return a.compare(b);
}

}  // namespace

bool NaturalLess(std::string_view a, std::string_view b) {
  size_t a_pos = 0;
  size_t b_pos = 0;
  while (a_pos < a.size() && b_pos < b.size()) {
    const bool a_digit = IsDigit(a[a_pos]);
    const bool b_digit = IsDigit(b[b_pos]);
    if (a_digit && b_digit) {
      const size_t a_len = DigitRunLength(a, a_pos);
      const size_t b_len = DigitRunLength(b, b_pos);
      const int cmp = CompareDigitRuns(a.substr(a_pos, a_len), b.substr(b_pos, b_len));
      if (cmp != 0) return cmp < 0;
      a_pos += a_len;
      b_pos += b_len;
      continue;
    }
    // A digit run ranks as '0' against a single non-digit byte.
    const unsigned char a_byte = a_digit ? '0' : static_cast<unsigned char>(a[a_pos]);
    const unsigned char b_byte = b_digit ? '0' : static_cast<unsigned char>(b[b_pos]);
    if (a_byte != b_byte) return a_byte < b_byte;
    ++a_pos;
    ++b_pos;
  }
  const bool a_done = a_pos == a.size();
  const bool b_done = b_pos == b.size();
  if (a_done != b_done) return a_done;  // a proper token prefix sorts first
  // Equal token sequences (leading zeros differ): fall back to byte order.
  return a < b;
}

}  // namespace moefit::checkpoint
