#include "models/checkpoints/safetensors.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace fwmodel {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100u << 20;

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("model.safetensors: ", what));
}

absl::Status BadTensor(const std::string& name, const std::string& what) {
  return Bad(absl::StrCat("tensor '", name, "': ", what));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool ParseDType(const std::string& s, DType* out) {
  if (s == "F32") {
    *out = DType::kF32;
    return true;
  }
  if (s == "F16") {
    *out = DType::kF16;
    return true;
  }
  if (s == "BF16") {
    *out = DType::kBF16;
    return true;
  }
  return false;
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    // Subnormal half: normalise.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    mant &= 0x3ffu;
    return BitsFloat(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13));
  }
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (>= 65520) -> inf
  if (abs < 0x38800000u) {                        // subnormal or zero in half
    if (abs < 0x33000000u) return sign;           // < 2^-25 rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1
    uint32_t half_mant = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_mant & 1))) ++half_mant;
    return sign | static_cast<uint16_t>(half_mant);
  }
  uint32_t v = abs - (112u << 23);  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1);    // round to nearest even
  return sign | static_cast<uint16_t>(v >> 13);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> TensorView::ToFloat32() const {
  const int64_t n = numel();
  std::vector<float> out(static_cast<size_t>(n));
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), data, static_cast<size_t>(n) * 4);
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t raw;
    std::memcpy(&raw, data + 2 * i, 2);
    out[static_cast<size_t>(i)] = dtype == DType::kF16 ? HalfToFloat(raw) : BFloat16ToFloat(raw);
  }
  return out;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes) {
  SafetensorsFile file;
  file.bytes_ = std::make_unique<std::string>(std::move(bytes));
  const std::string& buf = *file.bytes_;
  if (buf.size() < 8) {
    return Bad(
        absl::StrCat("file is ", buf.size(), " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(buf[i]);
  if (header_len > kMaxHeaderBytes) {
    return Bad(
        absl::StrCat("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes));
  }
  if (header_len > buf.size() - 8) {
    return Bad(absl::StrCat("file is shorter than it says: header length ", header_len,
                            " but only ", buf.size() - 8, " bytes follow"));
  }
  const std::string header = buf.substr(8, header_len);

  // Reject duplicate top-level names, which plain parsing would silently merge.
  std::string duplicate;
  std::set<std::string> seen;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) {
      const std::string key = parsed.get<std::string>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json j = json::parse(header, on_event, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("header is not valid JSON");
  if (!j.is_object()) return Bad("header must be a JSON object");
  if (!duplicate.empty()) return BadTensor(duplicate, "appears twice in the header");

  const uint64_t data_size = buf.size() - 8 - header_len;
  const uint8_t* data_base = reinterpret_cast<const uint8_t*>(buf.data()) + 8 + header_len;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;

  for (const auto& item : j.items()) {
    const std::string& name = item.key();
    const json& entry = item.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) return Bad("__metadata__ must be an object of strings");
      for (const auto& m : entry.items()) {
        if (!m.value().is_string()) {
          return Bad(absl::StrCat("__metadata__ value for '", m.key(), "' must be a string"));
        }
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) return BadTensor(name, "header entry must be an object");
    for (const auto& field : entry.items()) {
      if (field.key() != "dtype" && field.key() != "shape" && field.key() != "data_offsets") {
        return BadTensor(name, absl::StrCat("unknown header field '", field.key(), "'"));
      }
    }
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) {
      return BadTensor(name, "missing or non-string 'dtype'");
    }
    TensorView view;
    const std::string dtype_name = entry["dtype"].get<std::string>();
    if (!ParseDType(dtype_name, &view.dtype)) {
      return BadTensor(
          name, absl::StrCat("unsupported dtype ", dtype_name, " (supported: F32, F16, BF16)"));
    }
    if (!entry.contains("shape") || !entry["shape"].is_array()) {
      return BadTensor(name, "missing or non-array 'shape'");
    }
    uint64_t numel = 1;
    for (const json& dim : entry["shape"]) {
      if (!dim.is_number_unsigned()) {
        return BadTensor(
            name, absl::StrCat("shape entry ", dim.dump(), " is not a non-negative integer"));
      }
      const uint64_t d = dim.get<uint64_t>();
      if (d > (1ull << 40) || (d != 0 && numel > (1ull << 40) / d)) {
        return BadTensor(name, "shape is too large");
      }
      numel *= d;
      view.shape.push_back(static_cast<int64_t>(d));
    }
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2 || !entry["data_offsets"][0].is_number_unsigned() ||
        !entry["data_offsets"][1].is_number_unsigned()) {
      return BadTensor(name, "'data_offsets' must be [begin, end] of non-negative integers");
    }
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    if (begin > end) {
      return BadTensor(name, absl::StrCat("data_offsets [", begin, ", ", end, "] has begin > end"));
    }
    if (end > data_size) {
      return BadTensor(name, absl::StrCat("data_offsets [", begin, ", ", end,
                                          "] lie outside the data section of ", data_size,
                                          " bytes (file truncated?)"));
    }
    const uint64_t expected = numel * DTypeSize(view.dtype);
    if (end - begin != expected) {
      return BadTensor(
          name, absl::StrCat("data_offsets span ", end - begin, " bytes but shape ",
                             ShapeString(view.shape), " of ", dtype_name, " needs ", expected));
    }
    view.data = data_base + begin;
    view.nbytes = end - begin;
    spans.push_back({begin, end, name});
    file.tensors_.emplace(name, std::move(view));
  }

  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const Span* previous = nullptr;
  for (const Span& span : spans) {
    if (span.begin == span.end) continue;  // empty tensors occupy no bytes
    if (span.begin < covered) {
      return BadTensor(span.name,
                       absl::StrCat("data_offsets overlap those of tensor '", previous->name, "'"));
    }
    if (span.begin > covered) {
      return Bad(
          absl::StrCat("data section bytes [", covered, ", ", span.begin, ") belong to no tensor"));
    }
    covered = span.end;
    previous = &span;
  }
  if (covered != data_size) {
    return Bad(absl::StrCat("data section has ", data_size - covered,
                            " trailing bytes that belong to no tensor"));
  }
  return file;
}

absl::StatusOr<std::string> SerializeSafetensors(
    std::vector<TensorBlob> tensors, const std::map<std::string, std::string>& metadata) {
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorBlob& a, const TensorBlob& b) { return a.name < b.name; });
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorBlob& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate or reserved tensor name '", t.name, "'"));
    }
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (static_cast<uint64_t>(numel) * DTypeSize(t.dtype) != t.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", t.bytes.size(),
                                                     " bytes do not match shape ",
                                                     ShapeString(t.shape)));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string header_text = header.dump();
  while ((8 + header_text.size()) % 8 != 0) header_text.push_back(' ');
  std::string out;
  out.reserve(8 + header_text.size() + offset);
  uint64_t n = header_text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += header_text;
  for (const TensorBlob& t : tensors) out += t.bytes;
  return out;
}

}  // namespace fwmodel
