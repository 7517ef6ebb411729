#include "models/tokenizers/tokenizer.h"

#include <gtest/gtest.h>

namespace {

using fwmodel::DecodeBytesLossy;
using fwmodel::Utf8StreamDecoder;

constexpr char kFffd[] = "\xEF\xBF\xBD";

TEST(ByteTokenizerTest, TokenIdsAreByteValues) {
  EXPECT_EQ(fwmodel::EncodeBytes("A\n\xC3\xA9"), (std::vector<int64_t>{65, 10, 0xC3, 0xA9}));
  EXPECT_TRUE(fwmodel::EncodeBytes("").empty());
}

TEST(Utf8StreamDecoderTest, MultiByteCharactersAreHeldUntilComplete) {
  // "é€😀" = C3 A9, E2 82 AC, F0 9F 98 80, fed one byte at a time.
  Utf8StreamDecoder d;
  EXPECT_EQ(d.Push(0xC3), "");
  EXPECT_EQ(d.pending_bytes(), 1u);
  EXPECT_EQ(d.Push(0xA9), "\xC3\xA9");
  EXPECT_EQ(d.Push(0xE2), "");
  EXPECT_EQ(d.Push(0x82), "");
  EXPECT_EQ(d.Push(0xAC), "\xE2\x82\xAC");
  EXPECT_EQ(d.Push(0xF0), "");
  EXPECT_EQ(d.Push(0x9F), "");
  EXPECT_EQ(d.Push(0x98), "");
  EXPECT_EQ(d.Push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(d.Push('a'), "a");
  EXPECT_EQ(d.Finish(), "");
}

TEST(Utf8StreamDecoderTest, TruncatedInputBecomesOneReplacement) {
  Utf8StreamDecoder d;
  EXPECT_EQ(d.Push(0xE2), "");
  EXPECT_EQ(d.Push(0x82), "");
  EXPECT_EQ(d.Finish(), kFffd);
  EXPECT_EQ(d.pending_bytes(), 0u);
  EXPECT_EQ(d.Push('x'), "x");  // reusable after Finish
}

TEST(Utf8StreamDecoderTest, InterruptedSequenceReplacesThenRestartsWithTheNewByte) {
  Utf8StreamDecoder d;
  EXPECT_EQ(d.Push(0xE2), "");
  EXPECT_EQ(d.Push('A'), std::string(kFffd) + "A");
  EXPECT_EQ(d.Push(0xC3), "");
  EXPECT_EQ(d.Push(0xC3), kFffd);  // a new lead byte ends the old sequence
  EXPECT_EQ(d.Push(0xA9), "\xC3\xA9");
}

TEST(Utf8StreamDecoderTest, NonByteTokensDecodeAsReplacement) {
  Utf8StreamDecoder d;
  EXPECT_EQ(d.Push(300), kFffd);
  EXPECT_EQ(d.Push(0xC3), "");
  EXPECT_EQ(d.Push(-1), std::string(kFffd) + kFffd);
}

// Examples from the Unicode Standard, Table 3-8 and the "maximal subpart" practice.
TEST(Utf8StreamDecoderTest, MaximalSubpartsFollowTheUnicodeRecommendation) {
  // Table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 -> a FFFD FFFD FFFD b FFFD c FFFD FFFD d
  EXPECT_EQ(DecodeBytesLossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            std::string("a") + kFffd + kFffd + kFffd + "b" + kFffd + "c" + kFffd + kFffd + "d");
  // Overlong encodings and surrogates: every byte is its own maximal subpart.
  EXPECT_EQ(DecodeBytesLossy("\xC0\xAF"), std::string(kFffd) + kFffd);
  EXPECT_EQ(DecodeBytesLossy("\xE0\x80\xAF"), std::string(kFffd) + kFffd + kFffd);
  EXPECT_EQ(DecodeBytesLossy("\xED\xA0\x80"), std::string(kFffd) + kFffd + kFffd);
  // Above U+10FFFF.
  EXPECT_EQ(DecodeBytesLossy("\xF4\x90\x80\x80"), std::string(kFffd) + kFffd + kFffd + kFffd);
  EXPECT_EQ(DecodeBytesLossy("\xF5"), kFffd);
  EXPECT_EQ(DecodeBytesLossy("\xFF"), kFffd);
  // Valid boundary characters survive.
  EXPECT_EQ(DecodeBytesLossy("\xF4\x8F\xBF\xBF"), "\xF4\x8F\xBF\xBF");
  EXPECT_EQ(DecodeBytesLossy("\xED\x9F\xBF"), "\xED\x9F\xBF");
  EXPECT_EQ(DecodeBytesLossy("\xE0\xA0\x80"), "\xE0\xA0\x80");
}

TEST(Utf8StreamDecoderTest, EveryPieceIsValidUtf8AndConcatenationMatchesWholeDecode) {
  const std::string bytes = "h\xC3\xA9llo \xE2\x82 w\xF0\x9F\x98\x80rld\xC3";
  Utf8StreamDecoder d;
  std::string streamed;
  for (char c : bytes) {
    std::string piece = d.Push(static_cast<uint8_t>(c));
    EXPECT_EQ(DecodeBytesLossy(piece), piece) << "piece is not valid UTF-8";
    streamed += piece;
  }
  streamed += d.Finish();
  EXPECT_EQ(streamed, DecodeBytesLossy(bytes));
  EXPECT_EQ(streamed, std::string("h\xC3\xA9llo ") + kFffd + " w\xF0\x9F\x98\x80rld" + kFffd);
}

}  // namespace
