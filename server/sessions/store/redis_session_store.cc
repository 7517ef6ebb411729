#include "server/sessions/store/redis_session_store.h"

#include <hiredis/hiredis.h>
#include <openssl/sha.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "server/base/log.h"
#include "server/base/session_id.h"

namespace fwserve {

// ---------------------------------------------------------------------------------
// Lua scripts. KEYS[1] = <prefix>{<id>}:s, KEYS[2] = <prefix>{<id>}:lease. Every value
// that may be missing is replaced by '' before it goes into a reply array (a nil would
// cut the array short).
namespace {

struct Script {
  const char* source;
  std::string sha1;  // hex, for EVALSHA
};

// ARGV: token, lease ttl ms, session ttl ms, cached version, tenant.
// {0}: no session (or another tenant's: untouched); {1}: busy; {2, ver, model, tokens, created,
// used, tenant, tag[, blob]}.
constexpr char kAcquireLua[] = R"lua(
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
if (redis.call('HGET', KEYS[1], 'tenant') or '') ~= ARGV[5] then return {0} end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1} end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'ver', 'model', 'tokens', 'created', 'used', 'tenant',
                    'tag')
for i = 1, 7 do v[i] = v[i] or '' end
if v[1] ~= ARGV[4] then
  return {2, v[1], v[2], v[3], v[4], v[5], v[6], v[7], redis.call('HGET', KEYS[1], 'blob') or ''}
end
return {2, v[1], v[2], v[3], v[4], v[5], v[6], v[7]}
)lua";

// ARGV: token, lease ttl ms. 1: renewed; 0: not held.
constexpr char kRenewLua[] = R"lua(
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 1
end
return 0
)lua";

// ARGV: token. 1: released; 0: not held.
constexpr char kReleaseLua[] = R"lua(
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
)lua";

// ARGV: token, expected version, blob, tokens, used ms, session ttl ms.
// {0}: lease lost; {1, stored version or ''}: version moved on (or session gone);
// {2, new version}: committed.
constexpr char kCommitLua[] = R"lua(
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0} end
local v = redis.call('HGET', KEYS[1], 'ver')
if v ~= ARGV[2] then
  redis.call('DEL', KEYS[2])
  return {1, v or ''}
end
local nv = redis.call('HINCRBY', KEYS[1], 'ver', 1)
redis.call('HSET', KEYS[1], 'blob', ARGV[3], 'tokens', ARGV[4], 'used', ARGV[5], 'tag', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('DEL', KEYS[2])
return {2, nv}
)lua";

// ARGV: model, tokens, created ms, used ms, blob, session ttl ms, tag, tenant. 1: created;
// 0: exists.
constexpr char kCreateLua[] = R"lua(
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'ver', 1, 'model', ARGV[1], 'tokens', ARGV[2], 'created', ARGV[3],
           'used', ARGV[4], 'blob', ARGV[5], 'tag', ARGV[7], 'tenant', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
)lua";

// ARGV: token. {0}: lease not held; {1, created or ''}: deleted.
constexpr char kDeleteLeasedLua[] = R"lua(
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {0} end
local c = redis.call('HGET', KEYS[1], 'created')
redis.call('DEL', KEYS[1], KEYS[2])
return {1, c or ''}
)lua";

// No ARGV. The session's created ms, or '' if there was none.
constexpr char kDeleteLua[] = R"lua(
local c = redis.call('HGET', KEYS[1], 'created')
redis.call('DEL', KEYS[1], KEYS[2])
return c or ''
)lua";

// ARGV: blob, now ms, session ttl ms, tag. {new version, created}.
constexpr char kPutLua[] = R"lua(
redis.call('HSET', KEYS[1], 'blob', ARGV[1], 'tag', ARGV[4])
local v = redis.call('HINCRBY', KEYS[1], 'ver', 1)
if v == 1 then
  redis.call('HSET', KEYS[1], 'model', '', 'tokens', '0', 'created', ARGV[2], 'used', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {v, redis.call('HGET', KEYS[1], 'created') or ''}
)lua";

