// Embeds data/corpus.txt with the assembler's .incbin (the path comes from
// CMake as MOEFIT_CORPUS_PATH); see corpus.h.
#include "launch/corpus.h"

#ifndef MOEFIT_CORPUS_PATH
#error "MOEFIT_CORPUS_PATH must name data/corpus.txt"
#endif

__asm__(
    ".pushsection .rodata\n"
    ".balign 16\n"
    "moefit_corpus_begin:\n"
    ".incbin \"" MOEFIT_CORPUS_PATH "\"\n"
    "moefit_corpus_end:\n"
    ".popsection\n");

extern "C" const char moefit_corpus_begin[];
extern "C" const char moefit_corpus_end[];

namespace moefit::launch {

std::string_view ShippedCorpus() {
  return std::string_view(moefit_corpus_begin,
                          static_cast<size_t>(moefit_corpus_end - moefit_corpus_begin));
}

}  // namespace moefit::launch
