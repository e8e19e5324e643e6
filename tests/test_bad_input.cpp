// Bad input to the single-rank layer (docs/design.md §9): every case must throw
// gdncp::Error whose message names the wrong argument ("bigdn: <arg>: why"),
// before any work is done (nothing recorded, nothing saved).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "bigdn_fixtures.h"
#include "cp/comm/collective_header.h"
#include "gdncp/nn.h"
#include "gdncp/optim.h"
#include "kernels/common/clip_guard.h"
#include "util/test_util.h"

namespace gdncp {
namespace test {
namespace {

const Dims kDims = dims(2, 2, 8, 3, 4);  // N = 12, C = 16

LayerInputs good(DType dtype = DType::f32) {
  LayerInputs in = make_layer_inputs(kDims, dtype, 4242);
  require_grads(in);
  return in;
}

constexpr int64_t kKeep = std::numeric_limits<int64_t>::min();  // "use the inputs' F or S"

// Calls bigdn (or bigdn_unfused) on in with F, S; expects gdncp::Error naming arg
// and, when given, containing why. Also checks that nothing was recorded or saved.
void expect_bad(const LayerInputs& in, const std::string& arg, const std::string& why = "", int64_t F = kKeep,
                int64_t S = kKeep, bool fused = true) {
  const int64_t f = F == kKeep ? in.d.F : F, s = S == kKeep ? in.d.S : S;
  const std::string entry = fused ? "bigdn" : "bigdn_unfused";
  const size_t tape_before = autograd::tape_size(), saved_before = autograd::saved_bytes();
  try {
    if (fused)
      bigdn(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, f, s, in.opt);
    else
      bigdn_unfused(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, f, s, in.opt);
    ADD_FAILURE() << "no error for bad " << arg;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(entry + ": " + arg + ":"), std::string::npos) << "message does not name " << arg << ": " << msg;
    if (!why.empty()) {
      EXPECT_NE(msg.find(why), std::string::npos) << "message does not say '" << why << "': " << msg;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "bad " << arg << " threw a non-gdncp exception: " << e.what();
  }
  EXPECT_EQ(autograd::tape_size(), tape_before) << "work was recorded before the error";
  EXPECT_EQ(autograd::saved_bytes(), saved_before);
}

// expect_bad on the good inputs with one of their tensors replaced by t.
void expect_bad_with(Tensor LayerInputs::*field, const Tensor& t, const std::string& arg, const std::string& why) {
  LayerInputs in = good();
  in.*field = t;
  expect_bad(in, arg, why);
}

// expect_bad on the good inputs with one of their scalar options set to v.
void expect_bad_option(double BigdnOptions::*field, double v, const std::string& arg, const std::string& why,
                       bool fused = true) {
  LayerInputs in = good();
  in.opt.*field = v;
  expect_bad(in, arg, why, kKeep, kKeep, fused);
}

Tensor f32(const Shape& s) { return Tensor::uniform(s, DType::f32, Device::cpu, 9, 0.5, 1.5); }

// An Error names the file relative to the source root ("src/...:line: ..."),
// never the build machine's checkout.
TEST(BadInput, ErrorPathIsRelativeToSourceRoot) {
  LayerInputs in = good();
  try {
    bigdn(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, 0, in.d.S, in.opt);
    ADD_FAILURE() << "no error for F = 0";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find(GDNCP_TEST_SOURCE_DIR), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("src/", 0), 0u) << "message does not start with a path under src/: " << msg;
  }
  autograd::clear_tape();
}

TEST(BadInput, GoodInputRuns) {
  const LayerInputs in = good();
  EXPECT_NO_THROW(in.run());
  autograd::clear_tape();
}

// --- sizes -----------------------------------------------------------------------------------------

TEST(BadInput, FramesNotPositive) { expect_bad(good(), "F", "> 0", 0); }
TEST(BadInput, TokensPerFrameNegative) { expect_bad(good(), "S", "> 0", 3, -1); }
TEST(BadInput, TokensNotFramesTimesS) { expect_bad(good(), "qkv", "F·S", 2, 4); }

TEST(BadInput, QkvWrongRank) {
  LayerInputs in = good();
  in.qkv = in.qkv.detach().reshape({2, 12, 3, 16});
  expect_bad(in, "qkv", "5 dims");
}

TEST(BadInput, QkvDim2Not3) {
  expect_bad_with(&LayerInputs::qkv, Tensor::randn({2, 12, 2, 2, 8}, DType::f32, Device::cpu, 1), "qkv", "dim 2");
}

TEST(BadInput, HeadDimOdd) {
  expect_bad_with(&LayerInputs::qkv, Tensor::randn({2, 12, 3, 2, 7}, DType::f32, Device::cpu, 1), "qkv", "even");
}

TEST(BadInput, HeadDimTooLarge) {
  expect_bad_with(&LayerInputs::qkv, Tensor::randn({1, 12, 3, 1, kMaxHeadDim + 2}, DType::f32, Device::cpu, 1), "qkv",
                  "2..128");
}

TEST(BadInput, BatchZero) {
  expect_bad_with(&LayerInputs::qkv, Tensor::empty({0, 12, 3, 2, 8}, DType::f32), "qkv", "B");
}

TEST(BadInput, HeadsZero) {
  expect_bad_with(&LayerInputs::qkv, Tensor::empty({2, 12, 3, 0, 8}, DType::f32), "qkv", "H");
}

TEST(BadInput, QkvUndefined) { expect_bad_with(&LayerInputs::qkv, Tensor(), "qkv", "undefined"); }

TEST(BadInput, BetaWrongShape) { expect_bad_with(&LayerInputs::beta, f32({2, 2, 3}), "beta", "(B, H, F, S)"); }

TEST(BadInput, BetaSwappedFS) { expect_bad_with(&LayerInputs::beta, f32({2, 2, 4, 3}), "beta", "[2, 2, 3, 4]"); }

TEST(BadInput, BetaUndefined) { expect_bad_with(&LayerInputs::beta, Tensor(), "beta", "undefined"); }

TEST(BadInput, DecayWrongFrames) { expect_bad_with(&LayerInputs::decay, f32({2, 2, 4}), "decay", "(B, H, F)"); }

TEST(BadInput, DecayPerToken) { expect_bad_with(&LayerInputs::decay, f32({2, 2, 3, 4}), "decay", "3 dims"); }

TEST(BadInput, QNormWeightWrongLength) { expect_bad_with(&LayerInputs::q_norm_w, f32({17}), "q_norm_w", "C = H·D"); }

TEST(BadInput, KNormWeightPerHead) { expect_bad_with(&LayerInputs::k_norm_w, f32({2, 8}), "k_norm_w", "1 dims"); }

TEST(BadInput, RopeMissingRows) { expect_bad_with(&LayerInputs::rope_cos, f32({11, 8}), "rope_cos", "(N, D)"); }

TEST(BadInput, RopeWrongHeadDim) { expect_bad_with(&LayerInputs::rope_sin, f32({12, 4}), "rope_sin", "(N, D)"); }

TEST(BadInput, RopeUndefined) { expect_bad_with(&LayerInputs::rope_cos, Tensor(), "rope_cos", "undefined"); }

// --- dtypes ----------------------------------------------------------------------------------------

TEST(BadInput, NormWeightBf16) {
  LayerInputs in = good();
  in.q_norm_w = in.q_norm_w.detach().to(DType::bf16);
  expect_bad(in, "q_norm_w", "must be f32");
}

TEST(BadInput, RopeF64WithF32Qkv) {
  LayerInputs in = good();
  in.rope_sin = in.rope_sin.to(DType::f64);
  expect_bad(in, "rope_sin", "must be f32");
}

TEST(BadInput, BetaF64WithF32Qkv) {
  LayerInputs in = good();
  in.beta = in.beta.detach().to(DType::f64);
  expect_bad(in, "beta", "f64");
}

TEST(BadInput, DecayF32WithF64Qkv) {
  LayerInputs in = good(DType::f64);
  in.decay = in.decay.detach().to(DType::f32);
  expect_bad(in, "decay", "f64");
}

TEST(BadInput, NormWeightF32WithF64Qkv) {
  LayerInputs in = good(DType::f64);
  in.k_norm_w = in.k_norm_w.detach().to(DType::f32);
  expect_bad(in, "k_norm_w", "must be f64");
}

// --- scalars ---------------------------------------------------------------------------------------

TEST(BadInput, KScaleNotFinite) {
  expect_bad_option(&BigdnOptions::k_scale, std::numeric_limits<double>::quiet_NaN(), "k_scale", "finite");
}

TEST(BadInput, EpsZero) { expect_bad_option(&BigdnOptions::eps, 0, "eps", "> 0"); }

TEST(BadInput, EpsNaN) {
  expect_bad_option(&BigdnOptions::eps, std::numeric_limits<double>::quiet_NaN(), "eps", "finite");
}

TEST(BadInput, NormEpsZero) { expect_bad_option(&BigdnOptions::norm_eps, 0, "norm_eps", "> 0"); }

TEST(BadInput, NormEpsNegative) { expect_bad_option(&BigdnOptions::norm_eps, -1e-5, "norm_eps", "> 0"); }

TEST(BadInput, KScaleInfinite) {
  expect_bad_option(&BigdnOptions::k_scale, -std::numeric_limits<double>::infinity(), "k_scale", "finite");
}

TEST(BadInput, EpsNegative) { expect_bad_option(&BigdnOptions::eps, -1e-6, "eps", "> 0"); }

TEST(BadInput, NormEpsInfinite) {
  expect_bad_option(&BigdnOptions::norm_eps, std::numeric_limits<double>::infinity(), "norm_eps", "finite");
}

// --- the unfused layer validates the same way ----------------------------------------------------

TEST(BadInput, UnfusedTokensNotFramesTimesS) { expect_bad(good(), "qkv", "F·S", 4, 4, /*fused=*/false); }

TEST(BadInput, UnfusedBetaWrongShape) {
  LayerInputs in = good();
  in.beta = f32({2, 2, 12});
  expect_bad(in, "beta", "", kKeep, kKeep, /*fused=*/false);
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts);

// --- the clip-start mask (docs/design.md §4a) ----------------------------------------------------------------

// bigdn and bigdn_unfused with a bad mask: gdncp::Error naming clip_starts, nothing recorded.
void expect_bad_clips(const Tensor& mask, const std::string& why) {
  const LayerInputs in = good();
  for (bool fused : {true, false}) {
    const std::string entry = fused ? "bigdn" : "bigdn_unfused";
    const size_t tape_before = autograd::tape_size(), saved_before = autograd::saved_bytes();
    try {
      if (fused)
        bigdn(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, in.d.F, in.d.S, in.opt,
              mask);
      else
        bigdn_unfused(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, in.d.F, in.d.S,
                      in.opt, mask);
      ADD_FAILURE() << entry << ": no error for a bad clip_starts (" << why << ")";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(entry + ": clip_starts:"), std::string::npos) << "message does not name clip_starts: " << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << "message does not say '" << why << "': " << msg;
    } catch (const std::exception& e) {
      ADD_FAILURE() << entry << ": bad clip_starts threw a non-gdncp exception: " << e.what();
    }
    EXPECT_EQ(autograd::tape_size(), tape_before) << "work was recorded before the error";
    EXPECT_EQ(autograd::saved_bytes(), saved_before);
  }
}

Tensor mask(const Shape& s, DType dt = DType::f32) { return Tensor::zeros(s, dt); }

TEST(BadInput, ClipStartsWrongShape) {
  const int64_t B = kDims.B, F = kDims.F, H = kDims.H;
  expect_bad_clips(mask({F}), "(B, F)");
  expect_bad_clips(mask({B, F + 1}), "(B, F)");
  expect_bad_clips(mask({F, B}), "(B, F)");
  expect_bad_clips(mask({B, H, F}), "(B, F)");
}

TEST(BadInput, ClipStartsWrongDtype) {
  expect_bad_clips(mask({kDims.B, kDims.F}, DType::f64), "f32");
  expect_bad_clips(mask({kDims.B, kDims.F}, DType::bf16), "f32");
}

TEST(BadInput, ClipStartsOnAnotherDevice) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  expect_bad_clips(Tensor::zeros({kDims.B, kDims.F}, DType::f32, Device::cuda), "one device");
}

