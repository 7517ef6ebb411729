// The client library's own contract (client/client.h), against a real in-process server
// (tests/integration/harness.h) or a dead port: retries and backoff, bearer-token
// metadata, the two forms of Generate, cancellation, deadlines and status codes.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "tests/integration/harness.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;
using absl::StatusCode;

std::string* g_models_dir = nullptr;

class ClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (g_models_dir == nullptr) {
      g_models_dir = new std::string(MakeTempDir("client-models"));
      WriteTinyCheckpoint(*g_models_dir + "/aft", "aft", 7);
    }
  }

  static fwserve::CoreOptions Options() {
    fwserve::CoreOptions options;
    options.model_dirs = {*g_models_dir + "/aft"};
    options.max_tokens = 100000;
    return options;
  }

  // A client of `target` with the given retry policy.
  static std::unique_ptr<fwserve::Client> Connect(const std::string& target, int max_retries,
                                                  absl::Duration initial_backoff,
                                                  absl::Duration max_backoff) {
    fwserve::ClientOptions options;
    options.target = target;
    options.max_retries = max_retries;
    options.initial_backoff = initial_backoff;
    options.max_backoff = max_backoff;
    options.deadline = absl::Seconds(10);
    auto client = fwserve::Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static std::string DeadTarget() { return "127.0.0.1:" + std::to_string(FreeLoopbackPort()); }

  static v1::GenerateRequest Request(const std::string& prompt, int max_tokens,
                                     const std::string& session_id = "") {
    v1::GenerateRequest request;
    request.set_prompt(prompt);
    request.set_max_tokens(max_tokens);
    request.set_session_id(session_id);
    request.mutable_sampling()->set_temperature(1.0f);
    request.mutable_sampling()->set_seed(5);
    return request;
  }

  // Waits until the server lets go of a session (after a cancelled stream).
  static v1::SessionInfo WaitUntilIdle(fwserve::Client& client, const std::string& session_id) {
    absl::StatusOr<v1::SessionInfo> info;
    for (int i = 0; i < 250; ++i) {
      info = client.GetSession(session_id);
      EXPECT_TRUE(info.ok()) << info.status();
      if (!info.ok() || !info->busy()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_FALSE(info->busy());
    return *info;
  }
};

// ----------------------------------------------------------------------------------
// Retries.

TEST_F(ClientTest, IdempotentCallsRetryOnUnavailableWithDoublingBackoff) {
  auto client = Connect(DeadTarget(), 3, absl::Milliseconds(100), absl::Seconds(1));
  ASSERT_NE(client, nullptr);
  absl::Time start = absl::Now();
  absl::StatusOr<bool> health = client->Health();
  // Three retries after 100 + 200 + 400 ms.
  EXPECT_EQ(health.status().code(), StatusCode::kUnavailable);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(700));

  start = absl::Now();
  EXPECT_EQ(client->ListSessions().status().code(), StatusCode::kUnavailable);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(700));
}

TEST_F(ClientTest, BackoffIsCappedAtMaxBackoff) {
  auto client = Connect(DeadTarget(), 3, absl::Milliseconds(200), absl::Milliseconds(200));
  ASSERT_NE(client, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_EQ(client->ListModels().status().code(), StatusCode::kUnavailable);
  const absl::Duration elapsed = absl::Now() - start;
  // 200 + 200 + 200 ms; uncapped doubling would take 200 + 400 + 800 ms.
  EXPECT_GE(elapsed, absl::Milliseconds(600));
  EXPECT_LT(elapsed, absl::Milliseconds(1300));
}

TEST_F(ClientTest, CallsThatChangeStateAreNotRetried) {
  auto client = Connect(DeadTarget(), 3, absl::Milliseconds(500), absl::Seconds(1));
  ASSERT_NE(client, nullptr);
  const std::string id(32, 'a');
  const auto expect_fast_unavailable = [](const char* what, const absl::Status& status,
                                          absl::Time start) {
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << what;
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(450)) << what << " was retried";
  };
  absl::Time start = absl::Now();
  expect_fast_unavailable("CreateSession", client->CreateSession().status(), start);
  start = absl::Now();
  expect_fast_unavailable("DeleteSession", client->DeleteSession(id), start);
  start = absl::Now();
  expect_fast_unavailable("ForkSession", client->ForkSession(id).status(), start);
  start = absl::Now();
  expect_fast_unavailable("ImportSession", client->ImportSession("blob").status(), start);
  start = absl::Now();
  expect_fast_unavailable("Generate", client->Generate(Request("x", 1)).status(), start);
}

