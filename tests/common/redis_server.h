// A real redis-server for tests: started on a free loopback port with its own
// temporary directory, stopped and cleaned up when the object goes.
//
//   auto redis = RedisServer::Start();           // FAILS (not skips) without redis-server
//   ASSERT_TRUE(redis.ok()) << redis.status();
//   OpenSessionStore((*redis)->spec(), options);  // "redis://127.0.0.1:<port>"
//
// Stop()/Restart() keep the port and the directory (a restart test: with
// appendonly or persistence the data survives). Pause()/Resume() stop and continue the
// process (SIGSTOP/SIGCONT): it keeps accepting connections and answers nothing, like
// an overloaded or stalled server. The server dies with the thread that started it
// (PR_SET_PDEATHSIG), so a crashed test leaves none behind.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fwserve {

class RedisServer {
 public:
  struct Options {
    // RDB snapshots with Redis's default save points, and one at shutdown (Stop).
    bool persistence = false;
    // The append-only file (fsync every second; flushed at Stop).
    bool appendonly = false;
    // requirepass (empty = none).
    std::string password;
  };

  // redis-server from $FWSERVE_REDIS_SERVER, PATH, /usr/bin or /usr/sbin. Waits until
  // it answers PING (10 s at most).
  static absl::StatusOr<std::unique_ptr<RedisServer>> Start(const Options& options);
  static absl::StatusOr<std::unique_ptr<RedisServer>> Start() { return Start(Options()); }
  // Stops it (if running) and removes its directory.
  ~RedisServer();
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  // SIGTERM (a clean shutdown: the AOF is flushed, an RDB saved if persistence) and
  // wait; SIGKILL after 10 s. OK if already stopped.
  absl::Status Stop();
  // SIGKILL and wait: a crash.
  void Kill();
  // Starts it again on the same port and directory; waits for PING.
  absl::Status Restart();
  void Pause();
  void Resume();
  bool running() const { return pid_ > 0; }

  const std::string& host() const { return host_; }
  int port() const { return port_; }
  std::string spec() const;  // "redis://127.0.0.1:<port>"
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

  // Runs one command on a fresh connection (AUTH'ed if a password is set) and renders
  // the reply: strings and status as they are, integers in decimal, arrays as their
  // elements joined by '\n', nil as NOT_FOUND, an error reply as INTERNAL with its text.
  absl::StatusOr<std::string> Command(const std::vector<std::string>& args) const;

 private:
  RedisServer(Options options, std::string dir, int port)
      : options_(std::move(options)), dir_(std::move(dir)), port_(port) {}
  absl::Status Launch();
  absl::Status WaitUntilReady();
  std::string LogTail() const;

  const Options options_;
  const std::string host_ = "127.0.0.1";
  const std::string dir_;
  int port_;
  pid_t pid_ = -1;
  bool paused_ = false;
};

}  // namespace fwserve
