#include "models/checkpoints/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>

namespace {

using fwmodel::DType;
using fwmodel::SafetensorsFile;

// A file from a literal header and data section.
std::string MakeFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string Floats(std::vector<float> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

void ExpectRejected(const std::string& file, const std::string& fragment) {
  auto parsed = SafetensorsFile::Parse(file);
  ASSERT_FALSE(parsed.ok()) << "accepted a file that should fail with: " << fragment;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find(fragment), std::string::npos)
      << parsed.status().message();
}

TEST(SafetensorsTest, WrittenFileParsesBackBitExactly) {
  std::vector<fwmodel::TensorBlob> blobs;
  blobs.push_back({"b", DType::kF32, {2}, Floats({1.5f, -0.0f})});
  blobs.push_back({"a", DType::kF32, {1, 3}, Floats({3.0f, 1e-30f, -7.25f})});
  auto bytes = fwmodel::SerializeSafetensors(blobs, {{"format", "pt"}});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((8 +
             [&] {
               uint64_t n = 0;
               std::memcpy(&n, bytes->data(), 8);
               return n;
             }()) %
                8,
            0u);
  auto file = SafetensorsFile::Parse(*bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const auto& a = file->tensors().at("a");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(a.data), a.nbytes), blobs[1].bytes);
  EXPECT_EQ(file->tensors().at("b").ToFloat32(), (std::vector<float>{1.5f, -0.0f}));
}

TEST(SafetensorsTest, HalfAndBfloat16AreWidenedExactly) {
  // F16 0x3C00 = 1, 0xC000 = -2, 0x0001 = 2^-24; BF16 0x3F80 = 1, 0x4049 = 3.140625.
  std::string f16 = std::string("\x00\x3C\x00\xC0\x01\x00", 6);
  std::string bf16 = std::string("\x80\x3F\x49\x40", 4);
  std::string file = MakeFile(
      R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]}})",
      f16 + bf16);
  auto parsed = SafetensorsFile::Parse(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tensors().at("h").ToFloat32(),
            (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24)}));
  EXPECT_EQ(parsed->tensors().at("b").ToFloat32(), (std::vector<float>{1.0f, 3.140625f}));
}

TEST(SafetensorsTest, FloatToHalfRoundsToNearestEven) {
  for (uint32_t h = 0; h < 0x7c00; h += 7) {  // every 7th finite positive half
    const float f = fwmodel::HalfToFloat(static_cast<uint16_t>(h));
    EXPECT_EQ(fwmodel::FloatToHalf(f), h) << h;
  }
  EXPECT_EQ(fwmodel::FloatToHalf(1e6f), 0x7c00);  // overflow to inf
  EXPECT_EQ(fwmodel::FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(fwmodel::BFloat16ToFloat(fwmodel::FloatToBFloat16(3.14159f)), 3.140625f);
}

TEST(SafetensorsTest, EmptyTensorsAreAllowed) {
  auto parsed = SafetensorsFile::Parse(
      MakeFile(R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}})", ""));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tensors().at("e").numel(), 0);
}

TEST(SafetensorsRejectionTest, FileShorterThanHeaderLength) {
  ExpectRejected("abc", "shorter than the 8-byte header length");
  std::string file = MakeFile(R"({})", "");
  file[0] = 100;  // claims a 100-byte header
  ExpectRejected(file, "file is shorter than it says");
}

TEST(SafetensorsRejectionTest, HeaderThatIsNotJson) {
  ExpectRejected(MakeFile("{\"a\": ", ""), "header is not valid JSON");
  ExpectRejected(MakeFile("[1]", ""), "header must be a JSON object");
}

TEST(SafetensorsRejectionTest, UnsupportedDtypeNamesTheTensor) {
  ExpectRejected(
      MakeFile(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0')),
      "tensor 'w': unsupported dtype F64");
  ExpectRejected(
      MakeFile(R"({"w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0')),
      "tensor 'w': unsupported dtype I8");
}

TEST(SafetensorsRejectionTest, OffsetsOutsideTheFile) {
  ExpectRejected(
      MakeFile(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", Floats({1, 2})),
      "tensor 'w': data_offsets [0, 16] lie outside the data section of 8 bytes");
  ExpectRejected(
      MakeFile(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", Floats({1, 2})),
      "tensor 'w': data_offsets [8, 4] has begin > end");
}

TEST(SafetensorsRejectionTest, SpanThatDoesNotMatchShape) {
  ExpectRejected(
      MakeFile(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", Floats({1, 2})),
      "tensor 'w': data_offsets span 8 bytes but shape [3] of F32 needs 12");
}

TEST(SafetensorsRejectionTest, OverlappingTensors) {
  ExpectRejected(
      MakeFile(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          Floats({1, 2, 3})),
      "tensor 'b': data_offsets overlap those of tensor 'a'");
}

TEST(SafetensorsRejectionTest, BytesThatBelongToNoTensor) {
  ExpectRejected(
      MakeFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", Floats({1, 2})),
      "data section bytes [0, 4) belong to no tensor");
  ExpectRejected(
      MakeFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Floats({1, 2})),
      "4 trailing bytes");
}

TEST(SafetensorsRejectionTest, MalformedEntries) {
  ExpectRejected(
      MakeFile(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          Floats({1})),
      "tensor 'a': appears twice");
  ExpectRejected(
      MakeFile(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", Floats({1})),
      "tensor 'a': shape entry -1");
  ExpectRejected(MakeFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", Floats({1})),
                 "tensor 'a': 'data_offsets' must be [begin, end]");
  ExpectRejected(
      MakeFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", Floats({1})),
      "tensor 'a': unknown header field 'extra'");
  ExpectRejected(MakeFile(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", Floats({1})),
                 "tensor 'a': missing or non-string 'dtype'");
  ExpectRejected(MakeFile(R"({"__metadata__":{"k":1}})", ""), "__metadata__ value for 'k'");
}

}  // namespace
