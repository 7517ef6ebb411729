// docs/serving.md "Messages never contain file paths or internals" and docs/sessions.md
// "Client-facing messages never contain paths; the log does": every reply of an error
// path that touches the filesystem of a dir: session store (a spilled session's file
// truncated, corrupted, deleted or replaced by a directory; the store directory removed
// under the server; a file that cannot be deleted; a stored session whose file goes
// away after a restart) gets its documented code, and a message without the store's
// path, any piece of it, the temporary directory, or the session files' names.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "client/client.h"
#include "tests/integration/harness.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;
using absl::StatusCode;

class ErrorPathsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models_dir_ = new std::string(MakeTempDir("errpaths-models"));
    WriteTinyCheckpoint(ModelDir(), "aft", 5);
  }
  static void TearDownTestSuite() { delete models_dir_; }
  static std::string ModelDir() { return *models_dir_ + "/aft"; }

  // A server over the test model with a dir: store at `store_dir`, holding at most
  // `resident` sessions in memory (0 = no limit that matters here).
  std::unique_ptr<Harness> Start(const std::string& store_dir, int resident = 0) {
    fwserve::CoreOptions options;
    options.model_dirs = {ModelDir()};
    options.max_tokens = 1000;
    options.session_store = "dir:" + store_dir;
    if (resident > 0) {
      if (state_bytes_ == 0) {
        fwserve::CoreOptions probe_options = options;
        probe_options.session_store = "memory";
        auto probe = Harness::Start(probe_options);
        if (probe == nullptr) return nullptr;
        state_bytes_ = probe->client().DescribeModel()->state_bytes_per_session();
      }
      options.engine.max_state_memory_bytes = resident * state_bytes_;
    }
    return Harness::Start(options);
  }

  // The message of `status` (an error with code `code`) names no path: not the store
  // directory, no '/'-separated piece of it (nor of the model directory), not the
  // temporary directory, and no session file name.
  static void ExpectNoPath(const absl::Status& status, StatusCode code,
                           const std::string& store_dir, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(status.code(), code) << status;
    const std::string message(status.message());
    EXPECT_FALSE(message.empty()) << "an error without a message";
    std::set<std::string> forbidden = {store_dir,  ModelDir(), *models_dir_,
                                       ".fwstate", ".lock",    ".tmp"};
    const char* base = std::getenv("TEST_TMPDIR");
    forbidden.insert(base != nullptr ? base : "/tmp");
    forbidden.insert("fwserve-");  // MakeTempDir's prefix
    for (const std::string& dir : {store_dir, ModelDir()}) {
      for (absl::string_view piece : absl::StrSplit(dir, '/', absl::SkipEmpty())) {
        forbidden.insert(absl::StrCat("/", piece));
        if (piece.size() >= 4) forbidden.emplace(piece);
      }
    }
    for (const std::string& fragment : forbidden) {
      EXPECT_EQ(message.find(fragment), std::string::npos)
          << "the reply names '" << fragment << "': " << message;
    }
    // No path at all: no message of these paths has a '/'.
    EXPECT_EQ(message.find('/'), std::string::npos) << message;
  }

  static std::string FileOf(const std::string& store_dir, const std::string& id) {
    return store_dir + "/" + id + ".fwstate";
  }

  static std::string ReadAll(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  static void WriteAll(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }

  // Runs every RPC that must read `id`'s stored state back, expecting `code`.
  static void ExpectEveryLoadFails(fwserve::Client& client, const std::string& id, StatusCode code,
                                   const std::string& store_dir, const std::string& what) {
    ExpectNoPath(client.Generate(GreedyRequest("x", 3, id)).status(), code, store_dir,
                 what + ": Generate");
    v1::ScoreRequest score;
    score.set_session_id(id);
    score.set_text("abc");
    ExpectNoPath(client.Score(score).status(), code, store_dir, what + ": Score");
    ExpectNoPath(client.ForkSession(id).status(), code, store_dir, what + ": ForkSession");
    ExpectNoPath(client.ExportSession(id).status(), code, store_dir, what + ": ExportSession");
  }

  static std::string* models_dir_;
  int64_t state_bytes_ = 0;
};

std::string* ErrorPathsTest::models_dir_ = nullptr;

