// ChoiceFanIn (server/core/choice_fan_in.h): several choices' streams joined into the one
// stream a transport asked for. Fake engine controls and a recording transport, no
// server: one write in flight at a time, WriteDone routed to the choice whose chunk was
// written, one OnFinish after every choice and every write, a failure cancelling the
// others.
#include "server/core/choice_fan_in.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace fwserve {
namespace {

// The engine's handle on one choice's stream.
class FakeControl : public GenerateControl {
 public:
  std::string session_id() const override { return ""; }
  void WriteDone(bool ok) override { writes_done.push_back(ok); }
  void Cancel() override { ++cancels; }
  std::vector<bool> writes_done;
  int cancels = 0;
};

// The transport: records what reaches it.
class Recorder : public GenerateObserver {
 public:
  void OnStart(std::shared_ptr<GenerateControl> stream) override { control = std::move(stream); }
  void OnChunk(GenerateChunk chunk) override { chunks.push_back(std::move(chunk)); }
  void OnFinish(absl::Status s, GenerateSummary sum) override {
    ++finishes;
    status = std::move(s);
    summary = std::move(sum);
  }
  std::shared_ptr<GenerateControl> control;
  std::vector<GenerateChunk> chunks;
  int finishes = 0;
  absl::Status status;
  GenerateSummary summary;
};

GenerateChunk Text(const std::string& text) {
  GenerateChunk chunk;
  chunk.text = text;
  return chunk;
}

GenerateSummary Ended(FinishReason reason, int64_t prompt, int64_t generated,
                      const std::string& trailing = "") {
  GenerateSummary s;
  s.reason = reason;
  s.prompt_tokens = prompt;
  s.generated_tokens = generated;
  s.session_tokens = prompt + generated;
  s.trailing_text = trailing;
  return s;
}

struct Fixture {
  explicit Fixture(int n) : fan_in(ChoiceFanIn::Create(&transport, n)) {
    for (int i = 0; i < n; ++i) {
      controls.push_back(std::make_shared<FakeControl>());
      fan_in->member(i)->OnStart(controls.back());
    }
  }
  Recorder transport;
  std::shared_ptr<ChoiceFanIn> fan_in;
  std::vector<std::shared_ptr<FakeControl>> controls;
};

TEST(ChoiceFanInTest, OneWriteAtATimeEachRoutedToItsChoiceThenOneFinish) {
  Fixture f(3);
  f.fan_in->member(1)->OnChunk(Text("b1"));  // before Start: held
  EXPECT_TRUE(f.transport.chunks.empty());
  f.fan_in->Start();
  ASSERT_EQ(f.transport.control, f.fan_in);
  f.fan_in->member(0)->OnChunk(Text("a1"));
  f.fan_in->member(2)->OnChunk(Text("c1"));
  // One write in flight: the first queued chunk, with its index.
  ASSERT_EQ(f.transport.chunks.size(), 1u);
  EXPECT_EQ(f.transport.chunks[0].text, "b1");
  EXPECT_EQ(f.transport.chunks[0].choice_index, 1);
  f.fan_in->WriteDone(true);
  EXPECT_EQ(f.controls[1]->writes_done, std::vector<bool>{true});
  EXPECT_TRUE(f.controls[0]->writes_done.empty());
  ASSERT_EQ(f.transport.chunks.size(), 2u);
  EXPECT_EQ(f.transport.chunks[1].choice_index, 0);
  f.fan_in->WriteDone(false);  // a broken write reaches its own choice
  EXPECT_EQ(f.controls[0]->writes_done, std::vector<bool>{false});
  ASSERT_EQ(f.transport.chunks.size(), 3u);
  EXPECT_EQ(f.transport.chunks[2].text, "c1");
  EXPECT_EQ(f.transport.chunks[2].choice_index, 2);
  // Every choice ends; the last write is still in flight, so no OnFinish yet.
  f.fan_in->member(1)->OnFinish(absl::OkStatus(), Ended(FinishReason::kStop, 0, 4, "x"));
  f.fan_in->member(0)->OnFinish(absl::OkStatus(), Ended(FinishReason::kLength, 7, 5));
  f.fan_in->member(2)->OnFinish(absl::OkStatus(), Ended(FinishReason::kLength, 0, 5));
  EXPECT_EQ(f.transport.finishes, 0);
  f.fan_in->WriteDone(true);
  EXPECT_EQ(f.controls[2]->writes_done, std::vector<bool>{});  // it had finished: not called
  ASSERT_EQ(f.transport.finishes, 1);
  EXPECT_TRUE(f.transport.status.ok());
  const GenerateSummary& s = f.transport.summary;
  EXPECT_EQ(s.prompt_tokens, 7);  // choice 0's: the prompt once
  EXPECT_EQ(s.generated_tokens, 14);
  EXPECT_EQ(s.reason, FinishReason::kLength);
  ASSERT_EQ(s.choices.size(), 3u);
  EXPECT_EQ(s.choices[1].reason, FinishReason::kStop);
  EXPECT_EQ(s.choices[1].trailing_text, "x");
  EXPECT_EQ(s.choices[2].generated_tokens, 5);
  f.fan_in->WriteDone(true);  // nothing in flight: ignored
  EXPECT_EQ(f.transport.finishes, 1);
}

TEST(ChoiceFanInTest, AFailedChoiceCancelsTheOthersAndFailsTheRequest) {
  Fixture f(3);
  f.fan_in->Start();
  f.fan_in->member(2)->OnFinish(absl::ResourceExhaustedError("no room"), GenerateSummary{});
  EXPECT_EQ(f.controls[0]->cancels, 1);
  EXPECT_EQ(f.controls[1]->cancels, 1);
  EXPECT_EQ(f.controls[2]->cancels, 0);
  f.fan_in->member(0)->OnFinish(absl::OkStatus(), Ended(FinishReason::kCancelled, 3, 0));
  EXPECT_EQ(f.transport.finishes, 0);
  f.fan_in->member(1)->OnFinish(absl::OkStatus(), Ended(FinishReason::kCancelled, 0, 0));
  ASSERT_EQ(f.transport.finishes, 1);
  EXPECT_EQ(f.transport.status.code(), absl::StatusCode::kResourceExhausted);
}

TEST(ChoiceFanInTest, CancelReachesEveryChoiceAndOneRefusedOnTheWayFailsTheRest) {
  Recorder transport;
  auto fan_in = ChoiceFanIn::Create(&transport, 3);
  auto first = std::make_shared<FakeControl>();
  fan_in->member(0)->OnStart(first);
  fan_in->Start();
  fan_in->Cancel();
  EXPECT_EQ(first->cancels, 1);
  auto late = std::make_shared<FakeControl>();  // starts after the cancel: cancelled at once
  fan_in->member(1)->OnStart(late);
  EXPECT_EQ(late->cancels, 1);
  fan_in->Refused(2, absl::UnavailableError("queue full"));
  fan_in->member(0)->OnFinish(absl::OkStatus(), Ended(FinishReason::kCancelled, 2, 0));
  fan_in->member(1)->OnFinish(absl::OkStatus(), Ended(FinishReason::kCancelled, 0, 0));
  ASSERT_EQ(transport.finishes, 1);
  EXPECT_EQ(transport.status.code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fwserve
