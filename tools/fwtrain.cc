// fwtrain: trains a contract-v1 model on a text file with the byte tokenizer.
// Kill it and run the same command again to resume from the last checkpoint.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli_util.h"
#include "common/load_time_env.h"
#include "models/base/blas_check.h"
#include "models/base/file_util.h"
#include "models/checkpoints/checkpoint.h"
#include "models/training/trainer.h"

namespace {
const fwmodel::TrainOptions kDefaults;
}

ABSL_FLAG(std::string, text, "", "training text file (required); bytes are tokens");
ABSL_FLAG(std::string, out, "",
          "output checkpoint directory (required); resumed if it holds a run");
ABSL_FLAG(std::string, config, "", "config.json for a new run (required unless resuming)");
ABSL_FLAG(uint64_t, seed, kDefaults.seed, "seed of initialisation and data order");
ABSL_FLAG(int64_t, steps, kDefaults.steps, "optimizer steps in the whole run");
ABSL_FLAG(int64_t, batch_size, kDefaults.batch_size, "sequences per step");
ABSL_FLAG(int64_t, seq_len, kDefaults.seq_len, "tokens per training sequence");
ABSL_FLAG(bool, stateful, kDefaults.stateful,
          "carry each row's recurrent state across windows (truncated BPTT over contiguous "
          "segments); false = independent random windows from fresh states");
ABSL_FLAG(int64_t, state_reset_steps, kDefaults.state_reset_steps,
          "with --stateful: 0 = each row reads its own segment and all states reset every "
          "pass; R > 0 = rows read the whole text circularly and each row's state resets "
          "every R steps, staggered, so context ages cover [0, R * seq_len) evenly");
ABSL_FLAG(double, lr, kDefaults.lr, "peak learning rate (AdamW)");
ABSL_FLAG(double, values_lr_scale, kDefaults.values_lr_scale,
          "learning rate of product-key memory values (ffn.values.weight) as a multiple of "
          "--lr (same schedule, no weight decay); Lample et al. use a higher one");
ABSL_FLAG(double, min_lr_ratio, kDefaults.min_lr_ratio, "final lr as a fraction of --lr (cosine)");
ABSL_FLAG(int64_t, warmup_steps, kDefaults.warmup_steps, "linear warm-up steps");
ABSL_FLAG(double, weight_decay, kDefaults.weight_decay, "AdamW weight decay on matrices");
ABSL_FLAG(double, grad_clip, kDefaults.grad_clip, "max gradient L2 norm; 0 = no clipping");
ABSL_FLAG(double, train_fraction, kDefaults.train_fraction,
          "leading fraction of bytes used for training");
ABSL_FLAG(int64_t, eval_interval, kDefaults.eval_interval, "steps between validations");
ABSL_FLAG(int64_t, eval_bytes, kDefaults.eval_bytes,
          "validation bytes scored at intervals (0 = all); the final one scores all");
ABSL_FLAG(int64_t, checkpoint_interval, kDefaults.checkpoint_interval, "steps between checkpoints");
ABSL_FLAG(int32_t, threads, kDefaults.threads, "LibTorch threads; 0 = all cores");
ABSL_FLAG(bool, progress, true, "show a live progress line on stderr");
ABSL_FLAG(int64_t, card_slice_bytes, 8192,
          "bytes of the validation split scored for the card's reproducible slice loss");
ABSL_FLAG(bool, write_card, true, "write MODEL_CARD.md into --out when the run completes");

namespace {

std::string MachineDescription() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return absl::StrCat(model, ", ", std::thread::hardware_concurrency(),
                      " cores, Debian 12, CPU only");
}

