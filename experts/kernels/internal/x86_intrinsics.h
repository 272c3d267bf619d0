// <immintrin.h>, for every file of the kernels: include this instead, and
// before anything else that may include <immintrin.h>.
//
// GCC 12 reports, in its own AVX-512 headers, that the `_mm512_undefined_*`
// pass-through operand of many intrinsics "may be used uninitialized" at every
// place they are inlined (GCC bug 105593, fixed in GCC 13): tens of thousands
// of lines per build, which would bury real warnings. Diagnostics are decided
// by the location they point at, so turning those two warnings off around the
// include silences them in the header's lines alone; the kernels' own code
// keeps them.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