TEST_F(ErrorPathsTest, SpilledSessionsWhoseFilesAreDamagedAreDataLossWithoutPaths) {
  const std::string dir = MakeTempDir("errpaths-spill");
  auto server = Start(dir, /*resident=*/1);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  // One resident session at a time: each new one spills the one before to its file.
  std::vector<std::string> ids;
  for (const char* prefix : {"truncated", "corrupted", "deleted", "a directory", "last"}) {
    auto created = client.CreateSession("", prefix);
    ASSERT_TRUE(created.ok()) << created.status();
    ids.push_back(created->session_id());
  }
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    auto info = client.GetSession(ids[i]);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_FALSE(info->resident()) << i;
    ASSERT_TRUE(std::filesystem::exists(FileOf(dir, ids[i]))) << i;
  }

  const std::string whole = ReadAll(FileOf(dir, ids[0]));
  ASSERT_GT(whole.size(), 64u);
  WriteAll(FileOf(dir, ids[0]), whole.substr(0, whole.size() / 2));
  std::string corrupted = ReadAll(FileOf(dir, ids[1]));
  corrupted[corrupted.size() - 8] ^= 0x5a;  // in the state bytes, past the header
  WriteAll(FileOf(dir, ids[1]), corrupted);
  ASSERT_TRUE(std::filesystem::remove(FileOf(dir, ids[2])));
  ASSERT_TRUE(std::filesystem::remove(FileOf(dir, ids[3])));
  ASSERT_TRUE(std::filesystem::create_directory(FileOf(dir, ids[3])));

  ExpectEveryLoadFails(client, ids[0], StatusCode::kDataLoss, dir, "truncated file");
  ExpectEveryLoadFails(client, ids[1], StatusCode::kDataLoss, dir, "corrupted file");
  ExpectEveryLoadFails(client, ids[2], StatusCode::kDataLoss, dir, "deleted file");
  // A directory opens but cannot be read (EISDIR): the store failed, the state is not
  // known to be lost.
  ExpectEveryLoadFails(client, ids[3], StatusCode::kUnavailable, dir, "a directory");

  // The sessions stay registered (their files are left for inspection), and the
  // undamaged one still works.
  EXPECT_EQ(client.ListAllSessions()->size(), ids.size());
  EXPECT_TRUE(client.Generate(GreedyRequest("x", 3, ids[4])).ok());
}

TEST_F(ErrorPathsTest, AStoreDirectoryRemovedUnderTheServerFailsWritesWithoutPaths) {
  const std::string dir = MakeTempDir("errpaths-gone");
  auto server = Start(dir);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  auto session = client.CreateSession("", "stored");
  ASSERT_TRUE(session.ok()) << session.status();
  auto exported = client.ExportSession(session->session_id());
  ASSERT_TRUE(exported.ok()) << exported.status();

  // New files cannot be created in a removed directory (ENOENT), whoever runs.
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(std::filesystem::exists(dir));

  ExpectNoPath(client.CreateSession("", "new").status(), StatusCode::kUnavailable, dir,
               "CreateSession");
  ExpectNoPath(client.ForkSession(session->session_id()).status(), StatusCode::kUnavailable, dir,
               "ForkSession");
  ExpectNoPath(client.ImportSession(exported->blob()).status(), StatusCode::kUnavailable, dir,
               "ImportSession");
  // A Generate streams its tokens, then ends with UNAVAILABLE: they could not be saved.
  auto stream = client.StartGenerate(GreedyRequest(" more", 4, session->session_id()));
  v1::GenerateResponse message;
  int streamed = 0;
  while (stream->Next(&message)) streamed += message.token_ids_size();
  EXPECT_EQ(streamed, 4);
  ExpectNoPath(stream->Finish(), StatusCode::kUnavailable, dir, "Generate");
  // Nothing above created a session; the one there keeps its streamed tokens.
  auto sessions = client.ListAllSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  EXPECT_EQ(sessions->size(), 1u);
  auto info = client.GetSession(session->session_id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens(), 6 + 5 + 4);
}