std::string Sha1Hex(const char* text) {
  unsigned char digest[SHA_DIGEST_LENGTH];
  SHA1(reinterpret_cast<const unsigned char*>(text), std::strlen(text), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

const Script& AcquireScript() {
  static const auto* s = new Script{kAcquireLua, Sha1Hex(kAcquireLua)};
  return *s;
}
const Script& RenewScript() {
  static const auto* s = new Script{kRenewLua, Sha1Hex(kRenewLua)};
  return *s;
}
const Script& ReleaseScript() {
  static const auto* s = new Script{kReleaseLua, Sha1Hex(kReleaseLua)};
  return *s;
}
const Script& CommitScript() {
  static const auto* s = new Script{kCommitLua, Sha1Hex(kCommitLua)};
  return *s;
}
const Script& CreateScript() {
  static const auto* s = new Script{kCreateLua, Sha1Hex(kCreateLua)};
  return *s;
}
const Script& DeleteLeasedScript() {
  static const auto* s = new Script{kDeleteLeasedLua, Sha1Hex(kDeleteLeasedLua)};
  return *s;
}
const Script& DeleteScript() {
  static const auto* s = new Script{kDeleteLua, Sha1Hex(kDeleteLua)};
  return *s;
}
const Script& PutScript() {
  static const auto* s = new Script{kPutLua, Sha1Hex(kPutLua)};
  return *s;
}

constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);
constexpr int kMaxPageSize = 1000;
constexpr int kCreatedDigits = 13;

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r != nullptr) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// hiredis writes with write(2): a peer that went away raises SIGPIPE, which would kill
// the process. Blocks it on this thread for the duration and swallows one raised here.
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~ScopedSigpipeBlock() {
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

timeval TimevalOf(absl::Duration d) {
  d = std::max(d, absl::Milliseconds(1));
  return absl::ToTimeval(d);
}

int64_t Millis(absl::Duration d) { return std::max<int64_t>(1, absl::ToInt64Milliseconds(d)); }

// A reply element as text: strings, status and integers; "" for nil.
std::string Text(const redisReply* r) {
  if (r == nullptr) return "";
  switch (r->type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
      return std::string(r->str, r->len);
    case REDIS_REPLY_INTEGER:
      return absl::StrCat(r->integer);
    default:
      return "";
  }
}

bool IsInteger(const redisReply* r, long long* value) {
  if (r == nullptr) return false;
  if (r->type == REDIS_REPLY_INTEGER) {
    *value = r->integer;
    return true;
  }
  if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::string_view(r->str, r->len), &v)) return false;
    *value = v;
    return true;
  }
  return false;
}

std::string IndexMember(int64_t created_ms, const std::string& id) {
  return absl::StrFormat("%013d:%s", std::max<int64_t>(0, created_ms), id);
}

// "<13 digits>:<32 lowercase hex>".
bool IsWellFormedMember(absl::string_view member) {
  if (member.size() != kCreatedDigits + 1 + 32 || member[kCreatedDigits] != ':') return false;
  for (int i = 0; i < kCreatedDigits; ++i) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(member[i]))) return false;
  }
  const absl::string_view id = member.substr(kCreatedDigits + 1);
  return IsWellFormedSessionId(std::string_view(id.data(), id.size()));
}

absl::Status NotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("session_id '", id, "' not found"));
}

absl::Status MalformedSessionId(const std::string& id) {
  return absl::InvalidArgumentError(
      absl::StrCat("session_id '", id.substr(0, 64), "' is not a well-formed session id"));
}

// Parses ver, model, tokens, created, used, tenant (strings as HMGET returns them) into
// `info`.
absl::Status ParseInfo(const std::string& id, const redisReply* const* fields,
                       StoredSessionInfo* info) {
  info->id = id;
  int64_t ver = 0, tokens = 0, created = 0, used = 0;
  const std::string ver_text = Text(fields[0]);
  if (!absl::SimpleAtoi(ver_text, &ver) || ver < 1) {
    return absl::DataLossError(absl::StrCat("session store: session_id '", id,
                                            "' has a malformed version '", ver_text.substr(0, 32),
                                            "'"));
  }
  info->model = Text(fields[1]);
  info->tenant = Text(fields[5]);
  // Missing numbers (a session written by Put) read as 0.
  const std::string tokens_text = Text(fields[2]), created_text = Text(fields[3]),
                    used_text = Text(fields[4]);
  if ((!tokens_text.empty() && !absl::SimpleAtoi(tokens_text, &tokens)) ||
      (!created_text.empty() && !absl::SimpleAtoi(created_text, &created)) ||
      (!used_text.empty() && !absl::SimpleAtoi(used_text, &used))) {
    return absl::DataLossError(
        absl::StrCat("session store: session_id '", id, "' has a malformed field"));
  }
  info->version = ver;
  info->tokens = tokens;
  info->created = absl::FromUnixMillis(created);
  info->last_used = absl::FromUnixMillis(used);
  return absl::OkStatus();
}

