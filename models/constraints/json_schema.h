// JSON Schema -> Grammar: the subset OpenAI-style structured output needs (what the AI
// SDK's zod-to-json-schema, Pydantic and OpenAI's strict mode emit), compiled to a byte
// automaton whose documents are exactly the compact-or-lightly-spaced JSON texts that
// validate. docs/structured-output.md lists the subset, the bounds and what is refused.
// Torch-free.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "models/constraints/grammar.h"
#include "nlohmann/json.hpp"

namespace fwserve::constraints {

struct JsonSchemaOptions {
  // The longest run of whitespace bytes (space, \n, \t, \r) allowed between two JSON
  // tokens, so that a model cannot pad forever. 2 allows ", " and ": " and a newline
  // with one space; pretty-printed output needs 1 + 2 x nesting. Range [0, 64].
  int max_whitespace = 2;
  // Digits allowed in a number's integer part, its fraction and its exponent (bounded so
  // that a number ends, and is a finite double: exponents stay below 100). Ranges [1, 18],
  // [0, 32] (0: no fraction), [0, 2] (0: no exponent).
  int max_integer_digits = 16;
  int max_fraction_digits = 16;
  int max_exponent_digits = 2;
  // The deepest nesting of recursive values (a $ref cycle, or the values of an
  // unconstrained `{}` schema), counted as the matcher's stack depth; deeper values are
  // refused. Range [2, 200].
  int max_recursion_depth = 64;
  // The compiled automaton's state limit: larger schemas are refused (InvalidArgument).
  int max_states = 200000;
};

// Compiles `schema`. InvalidArgument naming the option for options out of range; naming the keyword
// and its JSON pointer for anything outside the subset (never a silent pass), e.g. "unsupported
// keyword 'patternProperties' at /properties/tags"; also for schemas that match nothing or exceed
// the limits. Properties are generated in the order the JSON object iterates them: alphabetical for
// nlohmann::json (a std::map), declaration order for nlohmann::ordered_json.
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(
    const nlohmann::json& schema, const JsonSchemaOptions& options = {});
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(
    const nlohmann::ordered_json& schema, const JsonSchemaOptions& options = {});

// OpenAI's response_format json_object: any JSON object (values of any type, nested to
// options.max_recursion_depth). Never fails: options out of range are clamped into it.
std::shared_ptr<const Grammar> AnyJsonObject(const JsonSchemaOptions& options = {});

// CompileJsonSchema with the default options, through a process-wide cache of the last
// kCompiledSchemaCacheEntries schemas that compiled, keyed by their JSON text: a client
// that sends the same schema with every request (what the SDKs do) compiles it once, not
// per request (a typical schema takes milliseconds, more than a short reply's tokens).
// Errors are not cached. Thread-safe.
inline constexpr size_t kCompiledSchemaCacheEntries = 256;
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchemaCached(
    const nlohmann::json& schema);
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchemaCached(
    const nlohmann::ordered_json& schema);

}  // namespace fwserve::constraints
