// Prints the text exposition of a Metrics object on which every update method has been
// called, so that every series fwserve exports is present. The deploy tests lint it with
// `promtool check metrics` and check the dashboard and alert rules against its names.
#include <iostream>
#include <sstream>

#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/metrics/metrics.h"

int main() {
  auto metrics = fwserve::Metrics::Create();
  fwserve::ModelInfoLabels info;
  info.model = "example";
  info.architecture = "fast_weight";
  info.parameters = 1000000;
  info.state_bytes_per_session = 65536;
  fwserve::ModelMetrics* m = metrics->AddModel(info);
  m->ObserveTimeToFirstToken(0.05);
  m->ObserveInterTokenLatency(0.004);
  m->ObserveGenerationDuration(1.5);
  m->AddPromptTokens(12);
  m->AddGeneratedTokens(64);
  m->AddPromptTokensSaved(8);
  m->AddScoredTokens(20);
  m->ObserveDecodeStep(4, 0.003);
  m->ObservePrefillChunk(12, 0.01);
  m->SetQueuedRequests(1);
  m->SetActiveStreams(4);
  m->SetSessions(2, 1, 2 * 65536);
  m->SetStateMemoryUsage(2 * 65536, 1 << 30);
  m->CountSessionOperation("created");
  m->CountSessionRemoval("expired");
  m->CountSessionStoreError("write");
  m->ObserveSessionStoreWrite(0.002);
  m->CountSessionCacheLookup(true);
  m->CountSessionCacheLookup(false);
  metrics->ObserveSessionStoreOperation("acquire", "ok", 0.0005);
  metrics->ObserveSessionStoreOperation("acquire", "conflict", 0.0005);
  metrics->ObserveSessionStoreOperation("commit", "unavailable", 1.0);
  metrics->ObserveRequest("Generate", "example", 0, 1.5);
  metrics->ObserveRequest("Generate", "example", 8, 0.001);
  metrics->CountRefused("unauthenticated");
  metrics->CountRefused("quota_streams");
  metrics->ObserveTenantRequest("acme", "Generate", 0);
  metrics->AddTenantGeneratedTokens("acme", 128);
  metrics->SetTenantActiveStreams("acme", 3);

  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, metrics->registry()->Collect());
  std::cout << out.str();
  return std::cout ? 0 : 1;
}
