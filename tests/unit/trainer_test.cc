#include "models/training/trainer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "models/base/file_util.h"
#include "models/checkpoints/checkpoint.h"
#include "tests/unit/test_models.h"

namespace {

namespace fs = std::filesystem;

std::string Corpus() {
  auto text =
      fwmodel::ReadFile(std::string(FWSERVE_SOURCE_DIR) + "/models/data/tinyshakespeare.txt");
  EXPECT_TRUE(text.ok());
  return text.ok() ? *text : "";
}

class TrainerTest : public testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            absl::StrCat("fwserve_train_", getpid(), "_",
                         testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    // A small text: the first 30 kB of the corpus.
    text_path_ = (root_ / "text.txt").string();
    ASSERT_TRUE(fwmodel::WriteFileAtomic(text_path_, Corpus().substr(0, 30000)).ok());
  }
  void TearDown() override { fs::remove_all(root_); }

  fwmodel::TrainOptions TinyRun(const std::string& name) {
    fwmodel::TrainOptions o;
    o.text_path = text_path_;
    o.out_dir = (root_ / name).string();
    o.config =
        fwtest::TinyConfig(fwmodel::Architecture::kFastWeight, fwmodel::FfnKind::kSquaredRelu, 3);
    o.steps = 40;
    o.batch_size = 8;
    o.seq_len = 32;
    o.lr = 3e-3;
    o.warmup_steps = 5;
    o.eval_interval = 20;
    o.eval_bytes = 1000;
    o.checkpoint_interval = 10;
    o.progress = false;
    o.threads = 1;
    return o;
  }
  fs::path root_;
  std::string text_path_;
};

TEST_F(TrainerTest, TinyRunLowersValidationLoss) {
  fwmodel::TrainOptions o = TinyRun("run");
  o.steps = 100;
  o.lr = 1e-2;
  const std::string validation = fwmodel::ValidationSplit(Corpus().substr(0, 30000));
  auto model = fwmodel::Model::InitRandom(o.config, o.seed);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(fwmodel::SaveCheckpoint(*model, (root_ / "init").string()).ok());
  auto before = fwmodel::EvaluateCheckpoint((root_ / "init").string(), validation);
  ASSERT_TRUE(before.ok());
  auto report = fwmodel::Train(o);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->step, 100);
  EXPECT_EQ(report->tokens_seen, 100 * 8 * 32);
  auto after = fwmodel::EvaluateCheckpoint(o.out_dir, validation);
  ASSERT_TRUE(after.ok());
  EXPECT_NEAR(*after, report->val_loss, 1e-9);  // the report is the full validation
  // ln(256) = 5.55 at random init. The text's byte (unigram) entropy is about
  // 3.3 nats; beating it shows the model learned to use context.
  EXPECT_GT(*before, 5.0);
  EXPECT_LT(*after, 3.2) << "before " << *before << " after " << *after;
}

// (state_reset_steps, with a product-key memory).
class ResumeTest : public TrainerTest,
                   public testing::WithParamInterface<std::tuple<int64_t, bool>> {
 protected:
  fwmodel::TrainOptions ResumeRun(const std::string& name) {
    fwmodel::TrainOptions o = TinyRun(name);
    o.steps = 24;
    o.state_reset_steps = std::get<0>(GetParam());
    if (std::get<1>(GetParam())) {
      // The memory's batch norm statistics and the values' own learning rate must
      // survive the interruption too.
      o.config = fwtest::WithPkm(o.config);
      o.values_lr_scale = 4.0;
    }
    return o;
  }
};