TEST_F(ErrorPathsTest, ASessionFileThatCannotBeDeletedIsKeptWithoutPaths) {
  const std::string dir = MakeTempDir("errpaths-undeletable");
  auto server = Start(dir);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  auto session = client.CreateSession("", "kept");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string file = FileOf(dir, session->session_id());
  // A non-empty directory in place of the file: unlink fails (EISDIR).
  ASSERT_TRUE(std::filesystem::remove(file));
  ASSERT_TRUE(std::filesystem::create_directories(file + "/inside"));
  ExpectNoPath(client.DeleteSession(session->session_id()), StatusCode::kUnavailable, dir,
               "DeleteSession");
  EXPECT_TRUE(client.GetSession(session->session_id()).ok());
  // Writing the session over it fails too (rename onto a directory).
  auto stream = client.StartGenerate(GreedyRequest("!", 2, session->session_id()));
  v1::GenerateResponse message;
  while (stream->Next(&message)) {
  }
  ExpectNoPath(stream->Finish(), StatusCode::kUnavailable, dir, "Generate");
  // Let the server's retries and its last write at shutdown succeed.
  std::filesystem::remove_all(file);
}

TEST_F(ErrorPathsTest, StoredSessionsDamagedAcrossARestartFailWithoutPaths) {
  const std::string dir = MakeTempDir("errpaths-restart");
  std::vector<std::string> ids;
  {
    auto server = Start(dir);
    ASSERT_NE(server, nullptr);
    for (const char* prefix : {"skipped at start", "deleted after start", "well"}) {
      auto created = server->client().CreateSession("", prefix);
      ASSERT_TRUE(created.ok()) << created.status();
      ids.push_back(created->session_id());
    }
    server->Shutdown();
  }
  // Fails its checksum: indexing skips it (and logs the path); to a client it is unknown.
  std::string bytes = ReadAll(FileOf(dir, ids[0]));
  ASSERT_GT(bytes.size(), 64u);
  bytes[bytes.size() / 2] ^= 0x5a;
  WriteAll(FileOf(dir, ids[0]), bytes);

  auto server = Start(dir);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  // Indexing runs in the background: wait until the good sessions are known.
  bool indexed = false;
  for (int i = 0; i < 1000 && !indexed; ++i) {
    indexed = client.GetSession(ids[2]).ok() && client.GetSession(ids[1]).ok();
    if (!indexed) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(indexed);
  ExpectNoPath(client.GetSession(ids[0]).status(), StatusCode::kNotFound, dir, "skipped file");
  ExpectNoPath(client.Generate(GreedyRequest("x", 2, ids[0])).status(), StatusCode::kNotFound, dir,
               "Generate on a skipped file");

  // Indexed, not yet loaded: its file goes away before its first use.
  ASSERT_FALSE(client.GetSession(ids[1])->resident());
  ASSERT_TRUE(std::filesystem::remove(FileOf(dir, ids[1])));
  ExpectEveryLoadFails(client, ids[1], StatusCode::kDataLoss, dir, "deleted after a restart");
  EXPECT_TRUE(client.Generate(GreedyRequest("x", 2, ids[2])).ok());
}

TEST_F(ErrorPathsTest, ImportOfDamagedBlobsIsInvalidArgumentWithoutPaths) {
  const std::string dir = MakeTempDir("errpaths-import");
  auto server = Start(dir);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  auto session = client.CreateSession("", "to export");
  ASSERT_TRUE(session.ok()) << session.status();
  auto exported = client.ExportSession(session->session_id());
  ASSERT_TRUE(exported.ok()) << exported.status();
  const std::string blob = exported->blob();
  std::string altered = blob;
  altered[altered.size() - 8] ^= 0x5a;
  for (const auto& [what, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"truncated", blob.substr(0, blob.size() / 2)},
           {"altered", altered},
           {"garbage", "not a blob at all"},
           {"a path", dir + "/" + session->session_id() + ".fwstate"}}) {
    auto imported = client.ImportSession(bytes);
    if (what == "a path") {
      // The blob is the client's own bytes; whatever is said of it, no file is read.
      EXPECT_EQ(imported.status().code(), StatusCode::kInvalidArgument) << imported.status();
      continue;
    }
    ExpectNoPath(imported.status(), StatusCode::kInvalidArgument, dir, what);
  }
  EXPECT_EQ(client.ListAllSessions()->size(), 1u);
}

}  // namespace
}  // namespace fwtest