// The CPU twin of the device check of a clip mask (Note [clip mask values]):
// a bad value poisons the outputs given and is reported once, naming
// clip_starts, by the next entry that takes a mask; a good mask changes nothing.
TEST(HardenClipGuard, CpuTwinPoisonsAndReportsOnce) {
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const int64_t B = kDims.B, F = kDims.F;
  const float bad_values[] = {0.5f, 2.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()};
  const float bad = bad_values[rng() % 4];
  const int64_t b = static_cast<int64_t>(rng() % B), f = static_cast<int64_t>(rng() % F);
  std::vector<double> m(static_cast<size_t>(B * F));
  for (double& v : m) v = static_cast<double>(rng() % 2);
  const Tensor good_mask = Tensor::from_vector(m, {B, F}, DType::f32);
  m[static_cast<size_t>(b * F + f)] = bad;
  const Tensor bad_mask = Tensor::from_vector(m, {B, F}, DType::f32);
  SCOPED_TRACE("seed " + std::to_string(seed) + ", value " + std::to_string(bad));

  const std::vector<Tensor> outs = {Tensor::randn({3, 5}, DType::f32, Device::cpu, seed),
                                    Tensor::randn({7}, DType::f64, Device::cpu, seed + 1),
                                    Tensor::randn({2, 4}, DType::bf16, Device::cpu, seed + 2)};
  std::vector<std::vector<double>> before;
  for (const Tensor& t : outs) before.push_back(t.to_vector());
  kernels::guard_clip_mask(good_mask, outs);
  for (size_t k = 0; k < outs.size(); ++k)
    EXPECT_EQ(outs[k].to_vector(), before[k]) << "a good mask changed output " << k;

  const LayerInputs in = good();
  auto call = [&] {
    bigdn(in.qkv, in.beta, in.decay, in.q_norm_w, in.k_norm_w, in.rope_cos, in.rope_sin, in.d.F, in.d.S, in.opt);
  };
  EXPECT_NO_THROW(call());
  kernels::guard_clip_mask(bad_mask, outs);
  for (size_t k = 0; k < outs.size(); ++k)
    for (double v : outs[k].to_vector()) ASSERT_TRUE(std::isnan(v)) << "output " << k << " not poisoned";
  const std::string at = "at (" + std::to_string(b) + ", " + std::to_string(f) + ")";
  expect_error(call, {"bigdn: clip_starts: must hold 0 or 1", at, "earlier call"});
  EXPECT_NO_THROW(call()) << "a fault is reported once";
}