TEST_P(ResumeTest, ResumedRunMatchesUninterruptedRun) {
  fwmodel::TrainOptions straight = ResumeRun("straight");
  ASSERT_TRUE(fwmodel::Train(straight).ok());

  fwmodel::TrainOptions interrupted = ResumeRun("interrupted");
  auto first = fwmodel::Train(interrupted, /*stop_after_steps=*/13);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->step, 13);
  EXPECT_FALSE(first->resumed);
  auto second = fwmodel::Train(interrupted);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->resumed);
  EXPECT_EQ(second->step, 24);

  auto a = fwmodel::LoadCheckpoint(straight.out_dir);
  auto b = fwmodel::LoadCheckpoint(interrupted.out_dir);
  ASSERT_TRUE(a.ok() && b.ok());
  double max_diff = 0;
  for (const auto& [name, t] : a->model.weights()) {
    max_diff = std::max(max_diff, fwtest::MaxAbsDiff(t, b->model.weights().at(name)));
  }
  EXPECT_LE(max_diff, 1e-6);
  // Identical data order and optimizer state make the runs bit-identical.
  EXPECT_EQ(a->fingerprint, b->fingerprint);
  if (std::get<1>(GetParam())) {
    // Training moved the running statistics away from their initial 0 and 1.
    const auto& w = a->model.weights();
    EXPECT_GT(w.at("blocks.1.ffn.query_norm.running_mean").abs().max().item<double>(), 1e-3);
    EXPECT_GT((w.at("blocks.1.ffn.query_norm.running_var") - 1).abs().max().item<double>(), 1e-3);
  }
}

// 0: per-segment streams reset every pass; 5: circular streams with staggered resets
// (a reset lands inside both halves of the interrupted run).
INSTANTIATE_TEST_SUITE_P(DataLayouts, ResumeTest,
                         testing::Combine(testing::Values(0, 5), testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat("reset", std::get<0>(info.param),
                                               std::get<1>(info.param) ? "_pkm" : "");
                         });

// The values' learning rate is part of the run: the values of a run with a higher
// one move further from their initialisation, and resuming with another is refused.
TEST_F(TrainerTest, ValuesLearningRateScaleAppliesToTheMemoryValues) {
  auto values_change = [&](double scale, const std::string& name) {
    fwmodel::TrainOptions o = TinyRun(name);
    o.config = fwtest::WithPkm(o.config);
    o.steps = 6;
    o.values_lr_scale = scale;
    auto init = fwmodel::Model::InitRandom(o.config, o.seed);
    EXPECT_TRUE(fwmodel::Train(o).ok());
    auto trained = fwmodel::LoadCheckpoint(o.out_dir);
    EXPECT_TRUE(trained.ok());
    auto delta = [&](const std::string& t) {
      return fwtest::MaxAbsDiff(trained->model.weights().at(t), init->weights().at(t));
    };
    return std::make_pair(delta("blocks.1.ffn.values.weight"), delta("blocks.1.ffn.query.weight"));
  };
  auto [values1, query1] = values_change(1.0, "scale1");
  auto [values10, query10] = values_change(10.0, "scale10");
  EXPECT_GT(values10, 3 * values1);
  EXPECT_LT(query10, 3 * query1);

  fwmodel::TrainOptions o = TinyRun("scale10");
  o.config = fwtest::WithPkm(o.config);
  o.steps = 6;
  o.values_lr_scale = 2.0;
  auto resumed = fwmodel::Train(o);
  ASSERT_FALSE(resumed.ok());
  EXPECT_NE(resumed.status().message().find("values_lr_scale"), std::string::npos)
      << resumed.status();
}

TEST_F(TrainerTest, ResumeWithDifferentOptionsIsRefused) {
  fwmodel::TrainOptions o = TinyRun("run");
  ASSERT_TRUE(fwmodel::Train(o, 2).ok());
  o.batch_size = 4;
  auto resumed = fwmodel::Train(o);
  ASSERT_FALSE(resumed.ok());
  EXPECT_EQ(resumed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(resumed.status().message().find("batch_size"), std::string::npos) << resumed.status();
}

TEST_F(TrainerTest, DivergenceStopsWithAClearError) {
  fwmodel::TrainOptions o = TinyRun("diverge");
  o.lr = 1e12;
  o.warmup_steps = 1;
  o.grad_clip = 0;
  auto report = fwmodel::Train(o);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(report.status().message().find("diverged"), std::string::npos) << report.status();
  // The last checkpoint is still loadable.
  EXPECT_TRUE(fwmodel::LoadCheckpoint(o.out_dir).ok());
}

TEST_F(TrainerTest, BadOptionsNameTheFlag) {
  fwmodel::TrainOptions o = TinyRun("bad");
  o.seq_len = 0;
  auto report = fwmodel::Train(o);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("--seq_len"), std::string::npos);
}

}  // namespace