// Redis errors that mean "the store cannot serve now" rather than "we asked wrongly".
bool IsUnavailableError(absl::string_view text) {
  for (absl::string_view prefix :
       {"LOADING", "BUSY", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK",
        "OOM", "NOAUTH", "WRONGPASS", "NOREPLICAS", "NOPERM"}) {
    if (absl::StartsWith(text, prefix) &&
        (text.size() == prefix.size() || text[prefix.size()] == ' ')) {
      return true;
    }
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------------
// A checked-out connection. Goes back to the pool when destroyed, unless it broke.
class RedisSessionStore::Connection {
 public:
  Connection(RedisSessionStore* store, redisContext* ctx) : store_(store), ctx_(ctx) {}
  ~Connection() { store_->Return(ctx_); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // One command. Error replies become statuses.
  absl::StatusOr<Reply> Command(const std::vector<std::string>& args) {
    auto replies = Pipeline({args});
    if (!replies.ok()) return replies.status();
    Reply reply = std::move((*replies)[0]);
    if (reply->type == REDIS_REPLY_ERROR) return store_->ErrorReply(reply.get());
    return reply;
  }

  // Sends all commands, then reads all replies (error replies are returned as such).
  absl::StatusOr<std::vector<Reply>> Pipeline(const std::vector<std::vector<std::string>>& cmds) {
    if (ctx_ == nullptr) return store_->Unavailable("connection lost");
    ScopedSigpipeBlock no_sigpipe;
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const auto& cmd : cmds) {
      argv.clear();
      lens.clear();
      for (const auto& arg : cmd) {
        argv.push_back(arg.data());
        lens.push_back(arg.size());
      }
      if (redisAppendCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data()) !=
          REDIS_OK) {
        return Fail();
      }
    }
    std::vector<Reply> replies;
    replies.reserve(cmds.size());
    for (size_t i = 0; i < cmds.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
        if (raw != nullptr) freeReplyObject(raw);
        return Fail();
      }
      replies.emplace_back(static_cast<redisReply*>(raw));
    }
    return replies;
  }

  // EVALSHA, or EVAL if Redis does not know the script.
  absl::StatusOr<Reply> Eval(const Script& script, const std::vector<std::string>& keys,
                             const std::vector<std::string>& args) {
    std::vector<std::string> cmd = {"EVALSHA", script.sha1, absl::StrCat(keys.size())};
    cmd.insert(cmd.end(), keys.begin(), keys.end());
    cmd.insert(cmd.end(), args.begin(), args.end());
    auto replies = Pipeline({cmd});
    if (!replies.ok()) return replies.status();
    Reply reply = std::move((*replies)[0]);
    if (reply->type == REDIS_REPLY_ERROR &&
        absl::StartsWith(absl::string_view(reply->str, reply->len), "NOSCRIPT")) {
      cmd[0] = "EVAL";
      cmd[1] = script.source;
      replies = Pipeline({cmd});
      if (!replies.ok()) return replies.status();
      reply = std::move((*replies)[0]);
    }
    if (reply->type == REDIS_REPLY_ERROR) return store_->ErrorReply(reply.get());
    return reply;
  }

 private:
  // The connection broke (I/O error, timeout, protocol error): drop it.
  absl::Status Fail() {
    absl::Status status = store_->ContextError(ctx_);
    redisFree(ctx_);
    ctx_ = nullptr;
    return status;
  }

  RedisSessionStore* const store_;
  redisContext* ctx_;
};

// ---------------------------------------------------------------------------------

absl::StatusOr<RedisAddress> ParseRedisSpec(const std::string& spec) {
  const std::string shown = spec.substr(0, 200);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-store '", shown, "': ", why, " (expected redis://HOST:PORT[/DB])"));
  };
  constexpr absl::string_view kScheme = "redis://";
  if (!absl::StartsWith(spec, kScheme)) return bad("not a redis:// URL");
  absl::string_view rest = absl::string_view(spec).substr(kScheme.size());
  if (absl::StrContains(rest, '@')) {
    // Never echo: the part before '@' may be a password.
    return absl::InvalidArgumentError(
        "--session-store: a redis:// URL must not carry credentials; put the password in a "
        "file and pass --session-store-password-file");
  }
  RedisAddress address;
  absl::string_view hostport = rest, db_text;
  bool has_db = false;
  if (const size_t slash = rest.find('/'); slash != absl::string_view::npos) {
    hostport = rest.substr(0, slash);
    db_text = rest.substr(slash + 1);
    has_db = true;
  }
  absl::string_view host, port_text;
  if (absl::StartsWith(hostport, "[")) {
    const size_t close = hostport.find(']');
    if (close == absl::string_view::npos) return bad("unterminated '[' in the host");
    host = hostport.substr(1, close - 1);
    absl::string_view after = hostport.substr(close + 1);
    if (!absl::StartsWith(after, ":")) return bad("missing :PORT");
    port_text = after.substr(1);
    if (host.empty() || !std::all_of(host.begin(), host.end(), [](char c) {
          return absl::ascii_isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.';
        })) {
      return bad("bad IPv6 address");
    }
  } else {
    const size_t colon = hostport.rfind(':');
    if (colon == absl::string_view::npos) return bad("missing :PORT");
    host = hostport.substr(0, colon);
    port_text = hostport.substr(colon + 1);
    if (host.empty()) return bad("missing HOST");
    if (host.size() > 253 || !std::all_of(host.begin(), host.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ||
                 c == '_';
        })) {
      return bad("bad HOST");
    }
  }
  auto all_digits = [](absl::string_view s) {
    return !s.empty() && s.size() <= 10 && std::all_of(s.begin(), s.end(), [](char c) {
      return absl::ascii_isdigit(static_cast<unsigned char>(c));
    });
  };
  int64_t port = 0;
  if (!all_digits(port_text) || !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return bad("PORT must be 1..65535");
  }
  int64_t db = 0;
  if (has_db && (!all_digits(db_text) || !absl::SimpleAtoi(db_text, &db) || db > 1000000)) {
    return bad("DB must be a number >= 0");
  }
  address.host = std::string(host);
  address.port = static_cast<int>(port);
  address.db = static_cast<int>(db);
  return address;
}

