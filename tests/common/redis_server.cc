#include "tests/common/redis_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fwserve {
namespace {

std::string FindRedisServer() {
  if (const char* env = std::getenv("FWSERVE_REDIS_SERVER"); env != nullptr && *env != '\0') {
    return env;
  }
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      dirs.emplace_back(dir);
    }
  }
  dirs.push_back("/usr/bin");
  dirs.push_back("/usr/sbin");
  for (const std::string& dir : dirs) {
    const std::string candidate = dir + "/redis-server";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// A port the kernel just handed out on 127.0.0.1 (free a moment ago).
absl::StatusOr<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("bind/getsockname: ", std::strerror(err)));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string Render(const redisReply* r) {
  switch (r->type) {
    case REDIS_REPLY_INTEGER:
      return absl::StrCat(r->integer);
    case REDIS_REPLY_ARRAY: {
      std::vector<std::string> parts;
      for (size_t i = 0; i < r->elements; ++i) parts.push_back(Render(r->element[i]));
      return absl::StrJoin(parts, "\n");
    }
    case REDIS_REPLY_NIL:
      return "";
    default:
      return std::string(r->str, r->len);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<RedisServer>> RedisServer::Start(const Options& options) {
  std::string pattern = (std::filesystem::temp_directory_path() / "fwserve-redis-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  std::unique_ptr<RedisServer> server(new RedisServer(options, pattern, 0));
  absl::Status last;
  // The port may be taken between FreePort and redis's bind: try a few.
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto port = FreePort();
    if (!port.ok()) return port.status();
    server->port_ = *port;
    last = server->Launch();
    if (last.ok()) return server;
    server->Kill();
    if (last.code() == absl::StatusCode::kFailedPrecondition) break;  // no redis-server
  }
  return last;  // ~RedisServer removes the directory
}

RedisServer::~RedisServer() {
  (void)Stop();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::string RedisServer::spec() const { return absl::StrCat("redis://", host_, ":", port_); }

absl::Status RedisServer::Launch() {
  const std::string binary = FindRedisServer();
  if (binary.empty()) {
    return absl::FailedPreconditionError(
        "redis-server not found ($FWSERVE_REDIS_SERVER, PATH, /usr/bin, /usr/sbin): install it "
        "(scripts/install-deps.sh installs redis-server)");
  }
  const std::string conf = dir_ + "/redis.conf";
  {
    std::ofstream out(conf, std::ios::trunc);
    out << "bind 127.0.0.1\n"
        << "port " << port_ << "\n"
        << "dir " << dir_ << "\n"
        << "daemonize no\n"
        << "logfile " << dir_ << "/redis.log\n"
        << "databases 16\n"
        << "appendonly " << (options_.appendonly ? "yes" : "no") << "\n";
    if (!options_.persistence) out << "save \"\"\n";
    if (!options_.password.empty()) out << "requirepass " << options_.password << "\n";
    if (!out) return absl::InternalError("cannot write " + conf);
  }
  // Everything the child needs, made before fork (only async-signal-safe calls after).
  std::vector<std::string> args = {binary, conf};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    const int null_fd = ::open("/dev/null", O_RDWR);
    if (null_fd >= 0) {
      ::dup2(null_fd, 0);
      ::dup2(null_fd, 1);
    }
    // Unblock everything the test process may have blocked.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  pid_ = pid;
  paused_ = false;
  return WaitUntilReady();
}

absl::Status RedisServer::WaitUntilReady() {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string last = "no attempt";
  while (absl::Now() < deadline) {
    int wstatus = 0;
    if (::waitpid(pid_, &wstatus, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("redis-server exited at start (status ", wstatus,
                                              "); its log:\n", LogTail()));
    }
    auto pong = Command({"PING"});
    if (pong.ok() && *pong == "PONG") return absl::OkStatus();
    last = pong.ok() ? *pong : std::string(pong.status().message());
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("redis-server on port ", port_,
                                                  " did not answer PING within 10 s (", last,
                                                  "); its log:\n", LogTail()));
}

std::string RedisServer::LogTail() const {
  std::ifstream in(dir_ + "/redis.log");
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  return all.size() > 2000 ? all.substr(all.size() - 2000) : all;
}

absl::Status RedisServer::Stop() {
  if (pid_ <= 0) return absl::OkStatus();
  if (paused_) Resume();
  ::kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    int wstatus = 0;
    const pid_t done = ::waitpid(pid_, &wstatus, WNOHANG);
    if (done == pid_ || (done < 0 && errno == ECHILD)) {
      pid_ = -1;
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  Kill();
  return absl::DeadlineExceededError("redis-server did not stop within 10 s; killed it");
}

void RedisServer::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int wstatus = 0;
  while (::waitpid(pid_, &wstatus, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  paused_ = false;
}

absl::Status RedisServer::Restart() {
  if (pid_ > 0) {
    if (absl::Status stopped = Stop(); !stopped.ok()) return stopped;
  }
  return Launch();
}

void RedisServer::Pause() {
  if (pid_ <= 0 || paused_) return;
  ::kill(pid_, SIGSTOP);
  // Wait until it is really stopped.
  int wstatus = 0;
  while (::waitpid(pid_, &wstatus, WUNTRACED) < 0 && errno == EINTR) {
  }
  paused_ = true;
}

void RedisServer::Resume() {
  if (pid_ <= 0 || !paused_) return;
  ::kill(pid_, SIGCONT);
  paused_ = false;
}

absl::StatusOr<std::string> RedisServer::Command(const std::vector<std::string>& args) const {
  timeval tv{2, 0};
  redisContext* ctx = redisConnectWithTimeout(host_.c_str(), port_, tv);
  if (ctx == nullptr) return absl::InternalError("hiredis: out of memory");
  if (ctx->err != 0) {
    const std::string err = ctx->errstr;
    redisFree(ctx);
    return absl::UnavailableError(err);
  }
  redisSetTimeout(ctx, tv);
  auto run = [&](const std::vector<std::string>& cmd) -> absl::StatusOr<std::string> {
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& arg : cmd) {
      argv.push_back(arg.data());
      lens.push_back(arg.size());
    }
    auto* reply = static_cast<redisReply*>(
        redisCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (reply == nullptr) return absl::UnavailableError(ctx->errstr);
    absl::StatusOr<std::string> result;
    if (reply->type == REDIS_REPLY_ERROR) {
      result = absl::InternalError(std::string(reply->str, reply->len));
    } else if (reply->type == REDIS_REPLY_NIL) {
      result = absl::NotFoundError("nil");
    } else {
      result = Render(reply);
    }
    freeReplyObject(reply);
    return result;
  };
  absl::StatusOr<std::string> result = std::string();
  if (!options_.password.empty()) result = run({"AUTH", options_.password});
  if (result.ok()) result = run(args);
  redisFree(ctx);
  return result;
}

}  // namespace fwserve