TEST_F(ClientTest, NoRetriesMeansOneAttempt) {
  auto client = Connect(DeadTarget(), 0, absl::Seconds(1), absl::Seconds(1));
  ASSERT_NE(client, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_EQ(client->Health().status().code(), StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));
}

// The channel's reconnection backoff follows the client's: a server that comes up
// during the retries is reached (with gRPC's default reconnect backoff of about 1 s,
// every retry below, all within 0.7 s, would fail at once).
TEST_F(ClientTest, ARetryReachesAServerThatComesUpDuringTheBackoff) {
  const int port = FreeLoopbackPort();
  auto core = fwserve::Core::Create(Options());
  ASSERT_TRUE(core.ok()) << core.status();
  auto client = Connect("127.0.0.1:" + std::to_string(port), 4, absl::Milliseconds(100),
                        absl::Milliseconds(200));
  ASSERT_NE(client, nullptr);

  std::unique_ptr<fwserve::GrpcServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    fwserve::GrpcServerOptions options;
    options.listen = "127.0.0.1:" + std::to_string(port);
    options.drain_timeout = absl::Seconds(1);
    auto started = fwserve::GrpcServer::Start(options, core->get());
    ASSERT_TRUE(started.ok()) << started.status();
    server = std::move(*started);
  });
  // Attempts at about 0, 0.1, 0.3, 0.5 and 0.7 s; the server is up from 0.15 s. The
  // first attempt's connection is refused; the channel must reconnect in time.
  const absl::Time start = absl::Now();
  absl::StatusOr<bool> health = client->Health();
  starter.join();
  ASSERT_TRUE(health.ok()) << health.status() << " after " << (absl::Now() - start);
  EXPECT_TRUE(*health);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));
  if (server != nullptr) server->Shutdown();
}

// ----------------------------------------------------------------------------------
// Authentication metadata.

class TokenAuthenticator : public fwserve::Authenticator {
 public:
  explicit TokenAuthenticator(std::string token) : token_(std::move(token)) {}
  absl::Status Authenticate(const std::multimap<std::string, std::string>& metadata) override {
    auto it = metadata.find("authorization");
    std::lock_guard<std::mutex> lock(mutex_);
    seen_.push_back(it == metadata.end() ? "<none>" : it->second);
    if (it == metadata.end()) return absl::UnauthenticatedError("missing authorization");
    if (it->second != "Bearer " + token_) return absl::UnauthenticatedError("bad token");
    return absl::OkStatus();
  }
  std::vector<std::string> seen() {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }

 private:
  const std::string token_;
  std::mutex mutex_;
  std::vector<std::string> seen_;
};

TEST_F(ClientTest, AuthTokenIsSentAsBearerMetadata) {
  TokenAuthenticator authenticator("sekrit");
  fwserve::GrpcServerOptions server_options;
  server_options.authenticator = &authenticator;
  auto server = Harness::Start(Options(), server_options);
  ASSERT_NE(server, nullptr);

  // The harness's client sends no token.
  EXPECT_EQ(server->client().ListModels().status().code(), StatusCode::kUnauthenticated);

  fwserve::ClientOptions options;
  options.target = server->target();
  options.initial_backoff = absl::Seconds(1);
  options.auth_token = "wrong";
  auto wrong = fwserve::Client::Connect(options);
  ASSERT_TRUE(wrong.ok());
  const absl::Time start = absl::Now();
  EXPECT_EQ((*wrong)->ListModels().status().code(), StatusCode::kUnauthenticated);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));  // not retried
  EXPECT_EQ((*wrong)->Generate(Request("x", 3)).status().code(), StatusCode::kUnauthenticated);

  options.auth_token = "sekrit";
  auto right = fwserve::Client::Connect(options);
  ASSERT_TRUE(right.ok());
  EXPECT_TRUE((*right)->ListModels().ok());
  auto session = (*right)->CreateSession("", "auth");
  ASSERT_TRUE(session.ok()) << session.status();
  auto generated = (*right)->Generate(Request("x", 3, session->session_id()));
  ASSERT_TRUE(generated.ok()) << generated.status();
  EXPECT_EQ(generated->token_ids.size(), 3u);

  const std::vector<std::string> seen = authenticator.seen();
  ASSERT_GE(seen.size(), 6u);
  EXPECT_EQ(seen[0], "<none>");
  EXPECT_EQ(seen[1], "Bearer wrong");
  EXPECT_EQ(seen.back(), "Bearer sekrit");
}

// ----------------------------------------------------------------------------------
// TLS: the real server with self-signed certificates.