// The one check of the collective headers (Note [collective header]), as each
// backend applies it to the headers it received: every rank reaches the same
// verdict, a bad argument first.
TEST(HardenHeader, VerdictIsTheSameOnEveryRankAndNamesTheBadRank) {
  using cp::detail::CollectiveHeader;
  using cp::detail::header_verdict;
  using cp::detail::make_header;
  const int P = 3;
  const std::vector<int> from = {0, 1, 2};
  const CollectiveHeader a = make_header(7, "bigdn_cp", 100, 4, "");
  EXPECT_EQ(header_verdict({a, a, a}, from, a, 1, P, "bigdn_cp"), "");

  // A bad argument on rank 2 wins over a size that also differs.
  CollectiveHeader bad = make_header(7, "bigdn_cp", 100, 4, "bigdn_cp: beta: wrong shape");
  CollectiveHeader other_size = make_header(7, "bigdn_cp", 101, 4, "");
  const std::vector<CollectiveHeader> got = {a, other_size, bad};
  for (int r = 0; r < P; ++r) {
    const CollectiveHeader& want = got[static_cast<size_t>(r)];
    const std::string v = header_verdict(got, from, want, r, P, "bigdn_cp");
    if (r == 2)
      EXPECT_EQ(v, "bigdn_cp: beta: wrong shape");
    else
      EXPECT_EQ(v, "bigdn_cp: bad argument on rank 2 of 3: bigdn_cp: beta: wrong shape") << "rank " << r;
  }
  // Sizes, then collectives that differ: out of step on every rank, naming both.
  for (int r = 0; r < 2; ++r) {
    const std::vector<CollectiveHeader> two = {a, other_size};
    const std::string v = header_verdict(two, {0, 1}, two[static_cast<size_t>(r)], r, 2, "bigdn_cp", -1, "", "units");
    EXPECT_NE(v.find("out of step"), std::string::npos) << v;
    EXPECT_NE(v.find("sizes of a call must agree"), std::string::npos) << v;
    EXPECT_NE(v.find("(101 units, collective #4)"), std::string::npos) << v;
  }
  const CollectiveHeader b = make_header(8, "all_reduce_grads", 100, 4, "");
  const std::string v = header_verdict({a, b}, {0, 1}, a, 0, 2, "bigdn_cp", 8, " (hint)");
  EXPECT_NE(v.find("rank 1 is in all_reduce_grads"), std::string::npos) << v;
  EXPECT_NE(v.find("(hint)"), std::string::npos) << v;
  CollectiveHeader garbled = a;
  garbled.magic = 0;
  EXPECT_NE(header_verdict({a, garbled}, {0, 1}, a, 0, 2, "x").find("sent no gdncp header"), std::string::npos);
  CollectiveHeader root = make_header(7, "bigdn_cp", 100, 4, "", 1);
  EXPECT_NE(header_verdict({a, root}, {0, 1}, a, 0, 2, "x").find("disagree on the root"), std::string::npos);
}

