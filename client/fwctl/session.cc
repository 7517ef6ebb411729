// fwctl session create | get | list | rm | fork | export | import
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "client/fwctl/cli.h"
#include "client/fwctl/commands.h"
#include "client/fwctl/io.h"

namespace fwctl {
namespace {

namespace v1 = fwserve::v1;

void PrintSessionInfo(const v1::SessionInfo& info, bool json) {
  if (json) {
    WriteOut(ToJson(info) + "\n");
    return;
  }
  std::printf(
      "session_id: %s\nmodel: %s\ntokens: %lld\nstate_bytes: %lld\ncreated: %s\nlast_used: "
      "%s\nresident: %s\nbusy: %s\n",
      info.session_id().c_str(), info.model().c_str(), static_cast<long long>(info.tokens()),
      static_cast<long long>(info.state_bytes()), FormatUnixMs(info.created_unix_ms()).c_str(),
      FormatUnixMs(info.last_used_unix_ms()).c_str(), info.resident() ? "true" : "false",
      info.busy() ? "true" : "false");
}

// create, fork and import print the new session's id (or all of it with --json or
// --verbose).
int PrintNewSession(const absl::StatusOr<v1::SessionInfo>& info, bool json,
                    const GlobalOptions& global) {
  if (!info.ok()) return RpcError(info.status());
  if (json || global.verbose) {
    PrintSessionInfo(*info, json);
  } else {
    std::printf("%s\n", info->session_id().c_str());
  }
  return kExitOk;
}

// The usage error for a missing positional argument.
int MissingArgument(const Command& command) {
  return UsageError(command.label(), "missing argument (" + command.synopsis() + ")");
}

void AddCreate(CLI::App& group, const GlobalOptions& global) {
  Command& command =
      AddCommand(group, "create", "create a session; prints its id", "",
                 "Creates a session, optionally prefilled with --prefix, and prints its id (all of "
                 "its info with --verbose or --json). In --prefix, \\n, \\t and \\\\ stand for a "
                 "newline, a tab and a backslash.");
  struct Options {
    std::string model;
    std::string prefix;
    bool json = false;
  };
  auto options = std::make_shared<Options>();
  AddText(command, "model", "M", kModelHelp, &options->model);
  AddText(command, "prefix", "TEXT", "text prefilled into the session (C escapes understood)",
          &options->prefix);
  AddSwitch(command, "json", kJsonHelp, &options->json);
  command.run = [options, &global] {
    return PrintNewSession(
        GetClient(global).CreateSession(options->model, UnescapeC(options->prefix)), options->json,
        global);
  };
}

void AddGet(CLI::App& group, const GlobalOptions& global) {
  Command& command =
      AddCommand(group, "get", "show a session", "ID",
                 "Prints a session's model, token count, state size, times, and whether it is "
                 "resident (not spilled to disk) and busy (held by a request).");
  struct Options {
    bool json = false;
    std::optional<std::string> id;
  };
  auto options = std::make_shared<Options>();
  AddSwitch(command, "json", kJsonHelp, &options->json);
  AddWord(command, "ID", &options->id);
  command.run = [&command, options, &global] {
    if (!options->id.has_value()) return MissingArgument(command);
    auto info = GetClient(global).GetSession(*options->id);
    if (!info.ok()) return RpcError(info.status());
    PrintSessionInfo(*info, options->json);
    return kExitOk;
  };
}

struct ListOptions {
  std::string model;
  std::optional<int64_t> page_size;
  std::string page_token;
  bool all = false;
  bool json = false;
};

int RunList(const ListOptions& options, const GlobalOptions& global) {
  const int64_t page_size = options.page_size.value_or(options.all ? 1000 : 0);
  fwserve::Client& client = GetClient(global);
  // One page, or with --all every page from --page-token on, gathered into `response`.
  v1::ListSessionsResponse response;
  std::string page_token = options.page_token;
  do {
    auto page = client.ListSessions(options.model, static_cast<int32_t>(page_size), page_token);
    if (!page.ok()) return RpcError(page.status());
    for (v1::SessionInfo& info : *page->mutable_sessions()) {
      *response.add_sessions() = std::move(info);
    }
    if (options.all && !page->next_page_token().empty() && page->next_page_token() == page_token) {
      return LocalError("the server returned the page token it was given");
    }
    page_token = page->next_page_token();
  } while (options.all && !page_token.empty());
  response.set_next_page_token(page_token);
  if (options.json) {
    WriteOut(ToJson(response) + "\n");
    return kExitOk;
  }
  std::printf("%-36s %-24s %10s %12s %-8s %-5s %s\n", "SESSION", "MODEL", "TOKENS", "STATE_BYTES",
              "RESIDENT", "BUSY", "LAST_USED");
  for (const v1::SessionInfo& info : response.sessions()) {
    std::printf("%-36s %-24s %10lld %12lld %-8s %-5s %s\n", info.session_id().c_str(),
                info.model().c_str(), static_cast<long long>(info.tokens()),
                static_cast<long long>(info.state_bytes()), info.resident() ? "yes" : "no",
                info.busy() ? "yes" : "no", FormatUnixMs(info.last_used_unix_ms()).c_str());
  }
  std::fflush(stdout);
  if (!page_token.empty()) {
    std::fprintf(stderr, "fwctl: more sessions follow: --page-token %s (or --all)\n",
                 page_token.c_str());
  }
  return kExitOk;
}

void AddList(CLI::App& group, const GlobalOptions& global) {
  Command& command = AddCommand(
      group, "list", "list sessions", "",
      "Lists one page of sessions (optionally of one model), oldest first. When more "
      "follow, the token of the next page is printed on stderr ('fwctl: more sessions "
      "follow: --page-token TOKEN'; with --json it is the next_page_token field); pass it "
      "with --page-token for the next page. --all lists every page.");
  auto options = std::make_shared<ListOptions>();
  AddText(command, "model", "M", "only sessions of this model", &options->model);
  AddInteger(command, "page-size", "N",
             "sessions per page: 0 = the server's default, 100; at most 1000 (larger is taken "
             "as 1000) (default 0, or 1000 with --all)",
             0, INT32_MAX, &options->page_size);
  AddText(command, "page-token", "TOKEN",
          "start at this page (a previous listing's next page token)", &options->page_token);
  AddSwitch(command, "all",
            "list every page (from --page-token, if given): one table, or one JSON object "
            "with every session and an empty next_page_token",
            &options->all);
  AddSwitch(command, "json", kJsonHelp, &options->json);
  command.run = [options, &global] { return RunList(*options, global); };
}

void AddRm(CLI::App& group, const GlobalOptions& global) {
  Command& command =
      AddCommand(group, "rm", "delete sessions", "ID...",
                 "Deletes each session; exits 1 if any deletion failed (ABORTED while busy).");
  auto ids = std::make_shared<std::vector<std::string>>();
  AddWords(command, "ID", ids.get());
  command.run = [&command, ids, &global] {
    if (ids->empty()) return MissingArgument(command);
    fwserve::Client& client = GetClient(global);
    int code = kExitOk;
    for (const std::string& id : *ids) {
      if (absl::Status status = client.DeleteSession(id); !status.ok()) code = RpcError(status);
    }
    return code;
  };
}

void AddFork(CLI::App& group, const GlobalOptions& global) {
  Command& command =
      AddCommand(group, "fork", "copy a session; prints the new id", "ID",
                 "Copies a session's state into a new session (O(state)) and prints the new id.");
  struct Options {
    bool json = false;
    std::optional<std::string> id;
  };
  auto options = std::make_shared<Options>();
  AddSwitch(command, "json", kJsonHelp, &options->json);
  AddWord(command, "ID", &options->id);
  command.run = [&command, options, &global] {
    if (!options->id.has_value()) return MissingArgument(command);
    return PrintNewSession(GetClient(global).ForkSession(*options->id), options->json, global);
  };
}

void AddExport(CLI::App& group, const GlobalOptions& global) {
  Command& command = AddCommand(
      group, "export", "save a session to a file ('-' = stdout)", "ID FILE",
      "Writes the session's versioned, checksummed blob (model fingerprint and state) to "
      "FILE. 'fwctl session import' on any server with the same model restores it.");
  struct Options {
    std::optional<std::string> id;
    std::optional<std::string> file;
  };
  auto options = std::make_shared<Options>();
  AddWord(command, "ID", &options->id);
  AddWord(command, "FILE", &options->file);
  command.run = [&command, options, &global] {
    if (!options->id.has_value() || !options->file.has_value()) return MissingArgument(command);
    const std::string& id = *options->id;
    const std::string& file = *options->file;
    auto exported = GetClient(global).ExportSession(id);
    if (!exported.ok()) return RpcError(exported.status());
    if (absl::Status written = WriteFile(file, exported->blob()); !written.ok()) {
      return LocalError(std::string(written.message()));
    }
    std::fprintf(stderr, "exported session %s (model %s, %lld tokens, %zu bytes) to %s\n",
                 id.c_str(), exported->model().c_str(), static_cast<long long>(exported->tokens()),
                 exported->blob().size(), file == "-" ? "stdout" : file.c_str());
    return kExitOk;
  };
}

void AddImport(CLI::App& group, const GlobalOptions& global) {
  Command& command = AddCommand(
      group, "import", "restore an exported session; prints the new id", "FILE",
      "Reads a blob written by 'session export' (FILE '-' = stdin) and makes it a new "
      "session of --model (default: the server's default model), which must be the model "
      "the blob was exported from.");
  struct Options {
    std::string model;
    bool json = false;
    std::optional<std::string> file;
  };
  auto options = std::make_shared<Options>();
  AddText(command, "model", "M", kModelHelp, &options->model);
  AddSwitch(command, "json", kJsonHelp, &options->json);
  AddWord(command, "FILE", &options->file);
  command.run = [&command, options, &global] {
    if (!options->file.has_value()) return MissingArgument(command);
    auto blob = ReadFile(*options->file);
    if (!blob.ok()) return LocalError(std::string(blob.status().message()));
    return PrintNewSession(GetClient(global).ImportSession(*blob, options->model), options->json,
                           global);
  };
}

}  // namespace

void AddSessionCommands(CLI::App& program, const GlobalOptions& global) {
  CLI::App& group =
      AddGroup(program, "session", "sessions: create, get, list, rm, fork, export, import");
  AddCreate(group, global);
  AddGet(group, global);
  AddList(group, global);
  AddRm(group, global);
  AddFork(group, global);
  AddExport(group, global);
  AddImport(group, global);
}

}  // namespace fwctl
