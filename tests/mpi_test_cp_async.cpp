// tests/mpi_test_cp_async.cpp — the asynchronous step and failure handling of
// the MPI communicator (docs/design.md §10): a steady-state layer call makes
// no blocking wait, the validation policies, ranks out of step (a rank whose
// record changed alone, a rank in another entry) end in gdncp::Error on every
// rank. (Lost and stopped ranks: tests/mpi_test_cp_watchdog.cpp.)
// Tests that break a communicator make a fresh one (an aborted one stays so).
// gdncp-mpi-np: 2 3
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "mpi_async_fixtures.h"

namespace gdncp {
namespace test {
namespace {

TEST(MpiCommAsync, SteadyStateLayerCallMakesNoBlockingWait) {
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  ASSERT_EQ(c->validation(), cp::Validation::on_change) << "on_change is the default";
  const std::vector<double> first = layer_step(*c, 3);
  EXPECT_EQ(c->stats().validations, 1) << "the first call validates";
  c->reset_stats();
  const std::vector<double> again = layer_step(*c, 3);
  const cp::Communicator::Stats s = c->stats();
  EXPECT_EQ(s.host_waits, 0) << "a steady-state call waited beyond the point of use";
  EXPECT_EQ(s.validations, 0);
  EXPECT_EQ(s.calls, nranks() > 1 ? 2 : 0) << "one all-gather in forward, one in backward";
  EXPECT_EQ(first, again) << "the same inputs give the same bits";
  // A host exchange is a blocking wait, and is counted as one.
  int64_t mine = rank(), all[8] = {0};
  c->all_gather_host(all, &mine, sizeof mine);
  EXPECT_EQ(c->stats().host_waits, 1);
  for (int r = 0; r < nranks(); ++r) EXPECT_EQ(all[r], r);
}

TEST(MpiCommAsync, ValidationPolicies) {
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_validation(cp::Validation::every_call);
  layer_step(*c, 2);
  layer_step(*c, 2);
  EXPECT_EQ(c->stats().validations, 2) << "every_call validates every call";

  c->reset_stats();
  c->set_validation(cp::Validation::on_change);
  layer_step(*c, 2);  // the record every_call validated last: nothing new
  EXPECT_EQ(c->stats().validations, 0);
  layer_step(*c, 3);  // every rank changes F together: F is not validated (any rank may change it)
  layer_step(*c, 3);
  EXPECT_EQ(c->stats().validations, 0) << "on_change does not validate a change of F";
  layer_step(*c, 3, 77, true, 3);  // S changes on every rank: validated once
  layer_step(*c, 3, 77, true, 3);
  EXPECT_EQ(c->stats().validations, 1) << "on_change validates a changed record once";

  // off exchanges nothing, a changed record included (the scan needs no other rank's F).
  c->reset_stats();
  c->set_validation(cp::Validation::off);
  layer_step(*c, 4);
  layer_step(*c, 4, 77, true, 3);
  EXPECT_EQ(c->stats().validations, 0) << "off never exchanges";
  EXPECT_EQ(c->stats().host_waits, 0);

  // A shape that must agree (S) and differs between ranks from the start is named under every_call and on_change.
  for (cp::Validation v : {cp::Validation::every_call, cp::Validation::on_change}) {
    if (nranks() == 1) break;
    auto fresh = cp::make_mpi_communicator(MPI_COMM_WORLD);
    fresh->set_validation(v);
    fresh->set_timeout_seconds(10);
    expect_all_throw([&] { layer_step(*fresh, 2, 77, true, rank() == 1 ? 3 : 2); }, "S differs");
    EXPECT_FALSE(fresh->aborted()) << "a validation error leaves the communicator usable";
    layer_step(*fresh, 2);  // and the next agreeing call is validated afresh and runs
  }
  EXPECT_THROW(c->set_timeout_seconds(-1), Error);
  EXPECT_THROW(c->set_timeout_seconds(std::nan("")), Error);
}

// on_change: rank 1 changes a size that must agree (S) alone, so it
// validates while the others go on to their data all-gather: every rank
// raises at once, out of step, and the communicator stays usable (the next
// agreeing call validates afresh on every rank and runs).
TEST(MpiCommAsync, RankChangingShapeAloneFailsOnEveryRank) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(5);
  const std::vector<double> ref = layer_step(*c, 2);
  expect_error_in_time([&] { layer_step(*c, 2, 77, true, rank() == 1 ? 3 : 2); }, {"out of step"}, 1);
  EXPECT_FALSE(c->aborted()) << c->abort_reason();
  c->reset_stats();
  EXPECT_EQ(layer_step(*c, 2), ref) << "rank " << rank();
  EXPECT_EQ(c->stats().validations, 1) << "the call after the error validates afresh";
}

// on_change: a bad argument on one rank in steady state. That rank names its
// argument; the others, already in their data all-gather, say the ranks are
// out of step. At once, not at the deadline.
TEST(MpiCommAsync, BadArgumentOnOneRankInSteadyState) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(5);
  layer_step(*c, 2);
  const LayerInputs l = local_block(make_layer_inputs(dims(1, 2, 4, 2 * nranks(), 2), DType::f64, 77), 2, rank());
  const Tensor beta = rank() == 1 ? Tensor::zeros({3}, DType::f64) : l.beta;
  expect_error_in_time(
      [&] { cp::bigdn_cp(*c, l.qkv, beta, l.decay, l.q_norm_w, l.k_norm_w, l.rope_cos, l.rope_sin, 2, 2, l.opt); },
      {rank() == 1 ? "beta" : "out of step"}, 5);
  MPI_Barrier(MPI_COMM_WORLD);
}

// One rank in bigdn_cp while the others are in all_reduce_grads (a
// steady state that validates nothing): a gdncp::Error on every rank, never
// MPI's fatal MPI_ERR_TRUNCATE.
TEST(MpiCommAsync, RanksInDifferentEntriesRaiseNotAbort) {
  if (nranks() == 1) GTEST_SKIP() << "needs two ranks";
  auto c = cp::make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout_seconds(5);
  Tensor w = Tensor::randn({40}, DType::f32, Device::cpu, 5);
  w.requires_grad_(true);
  auto grads_step = [&] {
    backward(w, Tensor::full({40}, 1.0 + rank(), DType::f32));
    cp::all_reduce_grads(*c, {w});
  };
  layer_step(*c, 2);
  grads_step();
  expect_error_in_time([&] { rank() == 0 ? (void)layer_step(*c, 2) : grads_step(); }, {"out of step"}, 5 + 5);
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace test
}  // namespace gdncp

int main(int argc, char** argv) { return gdncp::test::run_mpi_tests(argc, argv); }
