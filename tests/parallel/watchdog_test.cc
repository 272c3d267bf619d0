// The collective watchdog in one process, with test doubles for collectives
// that finish late or never: the waiting thread reports a passed deadline
// with the operation and the progress; the background thread reports for a
// waiter that is blocked and cannot; nothing is reported for a collective
// that finishes in time; the deadline is the step's inside a step and the
// start-up one outside. Also the test-only fault specs and the comparison of
// the start-up consistency check. on_expire is replaced, so nothing aborts.
#include "parallel/watchdog.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "parallel/communicator.h"
#include "parallel/consistency.h"
#include "parallel/fault_injection.h"
#include "parallel/progress.h"

namespace moefit::parallel {
namespace {

using ::testing::HasSubstr;

// A collective that completes `after` from its creation (never, if infinite).
// With `honour_timeout` false, Wait blocks until then whatever its timeout, as
// a thread stuck inside a blocking MPI call does.
class SlowWork final : public Work {
 public:
  SlowWork(std::string description, absl::Duration after, bool honour_timeout = true)
      : description_(std::move(description)),
        done_at_(absl::Now() + after),
        honour_timeout_(honour_timeout) {}
  bool IsCompleted() override { return absl::Now() >= done_at_; }
  std::string Description() const override { return description_; }

 protected:
  absl::Status DoWait(absl::Duration timeout) override {
    const absl::Time until = honour_timeout_ ? std::min(done_at_, absl::Now() + timeout) : done_at_;
    absl::SleepFor(until - absl::Now());
    return IsCompleted() ? absl::OkStatus()
                         : absl::DeadlineExceededError(absl::StrCat(description_, " timed out"));
  }

 private:
  const std::string description_;
  const absl::Time done_at_;
  const bool honour_timeout_;
};

struct Report {
  std::string message;
  std::thread::id thread;
  absl::Duration after;  // since the test's start
};

// Configures the watchdog with short deadlines and records what it reports.
class WatchdogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    start_ = absl::Now();
    WatchdogOptions options;
    options.timeout = absl::Milliseconds(300);
    options.startup_timeout = absl::Seconds(5);
    options.grace = absl::Milliseconds(300);
    options.on_expire = [this](const std::string& message) {
      absl::MutexLock lock(&mu_);
      reports_.push_back({message, std::this_thread::get_id(), absl::Now() - start_});
    };
    ConfigureWatchdog(std::move(options));
  }
  void TearDown() override { ConfigureWatchdog({}); }

  std::vector<Report> Reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }

  absl::Time start_;
  absl::Mutex mu_;
  std::vector<Report> reports_ ABSL_GUARDED_BY(mu_);
};

TEST_F(WatchdogTest, StepDeadlineInsideAStepStartupDeadlineOutside) {
  EXPECT_EQ(CollectiveTimeout(), absl::Seconds(5));
  {
    const ScopedStep step(1);
    EXPECT_EQ(CollectiveTimeout(), absl::Milliseconds(300));
  }
  EXPECT_EQ(CollectiveTimeout(), absl::Seconds(5));
}

// Where the ranks agree to stop or save after a step, a rank that finished
// early waits for the others: the step's deadline, and a report that says so.
TEST_F(WatchdogTest, StepEndHasTheStepDeadline) {
  {
    const ScopedStepEnd step_end(7);
    EXPECT_TRUE(InTrainingStep());
    EXPECT_EQ(CollectiveTimeout(), absl::Milliseconds(300));
    SlowWork never("AllReduce(max) on 'world'", absl::InfiniteDuration());
    EXPECT_THROW(never.WaitOrThrow(), c10::Error);
  }
  EXPECT_FALSE(InTrainingStep());
  EXPECT_EQ(CollectiveTimeout(), absl::Seconds(5));
  EXPECT_EQ(CurrentPhase(), nullptr);
  const std::vector<Report> reports = Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_LT(reports[0].after, absl::Milliseconds(300) + absl::Milliseconds(250));
  EXPECT_THAT(reports[0].message,
              HasSubstr("AllReduce(max) on 'world' did not finish within 300ms "
                        "(parallel.timeout_s); in training step 7, end of step (agreeing whether "
                        "to stop or save)"));
}

