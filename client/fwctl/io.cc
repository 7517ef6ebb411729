#include "client/fwctl/io.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "client/fwctl/cli.h"
#include "google/protobuf/util/json_util.h"

namespace fwctl {

int RpcError(const absl::Status& status) {
  std::fprintf(stderr, "fwctl: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return kExitError;
}

int LocalError(const std::string& message) {
  std::fprintf(stderr, "fwctl: %s\n", message.c_str());
  return kExitError;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  if (path == "-") {
    std::ostringstream out;
    out << std::cin.rdbuf();
    return out.str();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", path, "'"));
  return out.str();
}

absl::Status WriteFile(const std::string& path, const std::string& data) {
  if (path == "-") {
    if (std::fwrite(data.data(), 1, data.size(), stdout) != data.size() ||
        std::fflush(stdout) != 0) {
      return absl::DataLossError("error writing to stdout");
    }
    return absl::OkStatus();
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

void WriteOut(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

std::string FormatUnixMs(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

std::string ShowByteToken(int64_t token) {
  if (token < 0 || token > 255) return absl::StrCat("<", token, ">");
  const unsigned char c = static_cast<unsigned char>(token);
  switch (c) {
    case '\n':
      return "\"\\n\"";
    case '\t':
      return "\"\\t\"";
    case '\r':
      return "\"\\r\"";
    case '\\':
      return "\"\\\\\"";
    case '"':
      return "\"\\\"\"";
    default:
      break;
  }
  if (c >= 0x20 && c < 0x7f) return absl::StrCat("\"", std::string(1, static_cast<char>(c)), "\"");
  return absl::StrFormat("\"\\x%02x\"", c);
}

std::string UnescapeC(const std::string& text) {
  return absl::StrReplaceAll(text, {{"\\n", "\n"}, {"\\t", "\t"}, {"\\\\", "\\"}});
}

}  // namespace fwctl