absl::StatusOr<std::unique_ptr<RedisSessionStore>> RedisSessionStore::Open(
    const RedisAddress& address, const SessionStoreOptions& options) {
  if (options.pool_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("session store pool size must be >= 1, got ", options.pool_size));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--session-store-timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  if (options.session_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("session store TTL must be positive, got ",
                                                   absl::FormatDuration(options.session_ttl)));
  }
  std::string password;
  if (!options.password_file.empty()) {
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("--session-store-password-file '", options.password_file, "': ", why));
    };
    const int fd = ::open(options.password_file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return bad(absl::StrCat("cannot open: ", std::strerror(errno)));
    std::string text;
    char buf[4096];
    while (text.find('\n') == std::string::npos && text.size() < 65536) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        return bad(absl::StrCat("cannot read: ", std::strerror(err)));
      }
      if (n == 0) break;
      text.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    password = text.substr(0, text.find('\n'));
    if (!password.empty() && password.back() == '\r') password.pop_back();
    if (password.empty()) return bad("the first line is empty");
  }
  return std::unique_ptr<RedisSessionStore>(
      new RedisSessionStore(address, options, std::move(password)));
}

RedisSessionStore::RedisSessionStore(RedisAddress address, SessionStoreOptions options,
                                     std::string password)
    : address_(std::move(address)),
      options_(std::move(options)),
      password_(std::move(password)),
      free_slots_(options_.pool_size) {}

RedisSessionStore::~RedisSessionStore() {
  absl::MutexLock lock(&mu_);
  for (redisContext* ctx : idle_) redisFree(ctx);
  idle_.clear();
}

std::string RedisSessionStore::Where() const {
  const bool v6 = absl::StrContains(address_.host, ':');
  return absl::StrCat("redis ", v6 ? "[" : "", address_.host, v6 ? "]" : "", ":", address_.port);
}

std::string RedisSessionStore::Describe() const {
  return absl::StrCat("redis://", Where().substr(6), "/", address_.db);
}

std::string RedisSessionStore::SessionKey(const std::string& id) const {
  return absl::StrCat(options_.key_prefix, "{", id, "}:s");
}
std::string RedisSessionStore::LeaseKey(const std::string& id) const {
  return absl::StrCat(options_.key_prefix, "{", id, "}:lease");
}
std::string RedisSessionStore::IndexKey() const {
  return absl::StrCat(options_.key_prefix, "index");
}

absl::Status RedisSessionStore::Unavailable(absl::string_view what) const {
  std::string text = absl::StrCat("session store unavailable: ", Where(), ": ", what);
  if (!password_.empty()) absl::StrReplaceAll({{password_, "***"}}, &text);
  return absl::UnavailableError(text);
}

absl::Status RedisSessionStore::ContextError(const redisContext* ctx) const {
  if (ctx == nullptr) return Unavailable("out of memory");
  const std::string err = ctx->errstr;
  if (ctx->err == REDIS_ERR_IO &&
      (err == std::strerror(EAGAIN) || err == std::strerror(EWOULDBLOCK) ||
       err == std::strerror(ETIMEDOUT) || absl::StrContains(err, "timed out"))) {
    return Unavailable(
        absl::StrCat("no answer within ", absl::ToInt64Milliseconds(options_.timeout), " ms"));
  }
  if (ctx->err == REDIS_ERR_EOF) return Unavailable("connection closed by the server");
  return Unavailable(err.empty() ? "connection error" : err);
}

absl::Status RedisSessionStore::ErrorReply(const redisReply* reply) const {
  const std::string text(reply->str, reply->len);
  if (absl::StartsWith(text, "WRONGPASS") || absl::StartsWith(text, "NOAUTH") ||
      (absl::StartsWith(text, "ERR") && absl::StrContains(text, "AUTH"))) {
    return Unavailable(absl::StrCat("authentication failed (", text.substr(0, 200), ")"));
  }
  if (IsUnavailableError(text)) return Unavailable(text.substr(0, 300));
  std::string message = absl::StrCat("session store: ", Where(), ": ", text.substr(0, 300));
  if (!password_.empty()) absl::StrReplaceAll({{password_, "***"}}, &message);
  return absl::InternalError(message);
}

// ---------------------------------------------------------------------------------
// The pool.