TEST(BadInput, UnfusedEpsZero) { expect_bad_option(&BigdnOptions::eps, 0, "eps", "> 0", /*fused=*/false); }

TEST(BadInput, UnfusedNormEpsZero) {
  expect_bad_option(&BigdnOptions::norm_eps, 0, "norm_eps", "> 0", /*fused=*/false);
}

TEST(BadInput, UnfusedKScaleNaN) {
  expect_bad_option(&BigdnOptions::k_scale, std::numeric_limits<double>::quiet_NaN(), "k_scale", "finite",
                    /*fused=*/false);
}

// --- sizes that overflow int64 ------------------------------------------------------------------

TEST(BadInput, FramesTimesTokensOverflow) {
  expect_bad(good(), "F·S", "overflows", int64_t(1) << 40, int64_t(1) << 40);
}

TEST(BadInput, UnfusedFramesTimesTokensOverflow) {
  expect_bad(good(), "F·S", "overflows", int64_t(1) << 62, 4, /*fused=*/false);
}

// Runs fn, expects a gdncp::Error (never a raw std exception) containing every one of parts.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << parts.front();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "no '" << p << "' in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a non-gdncp exception: " << e.what();
  }
}

TEST(BadSize, ZerosWhoseBytesOverflow) {
  // 2^62 f32 elements: the element count fits, the byte count does not.
  expect_error([] { Tensor::zeros({int64_t(1) << 62}, DType::f32); },
               {"Tensor::empty", "[4611686018427387904]", "bytes"});
}