struct Pem {
  std::string key;
  std::string certificate;
};

// A self-signed certificate for localhost and 127.0.0.1 (RSA 2048, one day), made with
// the OpenSSL library so that the test needs no openssl command.
Pem MakeCertificate(const std::string& common_name) {
  Pem pem;
  EVP_PKEY* key = EVP_RSA_gen(2048);
  X509* x509 = X509_new();
  X509_set_version(x509, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x509), 1);
  X509_gmtime_adj(X509_getm_notBefore(x509), -60);
  X509_gmtime_adj(X509_getm_notAfter(x509), 24 * 3600);
  X509_set_pubkey(x509, key);
  X509_NAME* name = X509_get_subject_name(x509);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(x509, name);
  X509V3_CTX context;
  X509V3_set_ctx_nodb(&context);
  X509V3_set_ctx(&context, x509, x509, nullptr, nullptr, 0);
  for (const auto& [nid, value] :
       {std::pair<int, const char*>{NID_subject_alt_name, "DNS:localhost,IP:127.0.0.1"},
        {NID_basic_constraints, "critical,CA:TRUE"}}) {
    X509_EXTENSION* extension = X509V3_EXT_conf_nid(nullptr, &context, nid, value);
    X509_add_ext(x509, extension, -1);
    X509_EXTENSION_free(extension);
  }
  X509_sign(x509, key, EVP_sha256());
  const auto to_string = [](BIO* bio) {
    char* data = nullptr;
    const long size = BIO_get_mem_data(bio, &data);
    std::string text(data, static_cast<size_t>(size));
    BIO_free(bio);
    return text;
  };
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  pem.key = to_string(bio);
  bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, x509);
  pem.certificate = to_string(bio);
  X509_free(x509);
  EVP_PKEY_free(key);
  return pem;
}

TEST_F(ClientTest, TlsWithServerRootsAndClientCertificates) {
  const Pem server_pem = MakeCertificate("server");
  const Pem client_pem = MakeCertificate("client");
  ASSERT_FALSE(server_pem.certificate.empty() || client_pem.certificate.empty());
  // The real server with TLS and mutual TLS (--tls-cert-file, --tls-key-file,
  // --tls-client-ca-file).
  fwserve::GrpcServerOptions server_options;
  server_options.tls_cert_pem = server_pem.certificate;
  server_options.tls_key_pem = server_pem.key;
  server_options.tls_client_ca_pem = client_pem.certificate;
  auto server = fwtest::Harness::Start(Options(), server_options);
  ASSERT_NE(server, nullptr);
  const int port = server->port();

  fwserve::ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port);
  options.max_retries = 0;
  options.deadline = absl::Seconds(10);
  const auto health = [&](const fwserve::ClientOptions& o) {
    auto client = fwserve::Client::Connect(o);
    EXPECT_TRUE(client.ok());
    return (*client)->Health();
  };
  // Plaintext against TLS, and TLS that does not trust the server, fail.
  EXPECT_EQ(health(options).status().code(), StatusCode::kUnavailable);
  options.use_tls = true;
  options.tls_root_certs_pem = client_pem.certificate;  // the wrong root
  options.tls_client_cert_pem = client_pem.certificate;
  options.tls_client_key_pem = client_pem.key;
  EXPECT_EQ(health(options).status().code(), StatusCode::kUnavailable);
  // The right root but no client certificate: the server refuses the handshake.
  options.tls_root_certs_pem = server_pem.certificate;
  fwserve::ClientOptions no_client_cert = options;
  no_client_cert.tls_client_cert_pem.clear();
  no_client_cert.tls_client_key_pem.clear();
  EXPECT_EQ(health(no_client_cert).status().code(), StatusCode::kUnavailable);
  // Everything right.
  absl::StatusOr<bool> serving = health(options);
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);
  // And the API itself over mutual TLS.
  auto client = fwserve::Client::Connect(options);
  ASSERT_TRUE(client.ok());
  fwserve::v1::GenerateRequest request;
  request.set_prompt("over TLS");
  request.set_max_tokens(5);
  auto generated = (*client)->Generate(request);
  ASSERT_TRUE(generated.ok()) << generated.status();
  EXPECT_EQ(generated->token_ids.size(), 5u);
}

// ----------------------------------------------------------------------------------
// Generate.

