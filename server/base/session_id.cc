#include "server/base/session_id.h"

#include <openssl/rand.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/escaping.h"
#include "server/base/clock.h"

namespace fwserve {

const Clock* Clock::Real() {
  class RealClock : public Clock {
   public:
    absl::Time Now() const override { return absl::Now(); }
  };
  static const RealClock* const clock = new RealClock();
  return clock;
}

std::string NewSessionId() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) std::abort();
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool IsWellFormedSessionId(std::string_view id) {
  return id.size() == 32 && std::all_of(id.begin(), id.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

}  // namespace fwserve