TEST(BadSize, ShapeWhoseElementsOverflow) {
  // 2^32 · 2^32 = 2^64 wraps to 0 in int64 arithmetic: must not become an empty tensor.
  expect_error(
      [] {
        Tensor::zeros({int64_t(1) << 32, int64_t(1) << 32}, DType::f32);
      },
      {"Tensor::empty", "[4294967296, 4294967296]", "int64"});
}

TEST(BadSize, RandnWhoseElementsOverflow) {
  expect_error(
      [] {
        Tensor::randn({int64_t(1) << 40, 1 << 20, 1 << 20}, DType::bf16, Device::cpu, 1);
      },
      {"[1099511627776, 1048576, 1048576]"});
}

TEST(BadSize, FromVectorShapeOverflow) {
  // 274177 · 67280421310721 = 2^64 + 1: an unchecked product wraps to 1, matching the one value.
  expect_error(
      [] {
        Tensor::from_vector({1.0}, {274177, 67280421310721}, DType::f32);
      },
      {"Tensor::from_vector", "[274177, 67280421310721]"});
}

TEST(BadSize, ReshapeToOverflowingShape) {
  const Tensor t = Tensor::zeros({4}, DType::f32);
  // (2^62 + 1) · 4 = 2^64 + 4: an unchecked product wraps to 4, the tensor's numel.
  expect_error([&] { t.reshape({(int64_t(1) << 62) + 1, 4}); }, {"Tensor::reshape", "[4611686018427387905, 4]"});
}