absl::StatusOr<redisContext*> RedisSessionStore::Connect() {
  const timeval tv = TimevalOf(options_.timeout);
  redisContext* ctx = redisConnectWithTimeout(address_.host.c_str(), address_.port, tv);
  if (ctx == nullptr) return Unavailable("cannot allocate a connection");
  if (ctx->err != 0) {
    absl::Status status = ContextError(ctx);
    redisFree(ctx);
    return status;
  }
  if (redisSetTimeout(ctx, tv) != REDIS_OK) {
    absl::Status status = ContextError(ctx);
    redisFree(ctx);
    return status;
  }
  redisEnableKeepAlive(ctx);
  // The handshake; without AUTH or SELECT a PING, so that a server that accepts
  // connections but does not answer (stopped, overloaded) counts as down.
  std::vector<std::vector<std::string>> handshake;
  if (!password_.empty()) handshake.push_back({"AUTH", password_});
  if (address_.db != 0) handshake.push_back({"SELECT", absl::StrCat(address_.db)});
  if (handshake.empty()) handshake.push_back({"PING"});
  // The Connection hands the context back through Return; use a bare one here.
  {
    ScopedSigpipeBlock no_sigpipe;
    for (const auto& cmd : handshake) {
      std::vector<const char*> argv;
      std::vector<size_t> lens;
      for (const auto& arg : cmd) {
        argv.push_back(arg.data());
        lens.push_back(arg.size());
      }
      Reply reply(static_cast<redisReply*>(
          redisCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lens.data())));
      if (reply == nullptr) {
        absl::Status status = ContextError(ctx);
        redisFree(ctx);
        return status;
      }
      if (reply->type == REDIS_REPLY_ERROR) {
        absl::Status status = ErrorReply(reply.get());
        if (status.code() != absl::StatusCode::kUnavailable) {
          status = Unavailable(absl::StrCat(
              cmd[0], " failed: ", absl::string_view(reply->str, reply->len).substr(0, 200)));
        }
        redisFree(ctx);
        return status;
      }
    }
  }
  return ctx;
}

absl::StatusOr<std::unique_ptr<RedisSessionStore::Connection>> RedisSessionStore::Checkout() {
  const absl::Time deadline = absl::Now() + options_.timeout;
  mu_.Lock();
  auto has_slot = [](int* n) { return *n > 0; };
  if (!mu_.AwaitWithDeadline(absl::Condition(+has_slot, &free_slots_), deadline)) {
    mu_.Unlock();
    return Unavailable(absl::StrCat("no free connection within ",
                                    absl::ToInt64Milliseconds(options_.timeout), " ms (all ",
                                    options_.pool_size, " in use)"));
  }
  --free_slots_;
  // An idle connection, unless the server closed it (or anything else made it readable:
  // an idle RESP2 connection never has input).
  while (!idle_.empty()) {
    redisContext* ctx = idle_.back();
    idle_.pop_back();
    pollfd pfd{ctx->fd, POLLIN, 0};
    if (::poll(&pfd, 1, 0) == 0) {
      mu_.Unlock();
      return std::make_unique<Connection>(this, ctx);
    }
    redisFree(ctx);
  }
  const absl::Time now = absl::Now();
  if (now < next_connect_) {
    ++free_slots_;
    const std::string error = last_connect_error_;
    const int64_t wait_ms = absl::ToInt64Milliseconds(next_connect_ - now);
    mu_.Unlock();
    return absl::UnavailableError(absl::StrCat(error, " (next attempt in ", wait_ms, " ms)"));
  }
  mu_.Unlock();

  absl::StatusOr<redisContext*> ctx = Connect();
  absl::MutexLock lock(&mu_);
  if (!ctx.ok()) {
    ++free_slots_;
    backoff_ =
        backoff_ == absl::ZeroDuration() ? kFirstBackoff : std::min(2 * backoff_, kMaxBackoff);
    next_connect_ = absl::Now() + backoff_;
    last_connect_error_ = std::string(ctx.status().message());
    if (reachable_) {
      reachable_ = false;
      Log(LogLevel::kWarning,
          absl::StrCat(ctx.status().message(), "; reconnecting with backoff (up to ",
                       absl::ToInt64Milliseconds(kMaxBackoff), " ms)"));
    }
    return ctx.status();
  }
  backoff_ = absl::ZeroDuration();
  next_connect_ = absl::InfinitePast();
  if (!reachable_) {
    reachable_ = true;
    Log(LogLevel::kInfo, absl::StrCat("session store ", Describe(), ": reconnected"));
  }
  return std::make_unique<Connection>(this, *ctx);
}

void RedisSessionStore::Return(redisContext* ctx) {
  absl::MutexLock lock(&mu_);
  if (ctx != nullptr) idle_.push_back(ctx);
  ++free_slots_;
}

template <typename F>
auto RedisSessionStore::Observed(const char* op, F&& body) -> decltype(body()) {
  const absl::Time start = absl::Now();
  auto result = body();
  if (options_.observer) {
    if constexpr (std::is_same_v<decltype(result), absl::Status>) {
      options_.observer(op, absl::Now() - start, result);
    } else {
      options_.observer(op, absl::Now() - start, result.status());
    }
  }
  return result;
}

absl::Status RedisSessionStore::Ping() {
  auto conn = Checkout();
  if (!conn.ok()) return conn.status();
  auto reply = (*conn)->Command({"PING"});
  return reply.status();
}

// ---------------------------------------------------------------------------------
// Operations.

