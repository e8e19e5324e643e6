// tests/door_reference.cpp — the C++ entries on inputs written by the Python
// tests, so that they can compare the door (python/gdncp) with the C++
// library bitwise, and time both (python/examples/bench_door.py).
//
//   door_reference DIR [--time ITERS]            gdncp::bigdn
//   mpirun -np P door_reference DIR --cp [...]   gdncp::cp::bigdn_cp, rank r in DIR/rank<r>
//
// DIR/meta.txt (DIR/rank<r>/meta.txt with --cp): "B H D F S k_scale dtype(f32|bf16|f64) checkpoint(off|on)
// device(cpu|cuda) precision(auto|bf16|tf32|ieee)" (F = this rank's frames). Inputs: raw dense bytes qkv, beta, decay,
// grad_out in dtype; q_norm_w, k_norm_w (absent file = no norm), rope_cos, rope_sin, and optionally q's own rope_cos_q,
// rope_sin_q (absent files = q uses the k tables) in f32 (f64 with f64). Writes out.ref and grad_<name>.ref beside
// them: one forward and one backward(out, grad_out). --time ITERS then times ITERS more forward+backward steps and
// prints "door_reference: <ms> ms per step".
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gdncp/cp.h"
#include "gdncp/gdncp.h"

using namespace gdncp;

namespace {

Tensor read(const std::string& path, const Shape& shape, DType dtype, Device device, bool optional = false) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    GDNCP_CHECK(optional, "door_reference: cannot open ", path);
    return Tensor();
  }
  Tensor t = Tensor::empty(shape, dtype, Device::cpu);
  f.read(static_cast<char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  GDNCP_CHECK(f.gcount() == static_cast<std::streamsize>(t.nbytes()), "door_reference: ", path, " holds ", f.gcount(),
              " bytes, expected ", t.nbytes());
  return device == Device::cpu ? t : t.to(device);
}

void write(const std::string& path, const Tensor& t) {
  const Tensor h = t.to(Device::cpu);
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(h.data()), static_cast<std::streamsize>(h.nbytes()));
  GDNCP_CHECK(f.good(), "door_reference: cannot write ", path);
}

DType dtype_named(const std::string& s) {
  if (s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  if (s == "f64") return DType::f64;
  GDNCP_FAIL("door_reference: dtype ", s);
}

Precision precision_named(const std::string& s) {
  if (s == "auto") return Precision::automatic;
  if (s == "bf16") return Precision::bf16;
  if (s == "tf32") return Precision::tf32;
  if (s == "ieee") return Precision::ieee;
  GDNCP_FAIL("door_reference: precision ", s);
}

int run(int argc, char** argv) {
  GDNCP_CHECK(argc >= 2, "usage: door_reference DIR [--cp] [--time ITERS]");
  std::string dir = argv[1];
  bool cp_mode = false;
  int iters = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cp")
      cp_mode = true;
    else if (a == "--time" && i + 1 < argc)
      iters = std::stoi(argv[++i]);
    else
      GDNCP_FAIL("door_reference: unknown argument ", a);
  }
  std::shared_ptr<cp::Communicator> comm;
  if (cp_mode) {
    int rank = 0;
    GDNCP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    dir += "/rank" + std::to_string(rank);
  }
  std::ifstream meta_file(dir + "/meta.txt");
  GDNCP_CHECK(meta_file.good(), "door_reference: no ", dir, "/meta.txt");
  int64_t B, H, D, F, S;
  double k_scale;
  std::string dtype_s, ckpt_s, device_s, prec_s;
  meta_file >> B >> H >> D >> F >> S >> k_scale >> dtype_s >> ckpt_s >> device_s >> prec_s;
  GDNCP_CHECK(!meta_file.fail(), "door_reference: cannot parse ", dir, "/meta.txt");
  const Device device = device_s == "cuda" ? Device::cuda : Device::cpu;
  if (cp_mode) comm = device == Device::cuda ? cp::make_nccl_communicator(MPI_COMM_WORLD) : cp::make_mpi_communicator();
  const DType dtype = dtype_named(dtype_s), table = dtype == DType::f64 ? DType::f64 : DType::f32;
  const int64_t N = F * S, C = H * D;
  Tensor qkv = read(dir + "/qkv", {B, N, 3, H, D}, dtype, device);
  Tensor beta = read(dir + "/beta", {B, H, F, S}, dtype, device);
  Tensor decay = read(dir + "/decay", {B, H, F}, dtype, device);
  Tensor qw = read(dir + "/q_norm_w", {C}, table, device, true);
  Tensor kw = read(dir + "/k_norm_w", {C}, table, device, true);
  Tensor cos = read(dir + "/rope_cos", {N, D}, table, device);
  Tensor sin = read(dir + "/rope_sin", {N, D}, table, device);
  Tensor cos_q = read(dir + "/rope_cos_q", {N, D}, table, device, true);
  Tensor sin_q = read(dir + "/rope_sin_q", {N, D}, table, device, true);
  Tensor grad_out = read(dir + "/grad_out", {B, N, H, D}, dtype, device);
  BigdnOptions opt;
  opt.k_scale = k_scale;
  opt.checkpoint = ckpt_s == "on" ? Checkpoint::on : Checkpoint::off;
  opt.precision = precision_named(prec_s);
  std::vector<Tensor*> leaves = {&qkv, &beta, &decay, &qw, &kw};
  const char* names[] = {"qkv", "beta", "decay", "q_norm_w", "k_norm_w"};
  for (Tensor* t : leaves)
    if (t->defined()) t->requires_grad_(true);

  const auto step = [&] {
    for (Tensor* t : leaves)
      if (t->defined()) t->zero_grad();
    Tensor out = comm ? cp::bigdn_cp(*comm, qkv, beta, decay, qw, kw, cos, sin, F, S, opt, Tensor(), cos_q, sin_q)
                      : bigdn(qkv, beta, decay, qw, kw, cos, sin, F, S, opt, Tensor(), cos_q, sin_q);
    backward(out, grad_out);
    return out;
  };
  const Tensor out = step();
  write(dir + "/out.ref", out);
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i]->defined()) write(dir + "/grad_" + names[i] + ".ref", leaves[i]->grad());
  if (iters > 0) {
    for (int i = 0; i < 3; ++i) step();  // warm-up
    synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) step();
    synchronize();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
    std::printf("door_reference: %.4f ms per step\n", ms);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool cp_mode = false;
  for (int i = 2; i < argc; ++i) cp_mode |= std::string(argv[i]) == "--cp";
  if (cp_mode) MPI_Init(&argc, &argv);
  int rc = 1;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "door_reference: %s\n", e.what());
  }
  if (cp_mode) MPI_Finalize();
  return rc;
}