TEST_F(WatchdogTest, WaiterReportsAPassedDeadlineWithTheOperationAndTheProgress) {
  const ScopedStep step(3);
  SlowWork("AllReduce(sum) on 'world'", absl::ZeroDuration()).WaitOrThrow();
  const ScopedLayer layer(1);
  const ScopedPhase phase("dispatch");
  SlowWork never("AllToAllV on 'ep' (1.0 KiB out, 2.0 KiB in)", absl::InfiniteDuration());
  EXPECT_THROW(never.WaitOrThrow(), c10::Error);
  const std::vector<Report> reports = Reports();
  ASSERT_EQ(reports.size(), 1u);
  const Report& report = reports[0];
  EXPECT_EQ(report.thread, std::this_thread::get_id());
  EXPECT_GE(report.after, absl::Milliseconds(300));
  EXPECT_LT(report.after, absl::Milliseconds(300) + absl::Milliseconds(250));
  EXPECT_THAT(report.message,
              HasSubstr("collective watchdog: AllToAllV on 'ep' (1.0 KiB out, 2.0 KiB in) did not "
                        "finish within 300ms (parallel.timeout_s); in training step 3, layer 1, "
                        "dispatch; last completed collective: AllReduce(sum) on 'world' ("));
}

TEST_F(WatchdogTest, BackgroundThreadReportsForABlockedWaiter) {
  const ScopedStep step(2);
  const ScopedPhase phase("combine", /*backward=*/true);
  // Blocked for 1.5 s although its deadline is 300 ms: the background thread
  // reports after the deadline and the grace (0.6 s, + at most 0.1 s poll).
  SlowWork stuck("AllToAllV on 'ep'", absl::Milliseconds(1500), /*honour_timeout=*/false);
  stuck.WaitOrThrow();  // in the end it did complete: no throw
  const std::vector<Report> reports = Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_NE(reports[0].thread, std::this_thread::get_id());
  EXPECT_GE(reports[0].after, absl::Milliseconds(600));
  EXPECT_LT(reports[0].after, absl::Milliseconds(1000));
  EXPECT_THAT(reports[0].message, HasSubstr("AllToAllV on 'ep' did not finish within 300ms"));
  EXPECT_THAT(reports[0].message, HasSubstr("in training step 2, combine (backward)"));
  EXPECT_THAT(reports[0].message, HasSubstr("reported by the watchdog thread"));
}

TEST_F(WatchdogTest, BlockingCallScopeIsWatchedToo) {
  {
    WatchdogScope watch("MPI_Comm_split of 'world'", absl::Milliseconds(100));
    absl::SleepFor(absl::Milliseconds(800));  // deadline + grace = 400 ms
  }
  const std::vector<Report> reports = Reports();
  ASSERT_EQ(reports.size(), 1u);
  // Outside a step (before the first, or between steps when other tests ran
  // before this one): the start-up deadline's setting is the one named.
  EXPECT_THAT(reports[0].message, HasSubstr("MPI_Comm_split of 'world' did not finish within 100ms "
                                            "(parallel.startup_timeout_s); "));
}

TEST_F(WatchdogTest, NothingReportedForACollectiveThatFinishesInTime) {
  const ScopedStep step(1);
  SlowWork late_but_in_time("Barrier on 'world'", absl::Milliseconds(200));
  late_but_in_time.WaitOrThrow();
  absl::SleepFor(absl::Milliseconds(800));  // past where a leftover arming would fire
  EXPECT_TRUE(Reports().empty());
}

TEST(FaultSpecTest, ParsesEachKindWithKeysInAnyOrder) {
  absl::StatusOr<FaultSpec> stall = ParseFaultSpec("stall:rank=1:step=3");
  ASSERT_TRUE(stall.ok()) << stall.status();
  EXPECT_EQ(stall->kind, FaultSpec::Kind::kStall);
  EXPECT_EQ(stall->rank, 1);
  EXPECT_EQ(stall->step, 3);
  absl::StatusOr<FaultSpec> crash = ParseFaultSpec("crash:step=2:rank=0");
  ASSERT_TRUE(crash.ok()) << crash.status();
  EXPECT_EQ(crash->kind, FaultSpec::Kind::kCrash);
  EXPECT_EQ(crash->rank, 0);
  EXPECT_EQ(crash->step, 2);
  absl::StatusOr<FaultSpec> slow = ParseFaultSpec("slow:ms=2000:rank=3");
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_EQ(slow->kind, FaultSpec::Kind::kSlow);
  EXPECT_EQ(slow->rank, 3);
  EXPECT_EQ(slow->ms, 2000);
  EXPECT_EQ(slow->step, 0);    // every step
  EXPECT_EQ(slow->layer, -1);  // at the start of the step
  absl::StatusOr<FaultSpec> in_layer = ParseFaultSpec("stall:rank=1:step=3:layer=2");
  ASSERT_TRUE(in_layer.ok()) << in_layer.status();
  EXPECT_EQ(in_layer->layer, 2);
  EXPECT_FALSE(in_layer->in_save);
  absl::StatusOr<FaultSpec> in_save = ParseFaultSpec("slow:at=save:rank=1:ms=3000:step=4");
  ASSERT_TRUE(in_save.ok()) << in_save.status();
  EXPECT_TRUE(in_save->in_save);
  EXPECT_EQ(in_save->step, 4);
  EXPECT_EQ(in_save->layer, -1);
}

