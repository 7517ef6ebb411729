// fwctl's commands. Each function adds its command (or group of commands) to the
// program, in the order `fwctl --help` lists them; `global` is read when a command runs
// and must outlive the program.
#ifndef FWSERVE_CLIENT_FWCTL_COMMANDS_H_
#define FWSERVE_CLIENT_FWCTL_COMMANDS_H_

#include <CLI/CLI.hpp>

#include "client/fwctl/options.h"

namespace fwctl {

// The help lines of the options several commands have.
inline constexpr char kModelHelp[] =
    "model name (see 'fwctl models'); default: the server's default model";
inline constexpr char kJsonHelp[] = "print JSON (proto3 JSON mapping; int64 as strings)";

// generate [PROMPT... | -]: streams a generation to stdout.
void AddGenerateCommand(CLI::App& program, const GlobalOptions& global);
// chat: an interactive loop on one session.
void AddChatCommand(CLI::App& program, const GlobalOptions& global);
// score TEXT... | -: per-token log-probabilities of a text.
void AddScoreCommand(CLI::App& program, const GlobalOptions& global);
// session create, get, list, rm, fork, export, import.
void AddSessionCommands(CLI::App& program, const GlobalOptions& global);
// models [NAME]: lists the models, or describes one.
void AddModelsCommand(CLI::App& program, const GlobalOptions& global);
// health: the standard gRPC health check (exit 0 SERVING, 3 NOT_SERVING).
void AddHealthCommand(CLI::App& program, const GlobalOptions& global);

}  // namespace fwctl

#endif  // FWSERVE_CLIENT_FWCTL_COMMANDS_H_