absl::Status RedisSessionStore::RemoveFromIndex(Connection& conn, const std::string& id,
                                                const std::string& created_ms) {
  int64_t created = 0;
  if (created_ms.empty() || !absl::SimpleAtoi(created_ms, &created)) return absl::OkStatus();
  // The session is gone; a stale index entry is skipped and removed by List.
  if (absl::Status removed = conn.Command({"ZREM", IndexKey(), IndexMember(created, id)}).status();
      !removed.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("session store: session ", id,
                                         " was deleted but is still indexed: ", removed.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<StoreLeaseGrant> RedisSessionStore::AcquireLease(const std::string& id,
                                                                absl::Duration lease_ttl,
                                                                int64_t cached_version,
                                                                const std::string& tenant) {
  return Observed("acquire", [&]() -> absl::StatusOr<StoreLeaseGrant> {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    ReleaseOrphanedLeases(**conn);
    StoreLeaseGrant grant;
    grant.token = NewSessionId();  // 128 bits from the OS CSPRNG, hex
    auto reply = (*conn)->Eval(
        AcquireScript(), {SessionKey(id), LeaseKey(id)},
        {grant.token, absl::StrCat(Millis(lease_ttl)), absl::StrCat(Millis(options_.session_ttl)),
         absl::StrCat(cached_version), tenant});
    if (!reply.ok()) {
      // The script was sent and may have run (Redis stalled past the timeout): the
      // lease may be ours. Release it once Redis answers again, rather than leave the
      // session busy until the lease expires.
      absl::MutexLock lock(&mu_);
      if (orphaned_leases_.size() < kMaxOrphanedLeases) {
        orphaned_leases_.emplace_back(id, grant.token);
      }
      return reply.status();
    }
    const redisReply* r = reply->get();
    long long code = -1;
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || !IsInteger(r->element[0], &code)) {
      return absl::InternalError("session store: unexpected reply to acquire");
    }
    if (code == 0) return NotFound(id);
    if (code == 1) {
      return absl::AbortedError(absl::StrCat("session_id '", id, "' is busy with another request"));
    }
    absl::Status parsed = r->elements < 8
                              ? absl::InternalError("session store: unexpected reply to acquire")
                              : ParseInfo(id, r->element + 1, &grant.info);
    if (!parsed.ok()) {
      // The lease was taken: give it back rather than leave the session busy.
      (void)(*conn)->Eval(ReleaseScript(), {SessionKey(id), LeaseKey(id)}, {grant.token});
      return parsed;
    }
    grant.info.tag = Text(r->element[7]);
    if (r->elements >= 9) grant.blob = Text(r->element[8]);
    return grant;
  });
}

void RedisSessionStore::ReleaseOrphanedLeases(Connection& conn) {
  std::vector<std::pair<std::string, std::string>> batch;
  {
    absl::MutexLock lock(&mu_);
    while (!orphaned_leases_.empty() && batch.size() < 32) {
      batch.push_back(std::move(orphaned_leases_.back()));
      orphaned_leases_.pop_back();
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& [id, token] = batch[i];
    if (!conn.Eval(ReleaseScript(), {SessionKey(id), LeaseKey(id)}, {token}).ok()) {
      absl::MutexLock lock(&mu_);
      for (size_t j = i; j < batch.size(); ++j) orphaned_leases_.push_back(std::move(batch[j]));
      return;
    }
  }
}

absl::Status RedisSessionStore::RenewLease(const std::string& id, const std::string& token,
                                           absl::Duration lease_ttl) {
  return Observed("renew", [&]() -> absl::Status {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto reply = (*conn)->Eval(RenewScript(), {SessionKey(id), LeaseKey(id)},
                               {token, absl::StrCat(Millis(lease_ttl))});
    if (!reply.ok()) return reply.status();
    long long held = 0;
    if (!IsInteger(reply->get(), &held)) {
      return absl::InternalError("session store: unexpected reply to renew");
    }
    if (held != 1) {
      return absl::AbortedError(absl::StrCat(
          "session_id '", id, "' lost its lease (it expired and may have been taken)"));
    }
    return absl::OkStatus();
  });
}

absl::Status RedisSessionStore::ReleaseLease(const std::string& id, const std::string& token) {
  return Observed("release", [&]() -> absl::Status {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    return (*conn)->Eval(ReleaseScript(), {SessionKey(id), LeaseKey(id)}, {token}).status();
  });
}

absl::StatusOr<int64_t> RedisSessionStore::CommitLeased(const std::string& id,
                                                        const std::string& token,
                                                        int64_t expected_version,
                                                        const std::string& blob, int64_t tokens,
                                                        absl::Time last_used) {
  return Observed("commit", [&]() -> absl::StatusOr<int64_t> {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto reply = (*conn)->Eval(
        CommitScript(), {SessionKey(id), LeaseKey(id)},
        {token, absl::StrCat(expected_version), blob, absl::StrCat(tokens),
         absl::StrCat(absl::ToUnixMillis(last_used)), absl::StrCat(Millis(options_.session_ttl))});
    if (!reply.ok()) return reply.status();
    const redisReply* r = reply->get();
    long long code = -1;
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || !IsInteger(r->element[0], &code)) {
      return absl::InternalError("session store: unexpected reply to commit");
    }
    if (code == 0) {
      return absl::AbortedError(absl::StrCat("session_id '", id,
                                             "' lost its lease before its write was committed "
                                             "(it expired and may have been taken)"));
    }
    if (code == 1) {
      const std::string stored = r->elements >= 2 ? Text(r->element[1]) : "";
      if (stored.empty()) {
        return absl::AbortedError(
            absl::StrCat("session_id '", id, "' is gone from the store (deleted or expired)"));
      }
      return absl::AbortedError(absl::StrCat("session_id '", id, "' moved on to version ", stored,
                                             " (expected ", expected_version, ")"));
    }
    long long version = 0;
    if (r->elements < 2 || !IsInteger(r->element[1], &version)) {
      return absl::InternalError("session store: unexpected reply to commit");
    }
    return static_cast<int64_t>(version);
  });
}

absl::Status RedisSessionStore::CreateSession(const StoredSessionInfo& info,
                                              const std::string& blob) {
  return Observed("create", [&]() -> absl::Status {
    if (!IsWellFormedSessionId(info.id)) return MalformedSessionId(info.id);
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    const int64_t created = std::max<int64_t>(0, absl::ToUnixMillis(info.created));
    auto reply = (*conn)->Eval(CreateScript(), {SessionKey(info.id), LeaseKey(info.id)},
                               {info.model, absl::StrCat(info.tokens), absl::StrCat(created),
                                absl::StrCat(absl::ToUnixMillis(info.last_used)), blob,
                                absl::StrCat(Millis(options_.session_ttl)),
                                info.tag.empty() ? NewSessionId() : info.tag, info.tenant});
    if (!reply.ok()) return reply.status();
    long long made = 0;
    if (!IsInteger(reply->get(), &made)) {
      return absl::InternalError("session store: unexpected reply to create");
    }
    if (made != 1) {
      return absl::AlreadyExistsError(absl::StrCat("session_id '", info.id, "' already exists"));
    }
    // The session exists now; the index is a hint (an unlisted session still works
    // and expires), so a failure here is logged, not reported.
    if (absl::Status indexed =
            (*conn)->Command({"ZADD", IndexKey(), "0", IndexMember(created, info.id)}).status();
        !indexed.ok()) {
      Log(LogLevel::kWarning, absl::StrCat("session store: session ", info.id,
                                           " was created but not indexed: ", indexed.message()));
    }
    return absl::OkStatus();
  });
}

absl::Status RedisSessionStore::DeleteLeased(const std::string& id, const std::string& token) {
  return Observed("delete", [&]() -> absl::Status {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto reply = (*conn)->Eval(DeleteLeasedScript(), {SessionKey(id), LeaseKey(id)}, {token});
    if (!reply.ok()) return reply.status();
    const redisReply* r = reply->get();
    long long code = -1;
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || !IsInteger(r->element[0], &code)) {
      return absl::InternalError("session store: unexpected reply to delete");
    }
    if (code != 1) {
      return absl::AbortedError(absl::StrCat(
          "session_id '", id, "' lost its lease (it expired and may have been taken)"));
    }
    return RemoveFromIndex(**conn, id, r->elements >= 2 ? Text(r->element[1]) : "");
  });
}

absl::StatusOr<StoredSessionInfo> RedisSessionStore::GetInfo(const std::string& id) {
  return Observed("info", [&]() -> absl::StatusOr<StoredSessionInfo> {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto replies = (*conn)->Pipeline(
        {{"HMGET", SessionKey(id), "ver", "model", "tokens", "created", "used", "tenant"},
         {"EXISTS", LeaseKey(id)}});
    if (!replies.ok()) return replies.status();
    const redisReply* r = (*replies)[0].get();
    long long leased = 0;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 6 ||
        !IsInteger((*replies)[1].get(), &leased)) {
      return absl::InternalError("session store: unexpected reply to HMGET");
    }
    if (r->element[0]->type == REDIS_REPLY_NIL) return NotFound(id);
    StoredSessionInfo info;
    if (absl::Status parsed = ParseInfo(id, r->element, &info); !parsed.ok()) return parsed;
    info.busy = leased == 1;
    return info;
  });
}

