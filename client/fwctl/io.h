// What fwctl's commands share for input and output: files (with '-' for stdin/stdout),
// stdout writes, JSON, and the messages of the errors that exit 1.
#ifndef FWSERVE_CLIENT_FWCTL_IO_H_
#define FWSERVE_CLIENT_FWCTL_IO_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/message.h"

namespace fwctl {

// "fwctl: CODE: message" (the gRPC code name) on stderr; returns kExitError.
int RpcError(const absl::Status& status);
// "fwctl: message" on stderr; returns kExitError.
int LocalError(const std::string& message);

// The whole file, or stdin for "-". NOT_FOUND "cannot read 'PATH'" when it cannot be
// opened.
absl::StatusOr<std::string> ReadFile(const std::string& path);
// Replaces the file, or writes to stdout for "-".
absl::Status WriteFile(const std::string& path, const std::string& data);
// Writes to stdout and flushes, so that streamed text appears as it arrives.
void WriteOut(const std::string& text);

// The proto3 JSON mapping with the proto's field names and every field, on one line.
std::string ToJson(const google::protobuf::Message& message);
// "2024-05-01T12:00:00.000Z" (UTC), or "-" for 0.
std::string FormatUnixMs(int64_t unix_ms);
// A byte token for display, C-quoted: "T", " ", "\n", "\xc3" (ids past 255: <id>).
std::string ShowByteToken(int64_t token);
// Option text with the C escapes \n, \t and \\ replaced (a shell makes real newlines
// awkward).
std::string UnescapeC(const std::string& text);

}  // namespace fwctl

#endif  // FWSERVE_CLIENT_FWCTL_IO_H_
