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
#include <algorithm>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "server/tenancy/authenticator.h"
#include "server/tenancy/tenants.h"
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

  // A client of a dead port whose backoffs are recorded in `waits` instead of slept.
  static std::unique_ptr<fwserve::Client> RecordingClient(int max_retries,
                                                          absl::Duration initial_backoff,
                                                          absl::Duration max_backoff,
                                                          std::vector<absl::Duration>* waits) {
    fwserve::ClientOptions options;
    options.target = DeadTarget();
    options.max_retries = max_retries;
    options.initial_backoff = initial_backoff;
    options.max_backoff = max_backoff;
    options.retry_wait_for_testing = [waits](absl::Duration backoff) { waits->push_back(backoff); };
    auto client = fwserve::Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

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
  // The real waits: three retries take at least 100 + 200 + 400 ms.
  auto client = Connect(DeadTarget(), 3, absl::Milliseconds(100), absl::Seconds(1));
  ASSERT_NE(client, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_EQ(client->Health().status().code(), StatusCode::kUnavailable);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(700));

  // Every idempotent call (docs/client.md) is retried with the same doubling backoffs.
  std::vector<absl::Duration> waits;
  auto recording = RecordingClient(3, absl::Milliseconds(100), absl::Seconds(1), &waits);
  ASSERT_NE(recording, nullptr);
  const std::vector<absl::Duration> doubling = {absl::Milliseconds(100), absl::Milliseconds(200),
                                                absl::Milliseconds(400)};
  const std::string id(32, 'a');
  v1::ScoreRequest score;
  score.set_text("abc");
  const std::vector<std::pair<std::string, std::function<absl::Status()>>> calls = {
      {"Health", [&] { return recording->Health().status(); }},
      {"ListSessions", [&] { return recording->ListSessions().status(); }},
      {"ListModels", [&] { return recording->ListModels().status(); }},
      {"DescribeModel", [&] { return recording->DescribeModel("aft").status(); }},
      {"GetSession", [&] { return recording->GetSession(id).status(); }},
      {"ExportSession", [&] { return recording->ExportSession(id).status(); }},
      {"Score", [&] { return recording->Score(score).status(); }},
  };
  for (const auto& [name, call] : calls) {
    waits.clear();
    EXPECT_EQ(call().code(), StatusCode::kUnavailable) << name;
    EXPECT_EQ(waits, doubling) << name;
  }
}

TEST_F(ClientTest, BackoffIsCappedAtMaxBackoff) {
  std::vector<absl::Duration> waits;
  auto client = RecordingClient(4, absl::Milliseconds(200), absl::Milliseconds(500), &waits);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->ListModels().status().code(), StatusCode::kUnavailable);
  // Uncapped doubling would wait 200, 400, 800 and 1600 ms.
  EXPECT_EQ(waits, (std::vector<absl::Duration>{absl::Milliseconds(200), absl::Milliseconds(400),
                                                absl::Milliseconds(500), absl::Milliseconds(500)}));
}

TEST_F(ClientTest, CallsThatChangeStateAreNotRetried) {
  std::vector<absl::Duration> waits;
  auto client = RecordingClient(3, absl::Milliseconds(500), absl::Seconds(1), &waits);
  ASSERT_NE(client, nullptr);
  const std::string id(32, 'a');
  const auto expect_one_attempt = [&waits](const char* what, const absl::Status& status) {
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << what;
    EXPECT_TRUE(waits.empty()) << what << " was retried";
    waits.clear();
  };
  expect_one_attempt("CreateSession", client->CreateSession().status());
  expect_one_attempt("DeleteSession", client->DeleteSession(id));
  expect_one_attempt("ForkSession", client->ForkSession(id).status());
  expect_one_attempt("ImportSession", client->ImportSession("blob").status());
  expect_one_attempt("Generate", client->Generate(Request("x", 1)).status());
  // The same client does retry an idempotent call.
  EXPECT_EQ(client->Health().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(waits.size(), 3u);
}

TEST_F(ClientTest, NoRetriesMeansOneAttempt) {
  std::vector<absl::Duration> waits;
  auto client = RecordingClient(0, absl::Seconds(1), absl::Seconds(1), &waits);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->Health().status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(waits.empty());
}

// The channel's reconnection backoff follows the client's: a server that comes up
// during the retries is reached. The server starts during the first backoff; the
// retries then wait 100, 200, 200 ms (with gRPC's default reconnect backoff of about
// 1 s, the channel would still be waiting to reconnect at the last one).
TEST_F(ClientTest, ARetryReachesAServerThatComesUpDuringTheBackoff) {
  const int port = FreeLoopbackPort();
  auto core = fwserve::Core::Create(Options());
  ASSERT_TRUE(core.ok()) << core.status();
  std::unique_ptr<fwserve::GrpcServer> server;
  int waits = 0;
  fwserve::ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port);
  options.max_retries = 3;
  options.initial_backoff = absl::Milliseconds(100);
  options.max_backoff = absl::Milliseconds(200);
  options.deadline = absl::Seconds(10);
  options.retry_wait_for_testing = [&](absl::Duration backoff) {
    if (waits++ == 0) {
      fwserve::GrpcServerOptions server_options;
      server_options.listen = options.target;
      server_options.drain_timeout = absl::Seconds(1);
      auto started = fwserve::GrpcServer::Start(server_options, core->get());
      ASSERT_TRUE(started.ok()) << started.status();
      server = std::move(*started);
    }
    absl::SleepFor(backoff);
  };
  auto client = fwserve::Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<bool> health = (*client)->Health();
  ASSERT_GE(waits, 1) << "the first attempt reached a server that was not started";
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(health.ok()) << health.status() << " after " << waits << " retries";
  EXPECT_TRUE(*health);
  server->Shutdown();
}

