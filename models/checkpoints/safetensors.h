// Strict reader and writer for the safetensors format (torch-free).
//
// Layout: u64 little-endian header length N, N bytes of JSON header, then the data
// section. The reader rejects, with a message naming the tensor: a header that is not
// valid JSON, duplicate names, an entry without exactly {dtype, shape, data_offsets},
// an unsupported dtype, offsets outside the data section, a byte span that does not
// match the shape, overlapping tensors, bytes covered by no tensor, and a file shorter
// than its header length says.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fwmodel {

// The dtypes a checkpoint may store. All are computed in float32 after loading.
enum class DType { kF32, kF16, kBF16 };

const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);

// One tensor inside a parsed file. `data` points into the owning SafetensorsFile's
// buffer and is valid as long as that object lives (and is not moved-from).
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  // Converts the elements to float32 (F16 and BF16 widened exactly).
  std::vector<float> ToFloat32() const;
};

class SafetensorsFile {
 public:
  // Takes ownership of the file's bytes and validates them. Errors are
  // InvalidArgument and name the offending tensor or header field.
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

 private:
  SafetensorsFile() = default;
  // Heap-allocated so TensorView pointers stay valid when the object moves.
  std::unique_ptr<std::string> bytes_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: raw little-endian element bytes in `dtype`.
struct TensorBlob {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;
};

// Serialises tensors (written in name order, contiguous, header padded with spaces
// to a multiple of 8 bytes as the reference implementation does).
absl::StatusOr<std::string> SerializeSafetensors(
    std::vector<TensorBlob> tensors, const std::map<std::string, std::string>& metadata);

// Float conversions used by the reader and writer.
float HalfToFloat(uint16_t h);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToHalf(float f);      // round to nearest even
uint16_t FloatToBFloat16(float f);  // round to nearest even

}  // namespace fwmodel