TEST_F(ClientTest, IteratorAndCallbackGenerateGiveTheSameTokens) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request = Request("Same seed, same text", 200);
  request.set_logprobs(true);

  int callback_messages = 0;
  auto with_callback = server->client().Generate(request, [&](const v1::GenerateResponse&) {
    ++callback_messages;
    return true;
  });
  ASSERT_TRUE(with_callback.ok()) << with_callback.status();

  std::unique_ptr<fwserve::GenerateStream> stream = server->client().StartGenerate(request);
  v1::GenerateResponse message;
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
  std::string text;
  v1::GenerateResponse last;
  int messages = 0;
  while (stream->Next(&message)) {
    ++messages;
    tokens.insert(tokens.end(), message.token_ids().begin(), message.token_ids().end());
    logprobs.insert(logprobs.end(), message.logprobs().begin(), message.logprobs().end());
    text += message.text();
    last = message;
  }
  ASSERT_TRUE(stream->Finish().ok());

  EXPECT_EQ(with_callback->token_ids.size(), 200u);
  EXPECT_EQ(tokens, with_callback->token_ids);
  EXPECT_EQ(logprobs, with_callback->logprobs);
  EXPECT_EQ(text, with_callback->text);
  EXPECT_EQ(messages, callback_messages);
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(with_callback->finish_reason, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(last.usage().generated_tokens(), with_callback->usage.generated_tokens());
  EXPECT_EQ(last.usage().prompt_tokens(), with_callback->usage.prompt_tokens());
}

TEST_F(ClientTest, CallbackReturningFalseCancelsAndTheSessionKeepsTheStreamedTokens) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  auto session = client.CreateSession("", "prefix");  // 6 tokens
  ASSERT_TRUE(session.ok());
  int received = 0;
  auto result = client.Generate(Request("go", 50000, session->session_id()),
                                [&](const v1::GenerateResponse& message) {
                                  received += message.token_ids_size();
                                  return received < 10;
                                });
  EXPECT_EQ(result.status().code(), StatusCode::kCancelled);
  EXPECT_GE(received, 10);

  const v1::SessionInfo info = WaitUntilIdle(client, session->session_id());
  EXPECT_GE(info.tokens(), 6 + 2 + received);
  EXPECT_LT(info.tokens(), 6 + 2 + 50000);
  auto next = client.Generate(Request("", 4, session->session_id()));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->usage.session_tokens(), info.tokens() + 4);
}

TEST_F(ClientTest, DroppingAStreamBeforeFinishCancelsIt) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  auto session = client.CreateSession("", "drop");
  ASSERT_TRUE(session.ok());
  {
    std::unique_ptr<fwserve::GenerateStream> stream =
        client.StartGenerate(Request("", 50000, session->session_id()));
    v1::GenerateResponse message;
    ASSERT_TRUE(stream->Next(&message));
  }  // dropped mid-stream
  const v1::SessionInfo info = WaitUntilIdle(client, session->session_id());
  EXPECT_LT(info.tokens(), 4 + 50000);
  EXPECT_TRUE(client.Generate(Request("", 1, session->session_id())).ok());
}

TEST_F(ClientTest, DeadlinesMapToDeadlineExceededAndAreNotRetried) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  fwserve::ClientOptions options;
  options.target = server->target();
  options.generate_deadline = absl::Milliseconds(200);
  options.deadline = absl::Milliseconds(1);
  options.initial_backoff = absl::Seconds(1);
  auto client = fwserve::Client::Connect(options);
  ASSERT_TRUE(client.ok());

  // A stream that would take far longer than its deadline.
  absl::Time start = absl::Now();
  auto generated = (*client)->Generate(Request("slow", 100000));
  EXPECT_EQ(generated.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  auto stream = (*client)->StartGenerate(Request("slow", 100000));
  v1::GenerateResponse message;
  while (stream->Next(&message)) {
  }
  EXPECT_EQ(stream->Finish().code(), StatusCode::kDeadlineExceeded);

  // A unary call with a 1 ms deadline (scoring 16 KB takes far longer). Not 1 MB: the
  // server finishes a Score whose caller is gone, and the harness's drain would wait.
  v1::ScoreRequest score;
  score.set_text(std::string(16 << 10, 'a'));
  start = absl::Now();
  EXPECT_EQ((*client)->Score(score).status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));  // not retried
}

TEST_F(ClientTest, ServerErrorsKeepTheirGrpcCode) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  EXPECT_EQ(client.GetSession(std::string(32, '0')).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client.GetSession("not-an-id").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client.DescribeModel("no-such-model").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client.Generate(Request("x", 200000)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client.ImportSession("not a blob").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(*client.Health("fwserve.v1.Fwserve"));
}

}  // namespace
}  // namespace fwtest
