// The torch-free half of the session-state encoding (state_codec.h): the format's
// fields, its checksum, and reading an encoded state's metadata without decoding its
// tensors (for indexing a session store at start-up, above the engine).
#pragma once

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fwmodel {

class SafetensorsFile;  // models/checkpoints/safetensors.h

// Metadata values of every encoded state: format, version, and the checksum's key.
extern const char kStateFormat[];
extern const char kStateVersion[];
extern const char kStateChecksumKey[];

// Hex SHA-256 of arbitrary bytes.
std::string Sha256Hex(const std::string& bytes);

// The checksum of an encoded state: SHA-256 over every metadata field but the checksum
// itself (key and value, NUL-terminated, in key order), a NUL, then `data` (the data
// section).
std::string StateChecksum(const std::map<std::string, std::string>& metadata,
                          const std::string& data);
// The data section of `file`: its tensors' bytes in name order.
std::string StateDataSection(const SafetensorsFile& file);
// InvalidArgument unless `metadata` names this format and version.
absl::Status CheckStateFormat(const std::map<std::string, std::string>& metadata);

// The metadata of an encoded state, checksum verified, without decoding the tensors.
// InvalidArgument if it is not an fwserve state of this version or fails its checksum.
absl::StatusOr<std::map<std::string, std::string>> PeekStateMetadata(std::string bytes);

}  // namespace fwmodel
