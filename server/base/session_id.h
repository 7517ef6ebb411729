// Session ids: 128 random bits as 32 lowercase hex digits. Safe as a file name or a
// key in any store. Torch-free.
#pragma once

#include <string>
#include <string_view>

namespace fwserve {

// From the OS CSPRNG; aborts if it fails (an id we cannot make unguessable must not be
// handed out).
std::string NewSessionId();
// True if `id` has the shape NewSessionId() produces.
bool IsWellFormedSessionId(std::string_view id);

}  // namespace fwserve
