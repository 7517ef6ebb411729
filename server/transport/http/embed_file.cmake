# Writes a C++ source that holds a file's bytes, so the binary serves it with nothing
# beside it: cmake -DINPUT=<file> -DOUTPUT=<.cc> -DSYMBOL=<function> -P embed_file.cmake
# The source defines `absl::string_view <SYMBOL>()` in namespace fwserve.
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_length)
math(EXPR byte_count "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "'\\\\x\\1'," bytes "${hex}")
# Eight-kilobyte lines would be fine for compilers but not for people: break every 16.
string(REGEX REPLACE "(('[^']+',){16})" "\\1\n" bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
"// Generated from ${name} by embed_file.cmake; do not edit.
#include \"absl/strings/string_view.h\"

namespace fwserve {
namespace {
constexpr char kBytes[] = {
${bytes}'\\0'};
}  // namespace

absl::string_view ${SYMBOL}() { return absl::string_view(kBytes, ${byte_count}); }

}  // namespace fwserve
")
# Unchanged content keeps the old file (and its timestamp): no needless rebuild.
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
