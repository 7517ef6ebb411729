#include "server/transport/grpc/proto_conversion.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace fwserve {

void ToProto(const SessionRecord& record, v1::SessionInfo* info) {
  info->set_session_id(record.id);
  info->set_model(record.model);
  info->set_tokens(record.tokens);
  info->set_state_bytes(record.state_bytes);
  info->set_created_unix_ms(absl::ToUnixMillis(record.created));
  info->set_last_used_unix_ms(absl::ToUnixMillis(record.last_used));
  info->set_resident(record.resident);
  info->set_busy(record.busy);
}

void ToProto(const ModelDescription& d, v1::ModelInfo* info) {
  info->set_name(d.name);
  info->set_is_default(d.is_default);
  info->set_architecture(d.architecture);
  info->set_config_json(d.config_json);
  info->set_parameters(d.parameters);
  info->set_state_bytes_per_session(d.state_bytes_per_session);
  info->set_vocab_size(d.vocab_size);
  info->set_fingerprint(d.fingerprint);
  info->set_memory_slots(d.memory_slots);
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kShutdown:
      return v1::FINISH_REASON_SHUTDOWN;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

GenerateParams FromProto(const v1::GenerateRequest& request) {
  GenerateParams params;
  params.model = request.model();
  params.session_id = request.session_id();
  params.fork_from = request.fork_from();
  params.store = !request.has_store() || request.store();
  params.prompt = request.prompt();
  const v1::SamplingParams& s = request.sampling();
  params.sampling.temperature = s.has_temperature() ? s.temperature() : 1.0f;
  params.sampling.top_k = s.top_k();
  params.sampling.top_p = s.top_p() == 0 ? 1.0f : s.top_p();
  params.sampling.min_p = s.min_p();
  params.sampling.repetition_penalty = s.repetition_penalty() == 0 ? 1.0f : s.repetition_penalty();
  params.repetition_window = s.repetition_window() == 0 ? 64 : s.repetition_window();
  params.random_seed = !s.has_seed();
  params.sampling.seed = s.seed();
  params.sampling.logit_bias.assign(s.logit_bias().begin(), s.logit_bias().end());
  std::sort(params.sampling.logit_bias.begin(), params.sampling.logit_bias.end());
  params.sampling.presence_penalty = s.presence_penalty();
  params.sampling.frequency_penalty = s.frequency_penalty();
  params.max_tokens = request.max_tokens();
  params.stop.assign(request.stop().begin(), request.stop().end());
  params.logprobs = request.logprobs();
  params.top_logprobs = request.top_logprobs();
  params.choices = request.n() == 0 ? 1 : request.n();
  params.min_tokens_per_message = request.stream().min_tokens_per_message();
  params.max_message_delay = absl::Milliseconds(request.stream().max_message_delay_ms());
  return params;
}

absl::StatusOr<std::shared_ptr<const constraints::Grammar>> ConstraintFromProto(
    const v1::GenerateRequest& request) {
  if (!request.has_response_format()) return nullptr;
  const v1::ResponseFormat& format = request.response_format();
  switch (format.format_case()) {
    case v1::ResponseFormat::kJsonObject:
      if (!format.json_object()) return nullptr;
      return constraints::AnyJsonObject();
    case v1::ResponseFormat::kJsonSchema: {
      const nlohmann::json schema =
          nlohmann::json::parse(format.json_schema(), nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) {
        return absl::InvalidArgumentError("response_format.json_schema: not valid JSON");
      }
      auto grammar = constraints::CompileJsonSchemaCached(schema);
      if (!grammar.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("response_format.json_schema: ", grammar.status().message()));
      }
      return grammar;
    }
    case v1::ResponseFormat::FORMAT_NOT_SET:
      break;
  }
  return nullptr;
}

}  // namespace fwserve