TEST(BadSize, AllocationThatCannotBeServed) {
  // 2^62 bytes: representable, far beyond any host. An error naming the bytes, never std::bad_alloc.
  expect_error([] { Tensor::empty({int64_t(1) << 60}, DType::f32); }, {"cannot allocate", "4611686018427387904 bytes"});
}

TEST(BadSize, NegativeExtent) {
  expect_error([] { Tensor::full({3, -1}, 1.0, DType::f32); }, {"negative", "[3, -1]"});
}

TEST(BadSize, RopeTableSizeOverflow) {
  expect_error([] { rope_tables(int64_t(1) << 60, 64, DType::f32, Device::cpu); }, {"rope_tables: N·D", "overflows"});
}

TEST(BadSize, RopeOffsetOverflow) {
  expect_error([] { rope_tables(8, 4, DType::f32, Device::cpu, std::numeric_limits<int64_t>::max() - 2); },
               {"rope_tables: offset"});
}

TEST(BadSize, CheckedMulNamesTheProduct) {
  EXPECT_EQ(checked_mul(int64_t(1) << 31, int64_t(1) << 31, "x"), int64_t(1) << 62);
  expect_error([] { checked_mul(int64_t(1) << 32, int64_t(1) << 31, "B·H·N"); }, {"B·H·N", "overflows"});
}

TEST(BadSize, FromBlobNullData) {
  expect_error(
      [] {
        Tensor::from_blob(nullptr, {2, 3}, DType::f32, Device::cpu, nullptr);
      },
      {"Tensor::from_blob: data", "null"});
}

TEST(BadSize, FromBlobShapeOverflow) {
  float x = 0;
  expect_error([&] { Tensor::from_blob(&x, {int64_t(1) << 62}, DType::f64, Device::cpu, nullptr); },
               {"Tensor::from_blob", "bytes"});
}

// --- tensors saved for backward and then modified in place ----------------------------------------

// x (4, 3) · w (3, 2): matmul saves both for backward.
struct MatmulCase {
  Tensor x = Tensor::randn({4, 3}, DType::f32, Device::cpu, 31);
  Tensor w = Tensor::randn({3, 2}, DType::f32, Device::cpu, 32);
  Tensor y;
  MatmulCase() {
    x.requires_grad_();
    w.requires_grad_();
    y = nn::matmul(x, w);
  }
  void backward() { gdncp::backward(y, Tensor::full(y.shape(), 1.0, DType::f32)); }
};

