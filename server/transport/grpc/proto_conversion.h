// Between the API's protos and the core's vocabulary (server/api/requests.h): the one
// home of the proto defaults (an unset temperature is 1, an unset top_p is 1, ...;
// docs/serving.md lists them). Torch-free.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "fwserve/v1/fwserve.pb.h"
#include "models/constraints/json_schema.h"
#include "server/api/requests.h"

namespace fwserve {

void ToProto(const SessionRecord& record, v1::SessionInfo* info);
void ToProto(const ModelDescription& description, v1::ModelInfo* info);
v1::FinishReason ToProto(FinishReason reason);
// The request's parameters with the API's defaults filled in; an unset seed draws a
// random one (GenerateParams::random_seed).
GenerateParams FromProto(const v1::GenerateRequest& request);
// The request's response_format as a constraint (null when unset): INVALID_ARGUMENT
// naming `response_format.json_schema` (and the schema keyword) when the schema is not
// JSON or leaves the supported subset.
absl::StatusOr<std::shared_ptr<const constraints::Grammar>> ConstraintFromProto(
    const v1::GenerateRequest& request);

}  // namespace fwserve
