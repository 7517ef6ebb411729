#include "server/sessions/store_errors.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"

namespace fwserve {
namespace {

bool IsUnreachable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

absl::Status LookupError(const StoreErrorContext& context, absl::string_view id,
                         const absl::Status& status) {
  const std::string subject = id.empty() ? "" : absl::StrCat(context.field, " '", id, "': ");
  switch (status.code()) {
    case absl::StatusCode::kNotFound:
      return absl::NotFoundError(absl::StrCat(context.field, " '", id, "' not found"));
    case absl::StatusCode::kAborted:
      return absl::AbortedError(
          absl::StrCat(context.field, " '", id, "' is busy with another request"));
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      Log(LogLevel::kWarning, absl::StrCat("session store: ", status.message()));
      return absl::UnavailableError(absl::StrCat(
          subject,
          "session store unavailable (unreachable, or no answer within --session-store-timeout=",
          absl::FormatDuration(context.timeout), "); retry later"));
    default:
      Log(LogLevel::kError, absl::StrCat("session store: ", status.message()));
      return absl::InternalError(absl::StrCat(subject, "session store error; see the server log"));
  }
}

// A dir: store's failure: the server keeps what it can and says what.
absl::Status LocalStoreFailure(absl::string_view id, absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(
      "session_id '", id, "': the session store failed: ", what, "; see the server log"));
}

}  // namespace

absl::Status ClientStoreError(StoreCall call, const StoreErrorContext& context,
                              absl::string_view id, const absl::Status& store_status,
                              absl::string_view what) {
  switch (call) {
    case StoreCall::kLookup:
      return LookupError(context, id, store_status);
    case StoreCall::kLoad:
      if (absl::IsNotFound(store_status)) {
        return absl::DataLossError(
            absl::StrCat("session_id '", id, "': its saved state is missing"));
      }
      if (!context.shared) return LocalStoreFailure(id, what);
      return absl::UnavailableError(
          absl::StrCat("session_id '", id,
                       "': session store unavailable; the session is unchanged; retry later"));
    case StoreCall::kWrite:
      if (!context.shared) return LocalStoreFailure(id, what);
      if (absl::IsAborted(store_status)) {
        return absl::AbortedError(absl::StrCat(
            "session_id '", id,
            "': this request lost its lease on the session (it ran past --session-lease-ttl "
            "without renewing it, e.g. while its server was paused), so its result was not "
            "saved; the session keeps what another request committed"));
      }
      if (!IsUnreachable(store_status)) {
        return absl::InternalError(
            absl::StrCat("session_id '", id, "': saving the session failed; see the server log"));
      }
      // The store did not confirm the write: it may or may not have happened (a stalled
      // Redis may still run it). The session's token count tells which.
      return absl::UnavailableError(absl::StrCat(
          "session_id '", id,
          "': session store unavailable; this request's result may not have been saved "
          "(GetSession's token count tells); retry later"));
    case StoreCall::kCreate:
      if (!context.shared) return LocalStoreFailure(id, what);
      if (!IsUnreachable(store_status)) {
        return absl::InternalError(absl::StrCat(
            "session_id '", id, "': saving the new session failed; see the server log"));
      }
      return absl::UnavailableError(
          absl::StrCat("session_id '", id,
                       "': session store unavailable; the new session was not created; "
                       "retry later"));
  }
  return absl::InternalError("session store error; see the server log");
}

const char* StoreOutcome(const absl::Status& status) {
  if (status.ok()) return "ok";
  if (absl::IsNotFound(status)) return "not_found";
  if (absl::IsAborted(status)) return "conflict";
  if (IsUnreachable(status)) return "unavailable";
  return "error";
}

}  // namespace fwserve