TEST(BadInplace, FillOfSavedInput) {
  MatmulCase c;
  c.x.detach().fill_(2.0);  // same storage as the saved x
  expect_error([&] { c.backward(); }, {"matmul", "saved tensor", "f32[4, 3]", "modified in place"});
  autograd::clear_tape();
}

TEST(BadInplace, CopyIntoSavedWeight) {
  MatmulCase c;
  Tensor w = c.w.detach();
  w.copy_from(Tensor::randn({3, 2}, DType::f32, Device::cpu, 33));
  expect_error([&] { c.backward(); }, {"matmul", "f32[3, 2]", "modified in place"});
  autograd::clear_tape();
}

TEST(BadInplace, WriteThroughReshapedView) {
  MatmulCase c;
  c.x.detach().reshape({12}).fill_(0.5);  // a reshape shares the storage
  expect_error([&] { c.backward(); }, {"matmul", "f32[4, 3]"});
  autograd::clear_tape();
}

TEST(BadInplace, OptimizerStepBetweenForwardAndBackward) {
  MatmulCase c;
  c.backward();  // w gets a gradient, so the optimizer updates it
  optim::AdamW opt({c.w});
  const Tensor y = nn::matmul(c.x, c.w);
  opt.step();  // changes w, which y's node saved
  expect_error([&] { backward(y, Tensor::full(y.shape(), 1.0, DType::f32)); },
               {"matmul", "f32[3, 2]", "modified in place"});
  autograd::clear_tape();
}

// The layer's backward after one of its inputs was filled in place must raise an
// error containing every one of parts.
void expect_filled_input_caught(Checkpoint ck, Tensor LayerInputs::*field, const std::vector<std::string>& parts) {
  LayerInputs in = good();
  in.opt.checkpoint = ck;
  const Tensor out = in.run();
  (in.*field).detach().fill_(0.25);
  expect_error([&] { backward(out, Tensor::full(out.shape(), 1.0, out.dtype())); }, parts);
  autograd::clear_tape();
}

TEST(BadInplace, SavedLayerInputFilled) {
  expect_filled_input_caught(Checkpoint::off, &LayerInputs::beta, {"bigdn", "modified in place"});
}

TEST(BadInplace, CheckpointedLayerInputFilled) {
  expect_filled_input_caught(Checkpoint::on, &LayerInputs::qkv, {"modified in place"});
}

TEST(BadInplace, UnchangedOrClonedTensorsPass) {
  MatmulCase c;
  Tensor copy = c.x.detach().clone();
  copy.fill_(7.0);  // a clone has storage of its own
  const uint64_t v = c.x.version();
  EXPECT_NO_THROW(c.backward());
  EXPECT_EQ(c.x.version(), v);
  ASSERT_TRUE(c.w.grad().defined());
  // After backward the saved tensors are gone: changing x is fine again.
  EXPECT_NO_THROW(c.x.detach().fill_(1.0));
  EXPECT_EQ(c.x.version(), v + 1);
}

// --- devices (needs a GPU) -----------------------------------------------------------------------

TEST(BadInput, DeviceMismatchAndF64OnCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  LayerInputs in = good();
  in.decay = in.decay.detach().to(Device::cuda);
  expect_bad(in, "decay", "one device");
  LayerInputs all_cuda = good(DType::f64);
  for (Tensor* t : {&all_cuda.qkv, &all_cuda.beta, &all_cuda.decay, &all_cuda.q_norm_w, &all_cuda.k_norm_w,
                    &all_cuda.rope_cos, &all_cuda.rope_sin})
    *t = t->detach().to(Device::cuda);
  expect_bad(all_cuda, "qkv", "CPU only");
}

}  // namespace
}  // namespace test
}  // namespace gdncp
