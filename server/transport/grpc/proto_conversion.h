// Between the API's protos and the core's vocabulary (server/api/requests.h): the one
// home of the proto defaults (an unset temperature is 1, an unset top_p is 1, ...;
// docs/serving.md lists them). Torch-free.
#pragma once

#include "fwserve/v1/fwserve.pb.h"
#include "server/api/requests.h"

namespace fwserve {

void ToProto(const SessionRecord& record, v1::SessionInfo* info);
void ToProto(const ModelDescription& description, v1::ModelInfo* info);
v1::FinishReason ToProto(FinishReason reason);
// The request's parameters with the API's defaults filled in; an unset seed draws a
// random one (GenerateParams::random_seed).
GenerateParams FromProto(const v1::GenerateRequest& request);

}  // namespace fwserve
