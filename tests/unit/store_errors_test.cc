// The one mapping from a session store's failure to the client's status: every call,
// both modes, every store code the stores return. A message never carries the store's
// own text (paths, addresses).
#include "server/sessions/store_errors.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fwserve {
namespace {

struct Row {
  StoreCall call;
  bool shared;
  absl::StatusCode store_code;
  absl::StatusCode client_code;
  const char* message_part;
};

TEST(StoreErrorsTest, EveryCallModeAndCodeMapsToOneClientStatus) {
  using C = absl::StatusCode;
  const std::vector<Row> table = {
      // Shared store lookups (leases, records, listings).
      {StoreCall::kLookup, true, C::kNotFound, C::kNotFound, "' not found"},
      {StoreCall::kLookup, true, C::kAborted, C::kAborted, "is busy with another request"},
      {StoreCall::kLookup, true, C::kUnavailable, C::kUnavailable, "--session-store-timeout=250ms"},
      {StoreCall::kLookup, true, C::kDeadlineExceeded, C::kUnavailable,
       "session store unavailable"},
      {StoreCall::kLookup, true, C::kDataLoss, C::kInternal, "see the server log"},
      // Loads.
      {StoreCall::kLoad, true, C::kNotFound, C::kDataLoss, "its saved state is missing"},
      {StoreCall::kLoad, false, C::kNotFound, C::kDataLoss, "its saved state is missing"},
      {StoreCall::kLoad, true, C::kUnavailable, C::kUnavailable, "the session is unchanged"},
      {StoreCall::kLoad, true, C::kInternal, C::kUnavailable, "the session is unchanged"},
      {StoreCall::kLoad, false, C::kInternal, C::kUnavailable,
       "the session store failed: WHAT; see the server log"},
      // Writes.
      {StoreCall::kWrite, true, C::kAborted, C::kAborted, "lost its lease"},
      {StoreCall::kWrite, true, C::kUnavailable, C::kUnavailable, "may not have been saved"},
      {StoreCall::kWrite, true, C::kDeadlineExceeded, C::kUnavailable, "may not have been saved"},
      {StoreCall::kWrite, true, C::kInternal, C::kInternal, "saving the session failed"},
      {StoreCall::kWrite, false, C::kInternal, C::kUnavailable,
       "the session store failed: WHAT; see the server log"},
      {StoreCall::kWrite, false, C::kAborted, C::kUnavailable, "the session store failed: WHAT"},
      // New sessions.
      {StoreCall::kCreate, true, C::kUnavailable, C::kUnavailable, "the new session was not created"},
      {StoreCall::kCreate, true, C::kDeadlineExceeded, C::kUnavailable, "was not created; retry"},
      {StoreCall::kCreate, true, C::kInternal, C::kInternal, "saving the new session failed"},
      {StoreCall::kCreate, false, C::kInternal, C::kUnavailable,
       "the session store failed: WHAT; see the server log"},
  };
  const std::string id = "0123456789abcdef0123456789abcdef";
  for (const Row& row : table) {
    StoreErrorContext context;
    context.shared = row.shared;
    context.timeout = absl::Milliseconds(250);
    const absl::Status store_status(row.store_code, "redis 10.0.0.7:6379 /var/lib/secret.rdb");
    const absl::Status client = ClientStoreError(row.call, context, id, store_status, "WHAT");
    SCOPED_TRACE(::testing::Message() << "call " << static_cast<int>(row.call) << " shared "
                                      << row.shared << " store " << store_status);
    EXPECT_EQ(client.code(), row.client_code) << client;
    EXPECT_NE(client.message().find(row.message_part), std::string::npos) << client;
    EXPECT_NE(client.message().find(id), std::string::npos) << client;
    // The store's own words (addresses, paths) never reach the client.
    EXPECT_EQ(client.message().find("10.0.0.7"), std::string::npos) << client;
    EXPECT_EQ(client.message().find("/var/lib"), std::string::npos) << client;
  }
}

TEST(StoreErrorsTest, ALookupAboutNoSessionNamesNone) {
  StoreErrorContext context;
  context.shared = true;
  const absl::Status client =
      ClientStoreError(StoreCall::kLookup, context, "", absl::UnavailableError("down"));
  EXPECT_EQ(client.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.message().find("session_id"), std::string::npos) << client;
}

TEST(StoreErrorsTest, OutcomeLabels) {
  EXPECT_STREQ(StoreOutcome(absl::OkStatus()), "ok");
  EXPECT_STREQ(StoreOutcome(absl::NotFoundError("")), "not_found");
  EXPECT_STREQ(StoreOutcome(absl::AbortedError("")), "conflict");
  EXPECT_STREQ(StoreOutcome(absl::UnavailableError("")), "unavailable");
  EXPECT_STREQ(StoreOutcome(absl::DeadlineExceededError("")), "unavailable");
  EXPECT_STREQ(StoreOutcome(absl::InternalError("")), "error");
}

}  // namespace
}  // namespace fwserve