absl::StatusOr<std::string> RedisSessionStore::Get(const std::string& id) {
  return Observed("get", [&]() -> absl::StatusOr<std::string> {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto reply = (*conn)->Command({"HGET", SessionKey(id), "blob"});
    if (!reply.ok()) return reply.status();
    if ((*reply)->type != REDIS_REPLY_STRING) return NotFound(id);
    return Text(reply->get());
  });
}

absl::Status RedisSessionStore::Put(const std::string& id, const std::string& blob) {
  return Observed("put", [&]() -> absl::Status {
    if (!IsWellFormedSessionId(id)) return MalformedSessionId(id);
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto reply = (*conn)->Eval(PutScript(), {SessionKey(id), LeaseKey(id)},
                               {blob, absl::StrCat(absl::ToUnixMillis(absl::Now())),
                                absl::StrCat(Millis(options_.session_ttl)), NewSessionId()});
    if (!reply.ok()) return reply.status();
    const redisReply* r = reply->get();
    long long version = 0, created = 0;
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 2 || !IsInteger(r->element[0], &version)) {
      return absl::InternalError("session store: unexpected reply to put");
    }
    if (version != 1 || !IsInteger(r->element[1], &created)) return absl::OkStatus();
    return (*conn)->Command({"ZADD", IndexKey(), "0", IndexMember(created, id)}).status();
  });
}

