// The stored-session labels (server/sessions/session_labels.h): the round trip, the last
// output's labels (base64, truncation mark, absent in old blobs), and what is refused.
#include "server/sessions/session_labels.h"

#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "gtest/gtest.h"

namespace fwserve {
namespace {

StoredSessionLabels Labels() {
  StoredSessionLabels labels;
  labels.id = "0123456789abcdef0123456789abcdef";
  labels.model = "aft";
  labels.tenant = "alpha";
  labels.created = absl::FromUnixMillis(1'700'000'000'123);
  labels.last_used = absl::FromUnixMillis(1'700'000'100'456);
  return labels;
}

TEST(SessionLabelsTest, RoundTripWithTheLastOutput) {
  StoredSessionLabels labels = Labels();
  // Bytes a JSON string could not hold raw: quotes, newlines, a NUL, U+FFFD.
  labels.last_output.text = std::string("He said \"hi\"\n\0tail \xEF\xBF\xBD", 22);
  const std::map<std::string, std::string> metadata = ToStoredLabels(labels);
  ASSERT_TRUE(metadata.count("x-last-output") > 0);
  for (char c : metadata.at("x-last-output")) {
    EXPECT_TRUE(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' ||
                c == '=')
        << "not base64: " << c;
  }
  EXPECT_FALSE(metadata.count("x-last-output-truncated") > 0);
  auto parsed = ParseStoredLabels(metadata);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->id, labels.id);
  EXPECT_EQ(parsed->model, "aft");
  EXPECT_EQ(parsed->tenant, "alpha");
  EXPECT_EQ(parsed->created, labels.created);
  EXPECT_EQ(parsed->last_used, labels.last_used);
  EXPECT_EQ(parsed->last_output.text, labels.last_output.text);
  EXPECT_FALSE(parsed->last_output.truncated);
}

TEST(SessionLabelsTest, AnEmptyOutputWritesNoLabelAndAnOldBlobReadsAsEmpty) {
  const std::map<std::string, std::string> metadata = ToStoredLabels(Labels());
  EXPECT_FALSE(metadata.count("x-last-output") > 0);
  EXPECT_FALSE(metadata.count("x-last-output-truncated") > 0);
  auto parsed = ParseStoredLabels(metadata);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->last_output.text, "");
  EXPECT_FALSE(parsed->last_output.truncated);
}

TEST(SessionLabelsTest, TheTruncationMarkRoundTrips) {
  LastOutput output;
  output.Append(std::string(LastOutput::kMaxBytes + 5, 'x'));
  EXPECT_EQ(output.text.size(), LastOutput::kMaxBytes);
  EXPECT_TRUE(output.truncated);
  std::map<std::string, std::string> metadata;
  AddLastOutputLabels(output, &metadata);
  EXPECT_EQ(metadata.at("x-last-output-truncated"), "1");
  auto parsed = ParseLastOutputLabels(metadata);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->text, output.text);
  EXPECT_TRUE(parsed->truncated);
}

TEST(SessionLabelsTest, AnOversizedOutputLabelIsCutToTheBound) {
  std::map<std::string, std::string> metadata;
  LastOutput big;
  big.text = std::string(LastOutput::kMaxBytes + 100, 'y');  // a build with a larger bound
  AddLastOutputLabels(big, &metadata);
  auto parsed = ParseLastOutputLabels(metadata);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->text.size(), LastOutput::kMaxBytes);
  EXPECT_TRUE(parsed->truncated);
}

TEST(SessionLabelsTest, MalformedOutputLabelsAreRefusedByName) {
  std::map<std::string, std::string> metadata = ToStoredLabels(Labels());
  metadata["x-last-output"] = "not base64!";
  auto parsed = ParseStoredLabels(metadata);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("x-last-output"), std::string::npos);

  metadata = ToStoredLabels(Labels());
  metadata["x-last-output-truncated"] = "yes";
  parsed = ParseStoredLabels(metadata);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("x-last-output-truncated"), std::string::npos);
}

TEST(SessionLabelsTest, MissingRequiredLabelsAreRefused) {
  std::map<std::string, std::string> metadata = ToStoredLabels(Labels());
  metadata.erase("x-created-ms");
  EXPECT_EQ(ParseStoredLabels(metadata).status().code(), absl::StatusCode::kInvalidArgument);
  metadata = ToStoredLabels(Labels());
  metadata.erase("x-session-id");
  EXPECT_EQ(ParseStoredLabels(metadata).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fwserve
