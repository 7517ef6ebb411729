#include "models/training/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>

// Training alone needs LibTorch beyond tensors: optimisers, serialisation, the loss.
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "models/architectures/model.h"
#include "models/base/file_util.h"
#include "models/checkpoints/checkpoint.h"
#include "models/kernels/scoring.h"
#include "models/tokenizers/tokenizer.h"
#include "nlohmann/json.hpp"

namespace fwmodel {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr char kStateFile[] = "train_state.json";
constexpr char kOptimizerFile[] = "optimizer.pt";
constexpr char kStreamStateFile[] = "stream_state.pt";

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Options that define the run; a resume must match them exactly.
json RunIdentity(const TrainOptions& o) {
  return json{{"seed", o.seed},
              {"steps", o.steps},
              {"batch_size", o.batch_size},
              {"seq_len", o.seq_len},
              {"lr", o.lr},
              {"min_lr_ratio", o.min_lr_ratio},
              {"warmup_steps", o.warmup_steps},
              {"weight_decay", o.weight_decay},
              {"adam_beta1", o.adam_beta1},
              {"adam_beta2", o.adam_beta2},
              {"grad_clip", o.grad_clip},
              {"train_fraction", o.train_fraction},
              {"stateful", o.stateful},
              {"state_reset_steps", o.state_reset_steps},
              {"values_lr_scale", o.values_lr_scale}};
}

double LearningRate(const TrainOptions& o, int64_t step) {
  if (step < o.warmup_steps) return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  const double span = static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine);
}

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

// torch::save to a temporary file, then rename over `path`: readers never see a
// partial file.
template <typename T>
absl::Status SaveTorchAtomic(const T& value, const std::string& path) {
  const std::string tmp = path + ".tmp";
  try {
    torch::save(value, tmp);
  } catch (const c10::Error& e) {
    return absl::DataLossError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::DataLossError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::Status Validate(const TrainOptions& o) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.steps < 1) return bad(absl::StrCat("--steps must be positive, got ", o.steps));
  if (o.batch_size < 1)
    return bad(absl::StrCat("--batch_size must be positive, got ", o.batch_size));
  if (o.seq_len < 1) return bad(absl::StrCat("--seq_len must be positive, got ", o.seq_len));
  if (!(o.lr > 0)) return bad(absl::StrCat("--lr must be positive, got ", o.lr));
  if (!(o.values_lr_scale > 0) || !std::isfinite(o.values_lr_scale)) {
    return bad(absl::StrCat("--values_lr_scale must be positive, got ", o.values_lr_scale));
  }
  if (o.warmup_steps < 1)
    return bad(absl::StrCat("--warmup_steps must be >= 1, got ", o.warmup_steps));
  if (!(o.train_fraction > 0 && o.train_fraction < 1)) {
    return bad(absl::StrCat("--train_fraction must be in (0, 1), got ", o.train_fraction));
  }
  if (o.state_reset_steps < 0) {
    return bad(absl::StrCat("--state_reset_steps must be >= 0, got ", o.state_reset_steps));
  }
  if (o.eval_interval < 1 || o.checkpoint_interval < 1) {
    return bad("--eval_interval and --checkpoint_interval must be positive");
  }
  if (o.out_dir.empty()) return bad("--out is required");
  return absl::OkStatus();
}

// Live progress on stderr: one rewritten line on a terminal, a line per report
// interval otherwise.
class ProgressLine {
 public:
  explicit ProgressLine(bool enabled) : enabled_(enabled), tty_(isatty(2) == 1) {}
  void Update(const TrainReport& r, int64_t total_steps, double eta_seconds, bool force) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::milliseconds(tty_ ? 250 : 30000)) return;
    last_ = now;
    std::string val = std::isnan(r.val_loss) ? "-" : absl::StrFormat("%.4f", r.val_loss);
    std::string line = absl::StrFormat(
        "step %d/%d | loss %.4f | val %s nats/byte | %.0f tok/s | elapsed %s | ETA %s", r.step,
        total_steps, r.train_loss, val, r.tokens_per_second, FormatDuration(r.wall_seconds),
        FormatDuration(eta_seconds));
    if (tty_) {
      std::fprintf(stderr, "\r%-110s", line.c_str());
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }
  void Message(const std::string& text) {
    if (!enabled_) return;
    std::fprintf(stderr, "%s%s\n", tty_ ? "\n" : "", text.c_str());
  }

 private:
  bool enabled_;
  bool tty_;
  Clock::time_point last_{};
};

}  // namespace

