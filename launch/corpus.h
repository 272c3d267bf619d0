// The English text corpus shipped with moefit (data/corpus.txt: three Jane
// Austen novels, public domain; see data/CORPUS-LICENSE.txt), embedded in the
// binary so that the demo runs from any directory.
#pragma once

#include <string_view>

namespace moefit::launch {

std::string_view ShippedCorpus();

}  // namespace moefit::launch
