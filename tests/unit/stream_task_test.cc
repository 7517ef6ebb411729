// StreamTask without a model or an engine: stop strings across token and chunk edges,
// max tokens, the lookahead bound, flush timing, the rollback point a failed write
// or a cancellation returns to (with the text decoder put back too), and the output
// text the session keeps.
#include "server/engine/stream_task.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "models/base/config.h"
#include "models/tokenizers/text_tokenizer.h"

namespace fwserve {
namespace {

const absl::Time kStreamT0 = absl::FromUnixSeconds(1'700'000'000);

StreamLimits Limits(int64_t max_tokens, std::vector<std::string> stop = {},
                    int64_t lookahead = 16) {
  StreamLimits limits;
  limits.max_tokens = max_tokens;
  limits.stop = std::move(stop);
  limits.lookahead = lookahead;
  return limits;
}

// Samples the bytes of `text` one token each, writing a chunk whenever the stream
// says so and confirming it at once; returns the chunks' texts.
std::vector<std::string> SampleAll(StreamTask& stream, const std::string& text) {
  std::vector<std::string> chunks;
  for (unsigned char byte : text) {
    if (stream.done_sampling()) break;
    stream.AddSampled(byte, 0.0f, kStreamT0);
    if (stream.ShouldFlush(kStreamT0)) {
      chunks.push_back(stream.TakeChunkForWrite().text);
      stream.ConfirmWrite();
    }
  }
  return chunks;
}

TEST(StreamTaskTest, StopsAtMaxTokens) {
  StreamTask stream(Limits(/*max_tokens=*/3));
  EXPECT_FALSE(stream.done_sampling());
  SampleAll(stream, "abcdef");
  EXPECT_TRUE(stream.done_sampling());
  EXPECT_FALSE(stream.stop_hit());
  EXPECT_EQ(stream.sampled(), 3);
  EXPECT_EQ(stream.confirmed(), 3);
}

TEST(StreamTaskTest, AStopStringSpanningTokensAndChunksIsFound) {
  // With no flush interval every token is its own chunk: "\n\n" spans two chunks.
  StreamTask stream(Limits(/*max_tokens=*/100, {"\n\n"}));
  std::vector<std::string> chunks = SampleAll(stream, "ab\n\ncd");
  EXPECT_TRUE(stream.stop_hit());
  EXPECT_TRUE(stream.done_sampling());
  EXPECT_EQ(stream.sampled(), 4);  // stops right after the token completing the stop
  EXPECT_EQ(chunks, (std::vector<std::string>{"a", "b", "\n", "\n"}));
}

TEST(StreamTaskTest, AStopStringAcrossAChunkHeldByTheFlushIntervalIsFound) {
  StreamLimits limits = Limits(/*max_tokens=*/100, {"END"});
  limits.flush_interval = absl::Milliseconds(10);
  StreamTask stream(limits);
  stream.AddSampled('x', 0, kStreamT0);
  stream.AddSampled('E', 0, kStreamT0);
  EXPECT_FALSE(stream.ShouldFlush(kStreamT0 + absl::Milliseconds(5)));  // held for company
  EXPECT_TRUE(stream.ShouldFlush(kStreamT0 + absl::Milliseconds(10)));
  EXPECT_EQ(stream.TakeChunkForWrite().text, "xE");
  stream.AddSampled('N', 0, kStreamT0 + absl::Milliseconds(11));
  stream.AddSampled('D', 0, kStreamT0 + absl::Milliseconds(12));
  EXPECT_TRUE(stream.stop_hit());
  // Sampling is done: the rest goes out at once, without waiting for the interval.
  EXPECT_TRUE(stream.ShouldFlush(kStreamT0 + absl::Milliseconds(12)));
}

// A request's min_tokens_per_message (v1::StreamOptions): a message waits for that many
// tokens, whatever the time, unless the request also bounds the wait; the end of
// sampling sends what is left.
TEST(StreamTaskTest, AMinimumOfTokensPerMessageHoldsTokensUntilItIsReached) {
  StreamLimits limits = Limits(/*max_tokens=*/7, {});
  limits.min_tokens_per_message = 3;
  limits.flush_interval = absl::InfiniteDuration();  // no max_message_delay_ms
  StreamTask stream(limits);
  stream.AddSampled('a', 0, kStreamT0);
  stream.AddSampled('b', 0, kStreamT0);
  EXPECT_FALSE(stream.ShouldFlush(kStreamT0 + absl::Hours(1)));
  stream.AddSampled('c', 0, kStreamT0);
  EXPECT_TRUE(stream.ShouldFlush(kStreamT0));
  EXPECT_EQ(stream.TakeChunkForWrite().text, "abc");
  stream.ConfirmWrite();
  for (char c : std::string("defg")) stream.AddSampled(c, 0, kStreamT0);
  EXPECT_TRUE(stream.done_sampling());
  EXPECT_TRUE(stream.ShouldFlush(kStreamT0));
  EXPECT_EQ(stream.TakeChunkForWrite().text, "defg");

  // With max_message_delay_ms 10: a lone token goes after 10 ms.
  limits.flush_interval = absl::Milliseconds(10);
  StreamTask bounded(limits);
  bounded.AddSampled('a', 0, kStreamT0);
  EXPECT_FALSE(bounded.ShouldFlush(kStreamT0 + absl::Milliseconds(9)));
  EXPECT_TRUE(bounded.ShouldFlush(kStreamT0 + absl::Milliseconds(10)));
}

TEST(StreamTaskTest, AStopStringInsideAMultiByteCharacterMatchesBytes) {
  StreamTask stream(Limits(/*max_tokens=*/100, {"\xC3\xA9"}));  // "é"
  SampleAll(stream, "caf\xC3\xA9 au lait");
  EXPECT_TRUE(stream.stop_hit());
  EXPECT_EQ(stream.sampled(), 5);
}

TEST(StreamTaskTest, LookaheadBoundsUnconfirmedTokens) {
  StreamTask stream(Limits(/*max_tokens=*/100, {}, /*lookahead=*/3));
  stream.AddSampled('a', 0, kStreamT0);
  GenerateChunk first = stream.TakeChunkForWrite();  // in flight, unconfirmed
  EXPECT_TRUE(stream.write_in_flight());
  stream.AddSampled('b', 0, kStreamT0);
  EXPECT_TRUE(stream.CanSample());
  stream.AddSampled('c', 0, kStreamT0);
  EXPECT_FALSE(stream.CanSample());  // 1 in flight + 2 unsent = lookahead
  stream.ConfirmWrite();
  EXPECT_EQ(stream.confirmed(), 1);
  EXPECT_TRUE(stream.CanSample());
  EXPECT_EQ(stream.TakeChunkForWrite().text, "bc");
}

TEST(StreamTaskTest, AFailedWriteRollsBackToBeforeTheChunkInFlight) {
  StreamTask stream(Limits(/*max_tokens=*/100));
  stream.AddSampled('a', 0, kStreamT0);
  (void)stream.TakeChunkForWrite();
  stream.ConfirmWrite();  // "a" is the client's
  stream.AddSampled('b', 0, kStreamT0);
  (void)stream.TakeChunkForWrite();      // "b" in flight
  stream.AddSampled('c', 0, kStreamT0);  // "c" unsent
  EXPECT_EQ(stream.DropUnconfirmed(), StreamTask::RollbackPoint::kBeforeInflight);
  EXPECT_FALSE(stream.write_in_flight());
  EXPECT_FALSE(stream.has_unsent());
  EXPECT_EQ(stream.confirmed(), 1);
  // Nothing is unconfirmed any more.
  EXPECT_EQ(stream.DropUnconfirmed(), StreamTask::RollbackPoint::kNone);
}

TEST(StreamTaskTest, ACancellationWithOnlyUnsentTokensRollsBackToBeforeThem) {
  StreamTask stream(Limits(/*max_tokens=*/100));
  stream.AddSampled('a', 0, kStreamT0);
  (void)stream.TakeChunkForWrite();
  stream.ConfirmWrite();
  stream.AddSampled('b', 0, kStreamT0);
  EXPECT_EQ(stream.DropUnconfirmed(), StreamTask::RollbackPoint::kBeforeUnsent);
}

TEST(StreamTaskTest, TheDecoderIsRolledBackWithTheTokens) {
  // "é" is two bytes. The first goes out and is confirmed (no text yet: the character
  // is incomplete); the second's write fails. The decoder must be back to holding one
  // byte, so that the final text reports the incomplete character, not a whole "é".
  StreamTask stream(Limits(/*max_tokens=*/100));
  stream.AddSampled(0xC3, 0, kStreamT0);
  EXPECT_EQ(stream.TakeChunkForWrite().text, "");
  stream.ConfirmWrite();
  stream.AddSampled(0xA9, 0, kStreamT0);
  EXPECT_EQ(stream.TakeChunkForWrite().text, "\xC3\xA9");
  EXPECT_EQ(stream.DropUnconfirmed(), StreamTask::RollbackPoint::kBeforeInflight);
  EXPECT_EQ(stream.FinishText(), "\xEF\xBF\xBD");  // U+FFFD for the lone lead byte
}

TEST(StreamTaskTest, TheOutputIsTheConfirmedChunksTextThenTheTrailingText) {
  StreamTask stream(Limits(/*max_tokens=*/100));
  stream.AddSampled('a', 0, kStreamT0);
  stream.AddSampled(0xC3, 0, kStreamT0);  // the first byte of "é": held back by the decoder
  EXPECT_EQ(stream.TakeChunkForWrite().text, "a");
  EXPECT_EQ(stream.output().text, "");  // in flight: not the client's yet
  stream.ConfirmWrite();
  EXPECT_EQ(stream.output().text, "a");
  stream.AddSampled(0xA9, 0, kStreamT0);
  (void)stream.TakeChunkForWrite();      // "é" in flight
  stream.AddSampled('z', 0, kStreamT0);  // unsent
  (void)stream.DropUnconfirmed();        // the write failed: "é" and "z" never arrived
  EXPECT_EQ(stream.output().text, "a");
  // The trailing text (the lone lead byte as U+FFFD) ends the output, as it ends the
  // text the client receives.
  EXPECT_EQ(stream.FinishText(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.output().text, "a\xEF\xBF\xBD");
  EXPECT_FALSE(stream.output().truncated);
}

TEST(StreamTaskTest, TheOutputKeepsItsFirstBytesAndSaysItWasCut) {
  const size_t max = LastOutput::kMaxBytes;
  StreamTask stream(Limits(/*max_tokens=*/static_cast<int64_t>(max) + 10));
  // All but one byte of the bound in ASCII, then "é" (two bytes): it does not fit whole
  // and is left out rather than split.
  for (size_t i = 0; i + 1 < max; ++i) stream.AddSampled('x', 0, kStreamT0);
  stream.AddSampled(0xC3, 0, kStreamT0);
  stream.AddSampled(0xA9, 0, kStreamT0);
  stream.AddSampled('y', 0, kStreamT0);
  (void)stream.TakeChunkForWrite();
  stream.ConfirmWrite();
  EXPECT_EQ(stream.output().text, std::string(max - 1, 'x'));
  EXPECT_TRUE(stream.output().truncated);
  EXPECT_EQ(stream.FinishText(), "");
  EXPECT_EQ(stream.output().text.size(), max - 1);
}

TEST(StreamTaskTest, LogprobsAreKeptOnlyWhenAsked) {
  StreamLimits limits = Limits(/*max_tokens=*/10);
  limits.logprobs = true;
  StreamTask with(limits);
  with.AddSampled('a', -0.5f, kStreamT0);
  GenerateChunk chunk = with.TakeChunkForWrite();
  ASSERT_EQ(chunk.logprobs.size(), 1u);
  EXPECT_FLOAT_EQ(chunk.logprobs[0], -0.5f);
  StreamTask without(Limits(/*max_tokens=*/10));
  without.AddSampled('a', -0.5f, kStreamT0);
  EXPECT_TRUE(without.TakeChunkForWrite().logprobs.empty());
}

// With a model's world vocabulary, a token stands for its bytes (a character split
// across two tokens comes out whole, once both are in), and end of text ends sampling
// like a stop string, adding no text.
TEST(StreamTaskTest, AWorldVocabularyStreamsTokenBytesAndStopsAtEndOfText) {
  fwmodel::ModelConfig config;
  config.tokenizer = "rwkv_world";
  config.vocab_size = 65536;
  auto tokenizer = fwmodel::TextTokenizer::ForModel(
      config, std::string(FWSERVE_SOURCE_DIR) + "/tests/data/rwkv");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  StreamLimits limits;
  limits.max_tokens = 100;
  limits.tokenizer = &*tokenizer;
  StreamTask stream(limits);
  const absl::Time now = absl::FromUnixSeconds(1);
  const std::string text = "Hello, world! \xe4\xb8\x96\xe7\x95\x8c";  // ends in two CJK chars
  std::string streamed;
  for (int64_t id : tokenizer->Encode(text)) {
    stream.AddSampled(id, 0.0f, now);
    ASSERT_FALSE(stream.done_sampling());
  }
  // "\xe4" alone (id 229 + 1) is one byte of a character: held back until the rest.
  stream.AddSampled(0xe4 + 1, 0.0f, now);
  stream.AddSampled(0xb8 + 1, 0.0f, now);
  stream.AddSampled(0x96 + 1, 0.0f, now);
  GenerateChunk chunk = stream.TakeChunkForWrite();
  EXPECT_EQ(chunk.text, text + "\xe4\xb8\x96");
  stream.ConfirmWrite();
  stream.AddSampled(tokenizer->end_of_text(), 0.0f, now);
  EXPECT_TRUE(stream.done_sampling());
  EXPECT_TRUE(stream.stop_hit());
  EXPECT_EQ(stream.TakeChunkForWrite().text, "");
}

}  // namespace
}  // namespace fwserve