absl::StatusOr<double> ValidationLoss(const Model& model, const std::string& text) {
  if (text.size() < 2) return absl::InvalidArgumentError("validation text needs at least 2 bytes");
  auto logprobs = ScoreTokens(model, EncodeBytes(text));
  if (!logprobs.ok()) return logprobs.status();
  double sum = 0;
  for (double lp : *logprobs) sum -= lp;
  return sum / static_cast<double>(logprobs->size());
}

std::string ValidationSplit(const std::string& corpus, double train_fraction) {
  const size_t train_bytes = static_cast<size_t>(std::floor(corpus.size() * train_fraction));
  return corpus.substr(train_bytes);
}

absl::StatusOr<double> EvaluateCheckpoint(const std::string& dir, const std::string& text) {
  auto loaded = LoadCheckpoint(dir);
  if (!loaded.ok()) return loaded.status();
  return ValidationLoss(loaded->model, text);
}

absl::StatusOr<TrainReport> Train(const TrainOptions& options, int64_t stop_after_steps,
                                  const TrainProgressFn& on_step) {
  absl::Status s = Validate(options);
  if (!s.ok()) return s;
  if (options.threads > 0) at::set_num_threads(options.threads);

  auto corpus = ReadFile(options.text_path);
  if (!corpus.ok()) return corpus.status();
  const int64_t train_bytes =
      static_cast<int64_t>(std::floor(corpus->size() * options.train_fraction));
  const std::string validation = corpus->substr(static_cast<size_t>(train_bytes));
  if (train_bytes < options.seq_len + 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("training split has ", train_bytes, " bytes, fewer than --seq_len + 2"));
  }
  std::string eval_text = validation;
  if (options.eval_bytes > 0 && static_cast<size_t>(options.eval_bytes) < validation.size()) {
    eval_text = validation.substr(0, static_cast<size_t>(options.eval_bytes));
  }
  torch::Tensor data =
      torch::tensor(EncodeBytes(std::string_view(*corpus).substr(0, train_bytes)), torch::kInt64);

  // Start or resume.
  const std::string state_path = options.out_dir + "/" + kStateFile;
  const std::string optimizer_path = options.out_dir + "/" + kOptimizerFile;
  TrainReport report;
  report.val_loss = std::numeric_limits<double>::quiet_NaN();
  std::optional<Model> model;
  json saved_state;
  if (std::filesystem::exists(state_path)) {
    auto text = ReadFile(state_path);
    if (!text.ok()) return text.status();
    saved_state = json::parse(*text, nullptr, false);
    if (saved_state.is_discarded() || !saved_state.contains("identity")) {
      return absl::DataLossError(absl::StrCat(state_path, " is corrupt"));
    }
    const json identity = RunIdentity(options);
    const json defaults = RunIdentity(TrainOptions());
    for (const auto& item : identity.items()) {
      // A key missing from an older run's record means that run used the default.
      const json saved = saved_state["identity"].value(item.key(), defaults[item.key()]);
      if (saved != item.value()) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot resume ", options.out_dir, ": --", item.key(), "=",
                         item.value().dump(), " differs from the run's ", saved.dump(),
                         " (use a new --out directory, or the original options)"));
      }
    }
    auto loaded = LoadCheckpoint(options.out_dir);
    if (!loaded.ok()) return loaded.status();
    model.emplace(std::move(loaded->model));
    report.step = saved_state.value("step", int64_t{0});
    report.wall_seconds = saved_state.value("wall_seconds", 0.0);
    report.train_loss = saved_state.value("train_loss", 0.0);
    report.val_loss = saved_state.value("val_loss", std::numeric_limits<double>::quiet_NaN());
    report.resumed = true;
  } else {
    auto fresh = Model::InitRandom(options.config, options.seed);
    if (!fresh.ok()) return fresh.status();
    model.emplace(std::move(*fresh));
  }
  report.tokens_seen = report.step * options.batch_size * options.seq_len;
  model->SetRequiresGrad(true);

  // AdamW with two groups: matrices decay, everything else does not; a third for the
  // product-key memories' values (their own learning rate, no decay) when there are
  // any. Batch-norm running statistics are not trained by the optimizer.
  std::vector<torch::Tensor> decay, no_decay, memory_values;
  auto is_values = [](const std::string& name) {
    const std::string suffix = "ffn.values.weight";
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const auto& [name, t] : model->weights()) {
    if (IsBufferName(name)) continue;
    if (is_values(name)) {
      memory_values.push_back(t);
    } else {
      (t.dim() == 2 && name != "embed.weight" ? decay : no_decay).push_back(t);
    }
  }
  auto adam = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(options.lr)
            .betas({options.adam_beta1, options.adam_beta2})
            .weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, adam(options.weight_decay));
  groups.emplace_back(no_decay, adam(0.0));
  if (!memory_values.empty()) groups.emplace_back(memory_values, adam(0.0));
  torch::optim::AdamW optimizer(groups, torch::optim::AdamWOptions(options.lr));
  if (report.resumed) {
    try {
      torch::load(optimizer, optimizer_path);
    } catch (const c10::Error& e) {
      return absl::DataLossError(absl::StrCat("cannot read optimizer state ", optimizer_path));
    }
  }

  // Stateful training: the per-row state carried between steps (detached).
  State carried;
  const std::string stream_state_path = options.out_dir + "/" + kStreamStateFile;
  if (report.resumed && options.stateful) {
    try {
      torch::load(carried.tensors, stream_state_path);
    } catch (const c10::Error& e) {
      return absl::DataLossError(absl::StrCat("cannot read stream state ", stream_state_path));
    }
  }

  ProgressLine progress(options.progress);
  if (report.resumed) {
    progress.Message(
        absl::StrCat("resuming ", options.out_dir, " at step ", report.step, "/", options.steps));
  } else {
    progress.Message(absl::StrFormat("training %s: %d parameters, %d state bytes/session",
                                     ArchitectureName(options.config.architecture),
                                     model->parameter_count(), model->state_bytes_per_session()));
  }

  auto save = [&](int64_t step) -> absl::Status {
    absl::Status st = SaveCheckpoint(*model, options.out_dir);
    if (!st.ok()) return st;
    if (!(st = SaveTorchAtomic(optimizer, optimizer_path)).ok()) return st;
    if (options.stateful && !(st = SaveTorchAtomic(carried.tensors, stream_state_path)).ok()) {
      return st;
    }
    json state = {{"identity", RunIdentity(options)},    {"step", step},
                  {"wall_seconds", report.wall_seconds}, {"train_loss", report.train_loss},
                  {"tokens_seen", report.tokens_seen},   {"command_line", options.command_line}};
    if (!std::isnan(report.val_loss)) state["val_loss"] = report.val_loss;
    return WriteFileAtomic(state_path, state.dump(2) + "\n");
  };
  if (!report.resumed) {
    if (!(s = save(0)).ok()) return s;
  }

  std::vector<torch::Tensor> parameters;
  for (const auto& [name, t] : model->weights()) {
    if (!IsBufferName(name)) parameters.push_back(t);
  }
  const int64_t B = options.batch_size, T = options.seq_len;
  const int64_t max_start = train_bytes - T - 1;
  // Stateful layouts: row b starts at segment b. With state_reset_steps == 0 a pass
  // reads epoch_steps windows of T per segment (room is left for a shift < T).
  const int64_t segment = train_bytes / B;
  const int64_t epoch_steps = (segment - 1) / T - 1;
  if (options.stateful && options.state_reset_steps == 0 && epoch_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training split of ", train_bytes, " bytes is too small for --batch_size=", B,
        " streams of --seq_len=", T, " (need 2 windows per stream); use --stateful=false"));
  }
  const torch::Tensor window = torch::arange(T + 1, torch::kInt64);
  const auto session_start = Clock::now();
  const int64_t first_step = report.step;
  double interval_loss_sum = 0;
  int64_t interval_loss_count = 0;
  double wall_at_session_start = report.wall_seconds;

  while (report.step < options.steps) {
    const int64_t step = report.step;
    // Data order depends only on (seed, step, row): resumed runs see the same batches.
    std::vector<int64_t> starts(static_cast<size_t>(B));
    if (options.stateful && options.state_reset_steps > 0) {
      // Row b reads the split circularly from offset b * train_bytes / B; its state is
      // reset every state_reset_steps steps, staggered across rows so that at every
      // step the rows' context ages cover [0, state_reset_steps * T) evenly.
      const int64_t R = options.state_reset_steps;
      if (carried.tensors.empty()) carried = model->InitialState(B);
      std::vector<int64_t> reset_rows;
      for (int64_t b = 0; b < B; ++b) {
        starts[static_cast<size_t>(b)] = (b * segment + step * T) % (max_start + 1);
        if ((step + b * R / B) % R == 0) reset_rows.push_back(b);
      }
      if (!reset_rows.empty()) {
        carried.Scatter(torch::tensor(reset_rows, torch::kInt64),
                        model->InitialState(static_cast<int64_t>(reset_rows.size())));
      }
    } else if (options.stateful) {
      // Row b reads segment b front to back; each epoch starts at a new random shift
      // with fresh states.
      const int64_t epoch = step / epoch_steps, position = step % epoch_steps;
      const int64_t shift = static_cast<int64_t>(
          SplitMix64(options.seed ^ SplitMix64(static_cast<uint64_t>(epoch) + 1)) %
          static_cast<uint64_t>(T));
      for (int64_t b = 0; b < B; ++b)
        starts[static_cast<size_t>(b)] = b * segment + shift + position * T;
      if (position == 0 || carried.tensors.empty()) carried = model->InitialState(B);
    } else {
      for (int64_t b = 0; b < B; ++b) {
        const uint64_t h = SplitMix64(options.seed * 0x100000001b3ull ^
                                      SplitMix64(static_cast<uint64_t>(step) * 65537u + b));
        starts[static_cast<size_t>(b)] =
            static_cast<int64_t>(h % static_cast<uint64_t>(max_start + 1));
      }
    }
    torch::Tensor index = torch::tensor(starts, torch::kInt64).unsqueeze(1) + window;
    torch::Tensor batch = data.index({index});  // [B, T+1]
    torch::Tensor inputs = batch.narrow(1, 0, T), targets = batch.narrow(1, 1, T);

    const double lr = LearningRate(options, step);
    for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[g].options())
          .lr(g == 2 ? lr * options.values_lr_scale : lr);
    }
    double loss_value = 0, grad_norm = 0;
    try {
      auto t0 = Clock::now();
      State state = options.stateful ? carried : model->InitialState(B);
      torch::Tensor logits = model->ForwardUnchecked(inputs, &state, /*training=*/true);
      if (options.stateful) carried = state.Detach();
      torch::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({B * T, -1}),
                                                                targets.reshape({B * T}));
      auto t1 = Clock::now();
      optimizer.zero_grad();
      loss.backward();
      loss_value = loss.item<double>();
      auto t2 = Clock::now();
      report.forward_seconds += std::chrono::duration<double>(t1 - t0).count();
      report.backward_seconds += std::chrono::duration<double>(t2 - t1).count();
      if (std::isfinite(loss_value)) {
        grad_norm = torch::nn::utils::clip_grad_norm_(
            parameters,
            options.grad_clip > 0 ? options.grad_clip : std::numeric_limits<double>::infinity());
      }
      if (!std::isfinite(loss_value) || !std::isfinite(grad_norm)) {
        progress.Message("");
        // The norm is computed only from a finite loss.
        const std::string norm = std::isfinite(loss_value) ? absl::StrFormat("%g", grad_norm)
                                                           : std::string("not computed");
        return absl::FailedPreconditionError(absl::StrFormat(
            "training diverged at step %d: loss %g, gradient norm %s (lr %g). The last "
            "checkpoint in %s is intact; lower --lr or raise --warmup_steps and start a new run",
            step, loss_value, norm, lr, options.out_dir));
      }
      auto t3 = Clock::now();
      optimizer.step();
      report.optimizer_seconds += std::chrono::duration<double>(Clock::now() - t3).count();
    } catch (const c10::Error& e) {
      return absl::InternalError(
          absl::StrCat("training step ", step, " failed: ", e.what_without_backtrace()));
    }

    ++report.step;
    report.tokens_seen += B * T;
    interval_loss_sum += loss_value;
    ++interval_loss_count;
    report.train_loss = interval_loss_sum / interval_loss_count;
    const double session_seconds =
        std::chrono::duration<double>(Clock::now() - session_start).count();
    report.wall_seconds = wall_at_session_start + session_seconds;
    report.tokens_per_second =
        static_cast<double>((report.step - first_step) * B * T) / std::max(1e-9, session_seconds);

    const bool last = report.step == options.steps;
    if (report.step % options.eval_interval == 0 || last) {
      c10::NoGradGuard no_grad;
      auto eval_start = Clock::now();
      auto val = ValidationLoss(*model, last ? validation : eval_text);
      report.eval_seconds += std::chrono::duration<double>(Clock::now() - eval_start).count();
      if (!val.ok()) return val.status();
      report.val_loss = *val;
      interval_loss_sum = 0;
      interval_loss_count = 0;
      progress.Message(absl::StrFormat(
          "step %d: train %.4f, validation %.4f nats/byte (%.4f bits/byte)%s", report.step,
          report.train_loss, report.val_loss, report.val_loss / std::log(2.0),
          last || eval_text.size() == validation.size()
              ? ""
              : absl::StrCat(" on the first ", eval_text.size(), " bytes")));
    }
    const double per_step = session_seconds / static_cast<double>(report.step - first_step);
    progress.Update(report, options.steps,
                    per_step * static_cast<double>(options.steps - report.step), last);
    if (on_step) on_step(report);
    const bool stopping = stop_after_steps > 0 && report.step - first_step >= stop_after_steps;
    if (report.step % options.checkpoint_interval == 0 || last || stopping) {
      if (!(s = save(report.step)).ok()) return s;
    }
    if (stopping) break;
  }
  progress.Message("");
  return report;
}

}  // namespace fwmodel