absl::Status RedisSessionStore::Delete(const std::string& id) {
  return Observed("delete", [&]() -> absl::Status {
    auto conn = Checkout();
    if (!conn.ok()) return conn.status();
    auto reply = (*conn)->Eval(DeleteScript(), {SessionKey(id), LeaseKey(id)}, {});
    if (!reply.ok()) return reply.status();
    return RemoveFromIndex(**conn, id, Text(reply->get()));
  });
}

absl::Status RedisSessionStore::ForEachId(const std::function<bool(const std::string& id)>& visit) {
  return Observed("list", [&]() -> absl::Status {
    std::string token;
    do {
      auto page = ListImpl("", std::nullopt, kMaxPageSize, token);
      if (!page.ok()) return page.status();
      for (const StoredSessionInfo& info : page->sessions) {
        if (!visit(info.id)) return absl::OkStatus();
      }
      token = std::move(page->next_page_token);
    } while (!token.empty());
    return absl::OkStatus();
  });
}

absl::StatusOr<SessionPage> RedisSessionStore::List(const std::string& model,
                                                    const std::string& tenant, int page_size,
                                                    const std::string& page_token) {
  return Observed("list", [&]() { return ListImpl(model, tenant, page_size, page_token); });
}

absl::StatusOr<SessionPage> RedisSessionStore::ListImpl(const std::string& model,
                                                        const std::optional<std::string>& tenant,
                                                        int page_size,
                                                        const std::string& page_token) {
  page_size = std::clamp(page_size, 1, kMaxPageSize);
  if (!page_token.empty() && !IsWellFormedMember(page_token)) {
    return absl::InvalidArgumentError("page_token is malformed");
  }
  auto conn = Checkout();
  if (!conn.ok()) return conn.status();
  // Bounds the work of one call: a long run of stale entries or of other models' sessions
  // ends the page early (with a token to go on from).
  const int max_examined = std::max(20 * page_size, 100);
  SessionPage page;
  std::string last_examined = page_token;
  int examined = 0;
  bool more = false;
  while (true) {
    const int need = page_size - static_cast<int>(page.sessions.size());
    // One past what is needed, to know whether more follow; growing with what was
    // examined, so that a run of stale or filtered-out entries takes few round trips.
    int batch = need + 1 + examined;
    if (!model.empty() || tenant.has_value()) batch = std::max(batch, 100);
    batch = std::min(batch, std::min(kMaxPageSize, max_examined - examined) + 1);
    const std::string start = last_examined.empty() ? "-" : "(" + last_examined;
    auto range = (*conn)->Command(
        {"ZRANGEBYLEX", IndexKey(), start, "+", "LIMIT", "0", absl::StrCat(batch)});
    if (!range.ok()) return range.status();
    const redisReply* members = range->get();
    if (members->type != REDIS_REPLY_ARRAY) {
      return absl::InternalError("session store: unexpected reply to ZRANGEBYLEX");
    }
    if (members->elements == 0) break;
    std::vector<std::vector<std::string>> reads;
    for (size_t i = 0; i < members->elements; ++i) {
      const std::string member = Text(members->element[i]);
      if (!IsWellFormedMember(member)) continue;
      reads.push_back({"HMGET", SessionKey(member.substr(kCreatedDigits + 1)), "ver", "model",
                       "tokens", "created", "used", "tenant"});
    }
    auto infos = (*conn)->Pipeline(reads);
    if (!infos.ok()) return infos.status();
    std::vector<std::string> stale;
    size_t next_read = 0;
    for (size_t i = 0; i < members->elements; ++i) {
      if (static_cast<int>(page.sessions.size()) == page_size || examined >= max_examined) {
        more = true;
        break;
      }
      const std::string member = Text(members->element[i]);
      ++examined;
      last_examined = member;
      if (!IsWellFormedMember(member)) {
        stale.push_back(member);
        continue;
      }
      const redisReply* info = (*infos)[next_read++].get();
      if (info->type == REDIS_REPLY_ERROR) return ErrorReply(info);
      if (info->type != REDIS_REPLY_ARRAY || info->elements != 6 ||
          info->element[0]->type == REDIS_REPLY_NIL) {
        stale.push_back(member);
        continue;
      }
      StoredSessionInfo parsed;
      if (!ParseInfo(member.substr(kCreatedDigits + 1), info->element, &parsed).ok()) continue;
      if (!model.empty() && parsed.model != model) continue;
      if (tenant.has_value() && parsed.tenant != *tenant) continue;
      page.sessions.push_back(std::move(parsed));
    }
    if (!stale.empty()) {
      std::vector<std::string> zrem = {"ZREM", IndexKey()};
      zrem.insert(zrem.end(), stale.begin(), stale.end());
      if (absl::Status removed = (*conn)->Command(zrem).status(); !removed.ok()) return removed;
    }
    if (more) break;
    if (static_cast<int>(members->elements) < batch) break;  // the index ends here
    if (examined >= max_examined) {
      more = true;
      break;
    }
  }
  if (more) page.next_page_token = last_examined;
  return page;
}

}  // namespace fwserve
