// What the core holds of one served model: its engine behind an interface without
// LibTorch (engine.h, the implementation, has it), and the call that loads a model
// directory into one. The core and everything above it include this header, never
// engine.h, so that no file above the engine compiles LibTorch's headers
// (tests/tools/layering_test.py follows the includes).
//
// Thread-safety: as Engine's (engine.h): Submit, SubmitClaimed, CheckAdmission,
// ExpectedQueueWait, the shutdown steps and the accessors are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/tokenizers/text_tokenizer.h"
#include "server/api/requests.h"
#include "server/base/clock.h"
#include "server/engine/engine_options.h"
#include "server/engine/state_memory_budget.h"
#include "server/engine/work_item.h"
#include "server/metrics/metrics.h"
#include "server/sessions/session_directory.h"

namespace fwserve {

// What an engine shares with the rest of the core. Pointers are not owned and outlive
// the engine.
struct EngineContext {
  // Where the sessions are kept: the registry, the store threads, the store I/O and
  // what to do with a changed session (SessionDirectory::policy()).
  SessionDirectory* directory = nullptr;
  StateMemoryBudget* budget = nullptr;
  const Clock* clock = nullptr;
  // Never null (the null implementation when metrics are off).
  ModelMetrics* metrics = nullptr;
  // The model's tokenizer (config.json's `tokenizer`): bytes unless it names another.
  // LoadModelEngine sets it from the model directory.
  fwmodel::TextTokenizer tokenizer;
};

// One served model's engine (engine.h). Created by LoadModelEngine, started once by
// Start, stopped by the shutdown steps in order: BeginDrain, WaitIdle, EndAllWork, Stop.
class ModelEngine {
 public:
  virtual ~ModelEngine() = default;

  virtual void Start() = 0;
  virtual const std::string& name() const = 0;
  virtual const std::string& fingerprint() const = 0;
  virtual const fwmodel::TextTokenizer& tokenizer() const = 0;
  // Bytes of one session's state (its row in the pool, its stored size before encoding).
  virtual int64_t state_bytes_per_session() const = 0;

  // Queues `item`. RESOURCE_EXHAUSTED when the queue is full, DEADLINE_EXCEEDED when a
  // Generate could not start before its deadline (GenerateParams::deadline) by the
  // queue's expected wait, UNAVAILABLE when draining; the first two carry a retry delay
  // (server/base/retry_delay.h). On error the item is returned through `item`, its
  // callbacks not called. A Generate's observer gets its stream control first (OnStart),
  // unless OpenStreamBeforeClaim gave it one, which is bound here.
  virtual absl::Status Submit(std::unique_ptr<WorkItem>& item) = 0;
  // Submit for an item whose claim is bound (SessionKeeper::BindClaim), with the
  // session's state when the claim brought it (a shared store's, on a cache miss): it
  // is decoded here, on the calling thread. A state that cannot be decoded answers the
  // item with DATA_LOSS (its claim ended first), takes it and returns OK.
  virtual absl::Status SubmitClaimed(std::unique_ptr<WorkItem>& item,
                                     std::optional<std::string> stored_state) = 0;
  // The same refusals as Submit's, decided from published counts without the lock,
  // before any per-request work (docs/serving.md "Overload"): the cheap early answer.
  // OK does not promise that Submit accepts. Never blocks.
  virtual absl::Status CheckAdmission(absl::Time deadline) const = 0;
  // How long a stream queued now is expected to wait before it starts.
  virtual absl::Duration ExpectedQueueWait() const = 0;

  // Shutdown steps (see Core): refuse new work; wait for idle (store writes included);
  // end the rest; stop the threads (a last attempt to store sessions whose writes
  // failed). Stop is idempotent.
  virtual void BeginDrain() = 0;
  virtual bool WaitIdle(absl::Time deadline) = 0;
  virtual void EndAllWork() = 0;
  virtual void Stop() = 0;
};

// Where and how a model directory is served.
struct ModelEngineSpec {
  std::string name;            // the model's name in requests (its directory's name)
  std::string dir;             // config.json, the weights, the tokenizer's files
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N" (--device)
  // "float32", or "bf16": an RWKV-7 model's matrices stay bfloat16 on a CUDA device
  // (--gpu-matrices; fwmodel::ModelOptions::bf16_matrices).
  std::string gpu_matrices = "float32";
  // CUDA only: cuBLAS may run float32 products on TF32 tensor cores (--gpu-tf32). A
  // process-wide LibTorch setting: once one model asks, every CUDA model's products may.
  bool gpu_tf32 = false;
};

// InvalidArgument naming --device unless `device` is cpu, cuda or cuda:N. Whether a CUDA
// device is there is LoadModelEngine's check.
absl::Status CheckDeviceName(const std::string& device);

// Loads spec.dir (the checkpoint in any layout the model library reads, and the
// tokenizer its config names) onto spec.device and builds its engine, not yet started.
// `metrics_for` is called once, with the model's description (server/api/requests.h:
// its name, architecture, sizes and fingerprint; is_default left false), before the
// engine is built; it returns the model's metrics (never null; context.metrics is
// replaced by it). Runs the
// loading on the calling thread with --threads applied to it. Errors name the model
// directory as the operator gave it.
absl::StatusOr<std::unique_ptr<ModelEngine>> LoadModelEngine(
    const ModelEngineSpec& spec, const EngineOptions& options, EngineContext context,
    const std::function<ModelMetrics*(const ModelDescription&)>& metrics_for);

// Binds `claim` (SessionDirectory::Claim's answer for the item's session) to `item`
// before it is submitted (ModelEngine::SubmitClaimed), on any thread: the item takes the
// lease and the store ticket, and every answer to it first ends the claim
// (SessionKeeper::BindClaim).
void BindSessionClaim(SessionDirectory& directory, SessionClaim& claim, WorkItem& item);

// A Generate whose engine is known only once its session is claimed (a shared store
// names the model): hands the item's observer its stream control now (OnStart; its
// session_id() is the new session of a fork, else the item's session). The engine that
// takes the item binds it (ModelEngine::Submit); a Cancel before then reaches the engine
// through the item's is_cancelled (polled at admission). Thread-safe.
void OpenStreamBeforeClaim(WorkItem& item);

}  // namespace fwserve