// A fault given at=save acts in the save after its step, and nowhere else.
TEST(FaultSpecTest, ASaveFaultActsOnlyInTheSaveAfterItsStep) {
  ASSERT_EQ(setenv("MOEFIT_FAULT", "slow:rank=0:ms=300:step=2:at=save", 1), 0);
  ASSERT_TRUE(InstallFaultFromEnvironment(0).ok());
  const auto took = [](const std::function<void()>& fn) {
    const absl::Time start = absl::Now();
    fn();
    return absl::Now() - start;
  };
  EXPECT_LT(took([] { MaybeInjectFault(2); }), absl::Milliseconds(300));
  EXPECT_LT(took([] { MaybeInjectFaultInSave(1); }), absl::Milliseconds(300));
  EXPECT_GE(took([] { MaybeInjectFaultInSave(2); }), absl::Milliseconds(300));
  ASSERT_EQ(unsetenv("MOEFIT_FAULT"), 0);
  ASSERT_TRUE(InstallFaultFromEnvironment(0).ok());
  EXPECT_LT(took([] { MaybeInjectFaultInSave(2); }), absl::Milliseconds(300));
}

TEST(FaultSpecTest, RejectsEverySpecThatDoesNotParse) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "unknown kind ''"},
      {"hang:rank=1:step=3", "unknown kind 'hang'"},
      {"stall:rank=1", "step is missing"},
      {"stall:step=3", "rank is missing"},
      {"slow:rank=1", "ms is missing"},
      {"stall:rank=x:step=3", "rank = 'x' is not an integer"},
      {"stall:rank=1:step=3:rank=2", "'rank' given twice"},
      {"stall:rank=1:step=3:ms=5", "unknown key 'ms' for stall"},
      {"stall:rank=1:step=0", "step must be >= 1"},
      {"stall:rank=1:step", "'step' is not key=value"},
      {"crash:rank=1:step=2:layer=-1", "layer must be >= 0"},
      {"slow:rank=1:ms=5:at=load", "at = 'load': only 'save'"},
      {"slow:rank=1:ms=5:at=save:layer=1", "layer and at=save exclude each other"},
  };
  for (const auto& [spec, why] : cases) {
    absl::StatusOr<FaultSpec> fault = ParseFaultSpec(spec);
    ASSERT_FALSE(fault.ok()) << spec;
    EXPECT_EQ(fault.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(fault.status().message(),
                HasSubstr(absl::StrCat("fault spec '", spec, "': ", why)));
  }
}

TEST(ConsistencyTest, FindsTheLowestRankAndFirstFactThatDiffer) {
  EXPECT_FALSE(FindMismatch({{"a", "b"}, {"a", "b"}, {"a", "b"}}).has_value());
  const std::optional<FactMismatch> mismatch =
      FindMismatch({{"a", "b"}, {"a", "b"}, {"a", "c"}, {"x", "c"}});
  ASSERT_TRUE(mismatch.has_value());
  EXPECT_EQ(mismatch->rank, 2);
  EXPECT_EQ(mismatch->fact_idx, 1);
}

TEST(ConsistencyTest, NamesTheFirstLineThatDiffers) {
  EXPECT_EQ(FirstDifference("a: 1\nb: 2\nc: 3", "a: 1\nb: 5\nc: 3", 4),
            "rank 0 has 'b: 2', rank 4 has 'b: 5'");
  EXPECT_EQ(FirstDifference("a: 1", "a: 1\nz: 9", 1), "rank 0 has nothing more, rank 1 has 'z: 9'");
}

}  // namespace
}  // namespace moefit::parallel