absl::Status WriteCard(const fwmodel::TrainOptions& options, const fwmodel::TrainReport& report,
                       const std::string& corpus) {
  auto loaded = fwmodel::LoadCheckpoint(options.out_dir);
  if (!loaded.ok()) return loaded.status();
  const std::string validation = fwmodel::ValidationSplit(corpus, options.train_fraction);
  const int64_t slice_bytes = absl::GetFlag(FLAGS_card_slice_bytes);
  auto slice_loss = fwmodel::ValidationLoss(loaded->model,
                                            validation.substr(0, static_cast<size_t>(slice_bytes)));
  if (!slice_loss.ok()) return slice_loss.status();
  const fwmodel::Model& m = loaded->model;
  std::string card = absl::StrFormat(
      "# %s model card\n\n"
      "Byte-level language model trained on `%s` with `fwtrain` "
      "(fwserve contract v1).\n\n"
      "| | |\n|---|---|\n"
      "| architecture | %s |\n| parameters | %d |\n| state bytes per session | %d |\n"
      "| steps | %d |\n| tokens seen | %d |\n| wall time | %.0f s (%.1f min) |\n"
      "| machine | %s |\n"
      "| final training loss | %.4f nats/byte (mean of the last %d steps) |\n"
      "| validation loss | %.4f nats/byte = %.4f bits/byte (all %d validation bytes) |\n"
      "| validation slice loss | %.6f nats/byte (first %d validation bytes) |\n"
      "| fingerprint | `%s` |\n\n"
      "Validation follows the contract: the last 10%% of the file's bytes, scored from a "
      "fresh state as one stream.\n\n"
      "## Config\n\n```json\n%s```\n\n"
      "## Command\n\n```sh\n%s\n```\n",
      fwmodel::ArchitectureName(m.config().architecture),
      std::filesystem::path(absl::GetFlag(FLAGS_text)).filename().string(),
      fwmodel::ArchitectureName(m.config().architecture), m.parameter_count(),
      m.state_bytes_per_session(), report.step, report.tokens_seen, report.wall_seconds,
      report.wall_seconds / 60, MachineDescription(), report.train_loss,
      std::min<int64_t>(options.eval_interval, report.step), report.val_loss,
      report.val_loss / std::log(2.0), static_cast<int64_t>(validation.size()), *slice_loss,
      slice_bytes, loaded->fingerprint, fwmodel::ModelConfigToJson(m.config()),
      options.command_line);
  std::string memory;
  if (m.config().has_pkm()) {
    memory = absl::StrFormat(
        "| product-key memory | %d slots in %d blocks, %d value parameters (%.1f%% of "
        "parameters) |\n",
        m.memory_slots(), m.config().pkm_layers.size(), m.memory_parameter_count(),
        100.0 * static_cast<double>(m.memory_parameter_count()) /
            static_cast<double>(m.parameter_count()));
  }
  const std::string compute = absl::StrFormat(
      "%s| compute per token | %d FLOPs (decode step: 2 per multiply-add of the matrix "
      "products, `fwmodel info`) |\n",
      memory, fwmodel::FlopsPerToken(m.config()));
  // After the table's parameter row.
  const std::string anchor = "| state bytes per session |";
  card.insert(card.find(anchor), compute);
  return fwmodel::WriteFileAtomic(options.out_dir + "/MODEL_CARD.md", card);
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "fwtrain: %s\n", std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // OPENBLAS_CORETYPE when OpenBLAS misdetected the CPU: executes this binary again once.
  fwserve::ReexecWithLoadTimeEnv(argv, fwserve::LoadTimeEnvOptions());
  absl::SetProgramUsageMessage(
      "fwtrain --text FILE --out DIR --config CONFIG.json [options]\n"
      "Trains a model; run the same command again to resume an interrupted run.");
  std::vector<std::string> args = fwserve::ParseFlagsAllowingDashes(argc, argv);
  if (args.size() != 1) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args[1], "'")));
  }
  if (auto warning = fwmodel::SlowBlasWarning()) std::fprintf(stderr, "%s\n", warning->c_str());
  if (auto note = fwserve::LoadTimeEnvNote()) std::fprintf(stderr, "%s\n", note->c_str());

  fwmodel::TrainOptions options;
  options.text_path = absl::GetFlag(FLAGS_text);
  options.out_dir = absl::GetFlag(FLAGS_out);
  if (options.text_path.empty()) return Fail(absl::InvalidArgumentError("--text is required"));
  if (options.out_dir.empty()) return Fail(absl::InvalidArgumentError("--out is required"));
  const bool resuming = std::ifstream(options.out_dir + "/train_state.json").good();
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (!config_path.empty()) {
    auto text = fwmodel::ReadFile(config_path);
    if (!text.ok()) return Fail(text.status());
    auto config = fwmodel::ParseModelConfig(*text);
    if (!config.ok()) return Fail(config.status());
    options.config = *config;
  } else if (!resuming) {
    return Fail(absl::InvalidArgumentError("--config is required to start a new run"));
  }
  options.seed = absl::GetFlag(FLAGS_seed);
  options.steps = absl::GetFlag(FLAGS_steps);
  options.batch_size = absl::GetFlag(FLAGS_batch_size);
  options.seq_len = absl::GetFlag(FLAGS_seq_len);
  options.stateful = absl::GetFlag(FLAGS_stateful);
  options.state_reset_steps = absl::GetFlag(FLAGS_state_reset_steps);
  options.lr = absl::GetFlag(FLAGS_lr);
  options.min_lr_ratio = absl::GetFlag(FLAGS_min_lr_ratio);
  options.values_lr_scale = absl::GetFlag(FLAGS_values_lr_scale);
  options.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  options.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  options.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  options.train_fraction = absl::GetFlag(FLAGS_train_fraction);
  options.eval_interval = absl::GetFlag(FLAGS_eval_interval);
  options.eval_bytes = absl::GetFlag(FLAGS_eval_bytes);
  options.checkpoint_interval = absl::GetFlag(FLAGS_checkpoint_interval);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.progress = absl::GetFlag(FLAGS_progress);
  options.command_line = fwserve::QuotedCommandLine(argc, argv);

  auto report = fwmodel::Train(options);
  if (!report.ok()) return Fail(report.status());
  std::fprintf(
      stderr,
      "done: %lld steps, %lld tokens, validation %.4f nats/byte (%.4f bits/byte), %.1f min\n",
      static_cast<long long>(report->step), static_cast<long long>(report->tokens_seen),
      report->val_loss, report->val_loss / std::log(2.0), report->wall_seconds / 60);
  std::fprintf(stderr,
               "time: forward %.0f s, backward %.0f s, optimizer %.0f s, validation %.0f s\n",
               report->forward_seconds, report->backward_seconds, report->optimizer_seconds,
               report->eval_seconds);
  if (absl::GetFlag(FLAGS_write_card)) {
    auto corpus = fwmodel::ReadFile(options.text_path);
    if (!corpus.ok()) return Fail(corpus.status());
    absl::Status card = WriteCard(options, *report, *corpus);
    if (!card.ok()) return Fail(card);
  }
  return 0;
}
