#include "tests/integration/harness.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>

#include "models/architectures/model.h"
#include "models/checkpoints/checkpoint.h"
#include "models/kernels/scoring.h"
#include "models/tokenizers/tokenizer.h"
#include "tests/unit/test_models.h"

namespace fwtest {

void WriteTinyCheckpoint(const std::string& dir, const std::string& architecture, uint64_t seed) {
  auto arch = fwmodel::ParseArchitecture(architecture);
  ASSERT_TRUE(arch.ok()) << arch.status();
  fwmodel::ModelConfig config = TinyConfig(*arch, fwmodel::FfnKind::kSquaredRelu, 3);
  config.vocab_size = 256;
  fwmodel::Model model = RandomModel(config, seed, torch::kFloat32, 0.3);
  absl::Status saved = fwmodel::SaveCheckpoint(model, dir, fwmodel::DType::kF32);
  ASSERT_TRUE(saved.ok()) << saved;
}

std::vector<double> ReferenceScore(const std::string& checkpoint_dir, const std::string& text) {
  auto loaded = fwmodel::LoadCheckpoint(checkpoint_dir, {});
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  if (!loaded.ok()) return {};
  auto scores = fwmodel::ScoreTokens(loaded->model, fwmodel::EncodeBytes(text));
  EXPECT_TRUE(scores.ok()) << scores.status();
  return scores.ok() ? *scores : std::vector<double>{};
}

int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

std::unique_ptr<Harness> Harness::Start(fwserve::CoreOptions core_options,
                                        fwserve::GrpcServerOptions server_options,
                                        bool expose_metrics,
                                        std::optional<fwserve::HttpServerOptions> http) {
  auto harness = std::make_unique<Harness>();
  harness->metrics_ = fwserve::Metrics::Create();
  if (expose_metrics) harness->StartExposer();
  core_options.metrics = harness->metrics_.get();
  auto core = fwserve::Core::Create(core_options);
  EXPECT_TRUE(core.ok()) << core.status();
  if (!core.ok()) return nullptr;
  harness->core_ = std::move(*core);
  server_options.listen = "127.0.0.1:0";
  // A failing test may leave streams open; do not wait the production 30 s for them.
  if (server_options.drain_timeout == fwserve::GrpcServerOptions().drain_timeout) {
    server_options.drain_timeout = absl::Seconds(3);
  }
  server_options.metrics = harness->metrics_.get();
  auto server = fwserve::GrpcServer::Start(server_options, harness->core_.get());
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  harness->server_ = std::move(*server);
  harness->drain_timeout_ = server_options.drain_timeout;
  if (http.has_value()) {
    http->listen = "127.0.0.1:0";
    http->metrics = harness->metrics_.get();
    auto started = fwserve::HttpServer::Start(*http, harness->core_.get());
    EXPECT_TRUE(started.ok()) << started.status();
    if (!started.ok()) return nullptr;
    harness->http_ = std::move(*started);
  }
  fwserve::ClientOptions client_options;
  client_options.target = harness->target();
  client_options.deadline = absl::Seconds(30);
  auto client = fwserve::Client::Connect(client_options);
  EXPECT_TRUE(client.ok()) << client.status();
  harness->client_ = std::move(*client);
  return harness;
}

void Harness::StartExposer() {
  // civetweb cannot bind port 0: take a free port from the kernel (a small race with
  // other processes, retried).
  for (int attempt = 0; attempt < 5 && exposer_ == nullptr; ++attempt) {
    const int port = FreeLoopbackPort();
    try {
      exposer_ = std::make_unique<prometheus::Exposer>("127.0.0.1:" + std::to_string(port));
      metrics_port_ = port;
    } catch (const std::exception&) {
    }
  }
  EXPECT_NE(exposer_, nullptr);
  if (exposer_ == nullptr) return;
  exposer_->RegisterCollectable(metrics_->registry());
}

Harness::~Harness() { Shutdown(); }

void Harness::Shutdown() {
  if (server_ == nullptr) return;
  if (http_ == nullptr) {
    server_->Shutdown();
    return;
  }
  // Two transports: server/fwserve.cc's order.
  server_->BeginShutdown();
  http_->BeginShutdown();
  core_->BeginShutdown();
  const bool idle = core_->WaitIdle(absl::Now() + drain_timeout_);
  core_->EndAllWork();
  server_->StopServing(idle);
  http_->Stop(idle ? absl::ZeroDuration() : absl::Seconds(5));
  core_->Stop();
}

fwserve::v1::GenerateRequest GreedyRequest(const std::string& prompt, int max_tokens,
                                           const std::string& session_id) {
  fwserve::v1::GenerateRequest request;
  request.set_prompt(prompt);
  request.set_max_tokens(max_tokens);
  request.set_session_id(session_id);
  request.mutable_sampling()->set_temperature(0);
  return request;
}

std::string ExpectSessionContinuesTheSameAfterForkAndExportImport(fwserve::Client& client,
                                                                  const std::string& prefix,
                                                                  int tokens) {
  auto session = client.CreateSession("", prefix);
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return "";
  auto fork = client.ForkSession(session->session_id());
  EXPECT_TRUE(fork.ok()) << fork.status();
  auto exported = client.ExportSession(session->session_id());
  EXPECT_TRUE(exported.ok()) << exported.status();
  if (!fork.ok() || !exported.ok()) return "";
  auto imported = client.ImportSession(exported->blob());
  EXPECT_TRUE(imported.ok()) << imported.status();
  if (!imported.ok()) return "";
  auto original = client.Generate(GreedyRequest("", tokens, session->session_id()));
  auto forked = client.Generate(GreedyRequest("", tokens, fork->session_id()));
  auto reimported = client.Generate(GreedyRequest("", tokens, imported->session_id()));
  EXPECT_TRUE(original.ok() && forked.ok() && reimported.ok());
  if (!original.ok() || !forked.ok() || !reimported.ok()) return "";
  EXPECT_EQ(original->token_ids.size(), static_cast<size_t>(tokens));
  EXPECT_EQ(forked->token_ids, original->token_ids);
  EXPECT_EQ(reimported->token_ids, original->token_ids);
  auto fresh = client.Generate(GreedyRequest(prefix, tokens));
  EXPECT_TRUE(fresh.ok()) << fresh.status();
  if (fresh.ok()) {
    EXPECT_EQ(fresh->token_ids, original->token_ids);
  }
  return session->session_id();
}

namespace {

// Sums `value(metric)` over the series of family `name` in `harness`'s metrics.
template <typename Value>
auto SumOver(Harness& harness, const std::string& name, Value value) {
  decltype(value(prometheus::ClientMetric{})) total{};
  for (const auto& family : harness.metrics().registry()->Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric) total += value(metric);
  }
  return total;
}

}  // namespace

double GaugeValue(Harness& harness, const std::string& name) {
  return SumOver(harness, name, [](const prometheus::ClientMetric& m) { return m.gauge.value; });
}

uint64_t HistogramCount(Harness& harness, const std::string& name) {
  return SumOver(harness, name, [](const prometheus::ClientMetric& m) {
    return static_cast<uint64_t>(m.histogram.sample_count);
  });
}

}  // namespace fwtest