// ----------------------------------------------------------------------------------
// Authentication metadata.

class TokenAuthenticator : public fwserve::Authenticator {
 public:
  explicit TokenAuthenticator(std::string token) : token_(std::move(token)) {}
  absl::StatusOr<std::string> Authenticate(const fwserve::CallCredentials& credentials) override {
    const auto& metadata = credentials.metadata;
    auto it = metadata.find("authorization");
    std::lock_guard<std::mutex> lock(mutex_);
    seen_.push_back(it == metadata.end() ? "<none>" : it->second);
    if (it == metadata.end()) return absl::UnauthenticatedError("missing authorization");
    if (it->second != "Bearer " + token_) return absl::UnauthenticatedError("bad token");
    return std::string("tenant");
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
  const auto count = [&](const std::string& token) {
    const std::vector<std::string> seen = authenticator.seen();
    return std::count(seen.begin(), seen.end(), token);
  };
  EXPECT_EQ((*wrong)->ListModels().status().code(), StatusCode::kUnauthenticated);
  // Not retried (ListModels is retried on UNAVAILABLE only): the server saw one call.
  EXPECT_EQ(count("Bearer wrong"), 1);
  EXPECT_EQ((*wrong)->Generate(Request("x", 3)).status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(count("Bearer wrong"), 2);

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

TEST_F(ClientTest, MutualTlsCertificateMapsToATenant) {
  const Pem server_pem = MakeCertificate("server");
  const Pem batch_pem = MakeCertificate("batch.internal");
  const Pem other_pem = MakeCertificate("other.internal");
  // `x509-cn:` lines of --api-keys-file map a verified certificate to a tenant.
  auto tenants = fwserve::Tenants::FromText(
      "x509-cn:batch.internal tenant=batch\n"
      "sha256:" +
      fwserve::Sha256Hex("acme-key") + " tenant=acme\n");
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  fwserve::ApiKeyAuthenticator authenticator(tenants->get(), nullptr);
  fwserve::CoreOptions core_options = Options();
  core_options.tenants = tenants->get();
  fwserve::GrpcServerOptions server_options;
  server_options.tls_cert_pem = server_pem.certificate;
  server_options.tls_key_pem = server_pem.key;
  server_options.tls_client_ca_pem = batch_pem.certificate + other_pem.certificate;
  server_options.authenticator = &authenticator;
  auto server = fwtest::Harness::Start(core_options, server_options);
  ASSERT_NE(server, nullptr);
  const auto connect = [&](const Pem& client_pem, const std::string& key) {
    fwserve::ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(server->port());
    options.max_retries = 0;
    options.use_tls = true;
    options.tls_root_certs_pem = server_pem.certificate;
    options.tls_client_cert_pem = client_pem.certificate;
    options.tls_client_key_pem = client_pem.key;
    options.auth_token = key;
    auto client = fwserve::Client::Connect(options);
    EXPECT_TRUE(client.ok());
    return std::move(*client);
  };
  auto batch = connect(batch_pem, "");
  auto session = batch->CreateSession("", "by certificate");
  ASSERT_TRUE(session.ok()) << session.status();
  // A verified but unmapped certificate is not a tenant.
  auto other = connect(other_pem, "");
  EXPECT_EQ(other->ListSessions().status().code(), StatusCode::kUnauthenticated);
  // A key decides alone: acme's key over batch's certificate is acme, who cannot see
  // batch's session; a wrong key is refused although the certificate is mapped.
  auto acme = connect(batch_pem, "acme-key");
  EXPECT_EQ(acme->GetSession(session->session_id()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(connect(batch_pem, "wrong")->ListSessions().status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_TRUE(batch->GetSession(session->session_id()).ok());
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
  // One token per message (no decode pipelining), so both ways see the same messages.
  fwserve::CoreOptions options = Options();
  options.engine.decode_lookahead = 1;
  auto server = Harness::Start(options);
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
  int retries = 0;
  options.retry_wait_for_testing = [&retries](absl::Duration) { ++retries; };
  auto client = fwserve::Client::Connect(options);
  ASSERT_TRUE(client.ok());

  // A stream that would take far longer than its deadline.
  auto generated = (*client)->Generate(Request("slow", 100000));
  EXPECT_EQ(generated.status().code(), StatusCode::kDeadlineExceeded);
  auto stream = (*client)->StartGenerate(Request("slow", 100000));
  v1::GenerateResponse message;
  while (stream->Next(&message)) {
  }
  EXPECT_EQ(stream->Finish().code(), StatusCode::kDeadlineExceeded);

  // A unary call with a 1 ms deadline (scoring 16 KB takes far longer). Not 1 MB: the
  // server finishes a Score whose caller is gone, and the harness's drain would wait.
  v1::ScoreRequest score;
  score.set_text(std::string(16 << 10, 'a'));
  EXPECT_EQ((*client)->Score(score).status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(retries, 0);  // DEADLINE_EXCEEDED is not retried
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
