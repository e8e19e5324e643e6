// examples/train/trainer.cpp — flags, data, the training loop, logging,
// checkpoints (see trainer.h for the model and the rank layout).
//
// Note [data]: the data set is `pool` batches per data-parallel group of
// `batch` seeded random videos (latents N(0, 1)), and the targets are the
// teacher's outputs on them, computed once at start-up. Every rank generates
// only its own frames, but each frame's values depend only on (seed, video,
// global frame), so any CP split sees the same global videos. Each step draws
// one batch index from the run's RNG (the same on every rank); the RNG state is
// part of the checkpoint, so a resumed run draws what the uninterrupted run
// would have drawn.
//
// Note [clips]: with --clips L1,L2,... every video is those clips back to back
// (the same packing in every video). The layer gets the clip-start mask, so no
// state crosses a clip start, and each clip's RoPE positions start at 0, as if
// it were a video of its own. The split over the CP group ignores the clips: a
// clip may span ranks.
#include "trainer.h"

#include <gdncp/gdncp.h>
#include <gdncp/nn.h>
#include <gdncp/optim.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "checkpoint.h"
#include "dist.h"
#include "model.h"
#include "plot.h"

namespace train {

using gdncp::Device;
using gdncp::DType;
using gdncp::Tensor;

namespace {

constexpr uint64_t kTeacherSeed = 0x7eac4e5;  // fixed: every run learns the same teacher

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t s = a;
  s ^= splitmix64(s) + b;
  s ^= splitmix64(s) + c;
  return splitmix64(s);
}

// --- flags -----------------------------------------------------------------------------

int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size()) throw UsageError("--" + flag + ": expected an integer, got '" + v + "'");
  if (x < lo || x > hi)
    throw UsageError("--" + flag + ": " + v + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "]");
  return x;
}

double parse_double(const std::string& flag, const std::string& v, double lo, double hi) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(x))
    throw UsageError("--" + flag + ": expected a number, got '" + v + "'");
  if (x < lo || x > hi) throw UsageError("--" + flag + ": " + v + " is out of range");
  return x;
}

// One command-line flag: its name, help, how it parses into Config, and how
// its current value prints (for --help's defaults).
struct Flag {
  std::string name, help;
  std::function<void(Config&, const std::string&)> set;
  std::function<std::string(const Config&)> get;
};

Flag int_flag(const std::string& name, const std::string& help, int64_t Config::*field, int64_t lo, int64_t hi) {
  return {name, help, [=](Config& c, const std::string& v) { c.*field = parse_int(name, v, lo, hi); },
          [=](const Config& c) { return std::to_string(c.*field); }};
}

Flag real_flag(const std::string& name, const std::string& help, double Config::*field, double lo, double hi) {
  return {name, help, [=](Config& c, const std::string& v) { c.*field = parse_double(name, v, lo, hi); },
          [=](const Config& c) {
            std::ostringstream o;
            o << c.*field;
            return o.str();
          }};
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

// --clips L1,L2,...: positive lengths; '' = one clip per video.
Flag clips_flag() {
  return {"clips",
          "lengths of the clips packed in each video, comma-separated, summing to --frames (e.g. 7,7,7; 1,1,1 for "
          "still images); '' = one clip",
          [](Config& c, const std::string& v) {
            c.clips.clear();
            if (v.empty()) return;
            size_t at = 0;
            while (true) {
              const size_t comma = v.find(',', at);
              c.clips.push_back(parse_int("clips", v.substr(at, comma - at), 1, int64_t(1) << 40));
              if (comma == std::string::npos) break;
              at = comma + 1;
            }
          },
          [](const Config& c) { return "'" + join(c.clips) + "'"; }};
}

Flag text_flag(const std::string& name, const std::string& help, std::string Config::*field,
               const std::vector<std::string>& choices = {}) {
  std::string list;
  for (const std::string& ch : choices) list += (list.empty() ? "" : " | ") + ch;
  return {name, choices.empty() ? help : list + ": " + help,
          [=](Config& c, const std::string& v) {
            if (!choices.empty() && std::find(choices.begin(), choices.end(), v) == choices.end())
              throw UsageError("--" + name + ": expected " + list + ", got '" + v + "'");
            c.*field = v;
          },
          [=](const Config& c) { return choices.empty() ? "'" + c.*field + "'" : c.*field; }};
}

const std::vector<Flag>& flags() {
  const int64_t big = int64_t(1) << 40;
  static const std::vector<Flag> f = {
      int_flag("steps", "total training steps (a resumed run continues up to it)", &Config::steps, 1, big),
      int_flag("layers", "BiGDN layers", &Config::layers, 1, 1024),
      int_flag("heads", "heads H", &Config::heads, 1, 4096),
      int_flag("head-dim", "head dimension D (even, 2..128)", &Config::head_dim, 2, gdncp::kMaxHeadDim),
      int_flag("frames", "frames per video, global (any count, split over the CP group as evenly as it goes)",
               &Config::frames, 1, big),
      clips_flag(),
      int_flag("tokens", "tokens per frame S", &Config::tokens, 1, big),
      int_flag("batch", "videos per step per data-parallel group", &Config::batch, 1, big),
      int_flag("pool", "distinct batches per data-parallel group (the data set)", &Config::pool, 1, 1 << 20),
      real_flag("lr", "peak learning rate of AdamW", &Config::lr, 0, 10),
      int_flag("warmup", "linear learning-rate warm-up steps", &Config::warmup, 0, big),
      real_flag("weight-decay", "AdamW decoupled weight decay", &Config::weight_decay, 0, 10),
      text_flag("device", "one GPU per rank (local rank mod device count), or CPU ranks", &Config::device,
                {"cpu", "cuda"}),
      text_flag("dtype", "activation dtype (parameters and optimizer state stay f32)", &Config::dtype, {"f32", "bf16"}),
      text_flag("checkpointing", "activation checkpointing of the layer", &Config::checkpointing,
                {"on", "off", "auto"}),
      {"seed", "seed of the student's init and of the data (the teacher's is fixed)",
       [](Config& c, const std::string& v) { c.seed = static_cast<uint64_t>(parse_int("seed", v, 0, INT64_MAX)); },
       [](const Config& c) { return std::to_string(c.seed); }},
      int_flag("cp", "context-parallel group size; data-parallel groups = ranks / cp", &Config::cp, 1, 1 << 20),
      real_flag("timeout",
                "deadline in seconds of every collective: a lost or hung rank ends the run with an error on the others",
                &Config::timeout, 1e-3, 1e6),
      text_flag("log", "JSON-lines log path (rank 0), '' for none", &Config::log_path),
      text_flag("plot", "SVG loss curve path (default: loss.svg beside the log)", &Config::plot_path),
      text_flag("save-dir", "directory for checkpoints (none when empty)", &Config::save_dir),
      int_flag("save-every", "checkpoint period in steps (0: only at the end)", &Config::save_every, 0, big),
      text_flag("resume", "checkpoint file, or a directory (its latest step_*.ckpt), to continue from",
                &Config::resume),
      int_flag("check-every", "period of the bitwise parameter-identity check across ranks", &Config::check_every, 0,
               big),
      int_flag("print-every", "progress line period on rank 0 (0: silent)", &Config::print_every, 0, big),
  };
  return f;
}

const Flag* find_flag(const std::string& name) {
  for (const Flag& f : flags())
    if (f.name == name) return &f;
  return nullptr;
}

// Checks that need more than one flag, or the world.
void validate(const Config& c, int world_size) {
  if (c.head_dim % 2 != 0)
    throw UsageError("--head-dim: must be even (RoPE pairs channels), got " + std::to_string(c.head_dim));
  if (world_size % c.cp != 0)
    throw UsageError("--cp " + std::to_string(c.cp) + " must divide the number of ranks (" +
                     std::to_string(world_size) + ")");
  if (!c.clips.empty()) {
    int64_t total = 0;
    for (int64_t len : c.clips) total += len;
    if (total != c.frames)
      throw UsageError("--clips " + join(c.clips) + ": the lengths sum to " + std::to_string(total) +
                       ", but --frames is " + std::to_string(c.frames));
  }
  if (c.device == "cuda" && !gdncp::cuda_available())
    throw UsageError("--device cuda: no CUDA device is visible (or gdncp was built without CUDA)");
}

// --- logging ---------------------------------------------------------------------------

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) continue;
    o += ch;
  }
  return o;
}

std::string hms(double seconds) {
  const long s = static_cast<long>(std::max(0.0, seconds) + 0.5);
  char b[32];
  if (s >= 3600)
    std::snprintf(b, sizeof b, "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  else
    std::snprintf(b, sizeof b, "%ld:%02ld", s / 60, s % 60);
  return b;
}

std::string si(double v) {
  char b[32];
  if (v >= 1e6)
    std::snprintf(b, sizeof b, "%.2fM", v / 1e6);
  else if (v >= 1e3)
    std::snprintf(b, sizeof b, "%.1fk", v / 1e3);
  else
    std::snprintf(b, sizeof b, "%.0f", v);
  return b;
}

std::string default_plot_path(const Config& c) {
  if (!c.plot_path.empty() || c.log_path.empty()) return c.plot_path;
  return (std::filesystem::path(c.log_path).parent_path() / "loss.svg").string();
}

// --- data ------------------------------------------------------------------------------

// Batch k of this rank: (B, F·S, C) latents of videos (k·DP + dp_rank)·B + b,
// global frames [F0, F0 + F). See Note [data].
Tensor make_latents(const Config& c, const Dist& dist, int64_t k, int64_t F0, int64_t F, Device dev, DType dt) {
  const int64_t B = c.batch, S = c.tokens, C = c.heads * c.head_dim, N = F * S;
  Tensor host = Tensor::empty({B, N, C}, DType::f32);
  float* dst = host.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t video = static_cast<uint64_t>((k * dist.dp_size() + dist.dp_rank()) * B + b);
    for (int64_t f = 0; f < F; ++f) {
      const uint64_t global_frame = static_cast<uint64_t>(F0 + f);
      const Tensor frame = Tensor::randn({S, C}, DType::f32, Device::cpu, mix(c.seed, video, global_frame));
      std::memcpy(dst + (b * N + f * S) * C, frame.data(), frame.nbytes());
    }
  }
  return host.to(dt).to(dev);
}

// The first global frame of the clip holding global frame g (Note [clips]).
int64_t clip_start(const Config& c, int64_t g) {
  int64_t start = 0;
  for (int64_t len : c.clips) {
    if (g < start + len) return start;
    start += len;
  }
  return 0;  // one clip
}

// RoPE rows (F·S, D) f32 of global frames [F0, F0 + F): token s of frame g sits at
// position g·S + s, or with clips (g − clip_start(g))·S + s (Note [clips]).
std::pair<Tensor, Tensor> rope_rows(const Config& c, int64_t F0, int64_t F, Device dev) {
  const int64_t S = c.tokens, D = c.head_dim;
  if (F == 0) return {Tensor::empty({0, D}, DType::f32, dev), Tensor::empty({0, D}, DType::f32, dev)};
  if (c.clips.empty()) return gdncp::rope_tables(F * S, D, DType::f32, dev, F0 * S);
  const int64_t longest = *std::max_element(c.clips.begin(), c.clips.end());
  const auto table = gdncp::rope_tables(longest * S, D, DType::f32, Device::cpu);
  const std::vector<double> cs = table.first.to_vector(), sn = table.second.to_vector();
  std::vector<double> rc, rs;
  for (int64_t g = F0; g < F0 + F; ++g) {
    const auto row0 = static_cast<std::ptrdiff_t>((g - clip_start(c, g)) * S * D),
               rows = static_cast<std::ptrdiff_t>(S * D);
    rc.insert(rc.end(), cs.begin() + row0, cs.begin() + row0 + rows);
    rs.insert(rs.end(), sn.begin() + row0, sn.begin() + row0 + rows);
  }
  return {Tensor::from_vector(rc, {F * S, D}, DType::f32, dev), Tensor::from_vector(rs, {F * S, D}, DType::f32, dev)};
}

// The clip-start mask (B, F) f32 of global frames [F0, F0 + F); undefined without clips.
Tensor clip_mask(const Config& c, int64_t F0, int64_t F, Device dev) {
  if (c.clips.empty()) return Tensor();
  std::vector<double> m(static_cast<size_t>(c.batch * F), 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t f = 0; f < F; ++f) m[static_cast<size_t>(b * F + f)] = clip_start(c, F0 + f) == F0 + f ? 1.0 : 0.0;
  return Tensor::from_vector(m, {c.batch, F}, DType::f32, dev);
}

// --- checkpoints -----------------------------------------------------------------------

std::vector<std::pair<std::string, std::string>> run_identity(const Config& c, const Dist& d) {
  return {{"layers", std::to_string(c.layers)},
          {"heads", std::to_string(c.heads)},
          {"head-dim", std::to_string(c.head_dim)},
          {"frames", std::to_string(c.frames) + (c.clips.empty() ? "" : " = " + join(c.clips))},
          {"tokens", std::to_string(c.tokens)},
          {"batch", std::to_string(c.batch)},
          {"pool", std::to_string(c.pool)},
          {"seed", std::to_string(c.seed)},
          {"dtype", c.dtype},
          {"cp", std::to_string(d.cp_size())},
          {"dp", std::to_string(d.dp_size())}};
}

struct TrainState {
  Model* student;
  gdncp::optim::AdamW* opt;
  uint64_t* rng;
  std::vector<double>* history;  // losses of steps 1..step
};

void save_checkpoint(const Config& c, const Dist& dist, const TrainState& st, int64_t step, const std::string& path) {
  std::vector<char> status;  // rank 0's error message, empty when the save worked
  if (dist.rank() == 0) {
    Checkpoint ck;
    ck.identity = run_identity(c, dist);
    ck.step = step;
    ck.rng_state = *st.rng;
    ck.optimizer_steps = st.opt->steps();
    const std::vector<Tensor> params = st.student->params();
    const std::vector<std::string> names = st.student->param_names();
    for (size_t i = 0; i < params.size(); ++i) {
      ck.tensors.emplace_back(names[i], params[i].detach());
      ck.tensors.emplace_back("adam.m." + names[i], st.opt->exp_avg()[i]);
      ck.tensors.emplace_back("adam.v." + names[i], st.opt->exp_avg_sq()[i]);
    }
    ck.losses = *st.history;
    const std::string why = write_atomic(path, serialize(ck));
    status.assign(why.begin(), why.end());
  }
  dist.broadcast_bytes(status);
  if (!status.empty()) throw UsageError("cannot save checkpoint: " + std::string(status.begin(), status.end()));
}

// Loads the checkpoint into the state; returns the step it completed.
int64_t load_checkpoint(const Config& c, const Dist& dist, const TrainState& st) {
  std::vector<char> status, bytes;
  std::string path;
  if (dist.rank() == 0) {
    std::string why;
    path = resolve_checkpoint(c.resume, &why);
    if (path.empty())
      why = "--resume " + c.resume + ": " + why;
    else
      why = read_file(path, bytes);
    status.assign(why.begin(), why.end());
  }
  dist.broadcast_bytes(status);
  if (!status.empty()) throw UsageError(std::string(status.begin(), status.end()));
  std::vector<char> name(path.begin(), path.end());
  dist.broadcast_bytes(name);
  path.assign(name.begin(), name.end());
  dist.broadcast_bytes(bytes);

  // From here every rank parses the same bytes: errors are the same everywhere.
  const Checkpoint ck = deserialize(bytes, "checkpoint " + path);
  const auto want = run_identity(c, dist);
  for (const auto& kv : want) {
    auto it = std::find_if(ck.identity.begin(), ck.identity.end(), [&](const auto& p) { return p.first == kv.first; });
    const std::string have = it == ck.identity.end() ? "(missing)" : it->second;
    if (have != kv.second)
      throw UsageError("checkpoint " + path + " does not match this run: it has " + kv.first + " = " + have +
                       ", this run " + kv.second);
  }
  if (ck.step >= c.steps)
    throw UsageError("checkpoint " + path + " already completed step " + std::to_string(ck.step) + "; --steps " +
                     std::to_string(c.steps) + " leaves nothing to do");
  if (ck.step < 0 || ck.optimizer_steps < 0 || static_cast<int64_t>(ck.losses.size()) != ck.step)
    throw UsageError("checkpoint " + path + ": corrupt (inconsistent step counters)");
  const std::vector<Tensor> params = st.student->params();
  const std::vector<std::string> names = st.student->param_names();
  if (ck.tensors.size() != 3 * params.size())
    throw UsageError("checkpoint " + path + ": holds " + std::to_string(ck.tensors.size()) +
                     " tensors, this model needs " + std::to_string(3 * params.size()));
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string expect[3] = {names[i], "adam.m." + names[i], "adam.v." + names[i]};
    for (size_t j = 0; j < 3; ++j) {
      const auto& nt = ck.tensors[3 * i + j];
      if (nt.first != expect[j] || nt.second.shape() != params[i].shape())
        throw UsageError("checkpoint " + path + ": tensor " + std::to_string(3 * i + j) + " is " + nt.first + " " +
                         gdncp::shape_str(nt.second.shape()) + ", expected " + expect[j] + " " +
                         gdncp::shape_str(params[i].shape()));
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor p = params[i].detach();  // same storage: the optimizer's handle sees the load
    p.copy_from(ck.tensors[3 * i].second);
    Tensor m = st.opt->exp_avg()[i], v = st.opt->exp_avg_sq()[i];
    m.copy_from(ck.tensors[3 * i + 1].second);
    v.copy_from(ck.tensors[3 * i + 2].second);
  }
  st.opt->set_steps(ck.optimizer_steps);
  *st.rng = ck.rng_state;
  *st.history = ck.losses;
  return ck.step;
}

}  // namespace

// --- public --------------------------------------------------------------------------------

std::string usage() {
  const Config d;
  std::ostringstream o;
  o << "gdncp_train — trains a small BiGDN video model against a fixed teacher, across ranks.\n\n"
       "usage: mpirun -np <ranks> gdncp_train [--flag value | --flag=value]...\n"
       "  ranks = DP x CP: consecutive ranks form a context-parallel group (--cp) that splits each\n"
       "  video's frames; the groups are data-parallel replicas training on different videos.\n\n";
  for (const Flag& f : flags()) {
    char line[64];
    std::snprintf(line, sizeof line, "  --%-15s", f.name.c_str());
    o << line << f.help << " [" << f.get(d) << "]\n";
  }
  o << "  --help           this text\n";
  return o.str();
}

bool parse_args(int argc, char** argv, Config& cfg) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") return false;
    if (a.rfind("--", 0) != 0)
      throw UsageError("unexpected argument '" + a + "' (flags look like --steps 60; see --help)");
    a = a.substr(2);
    std::string value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (!find_flag(a)) throw UsageError("unknown flag --" + a + " (see --help)");
      if (i + 1 >= argc) throw UsageError("--" + a + ": missing value");
      value = argv[++i];
    }
    const Flag* f = find_flag(a);
    if (!f) throw UsageError("unknown flag --" + a + " (see --help)");
    f->set(cfg, value);
  }
  return true;
}

Result train(const Config& cfg, MPI_Comm world) {
  int world_size = 1;
  GDNCP_MPI_CHECK(MPI_Comm_size(world, &world_size));
  validate(cfg, world_size);
  const Device dev = cfg.device == "cuda" ? Device::cuda : Device::cpu;
  const DType dt = cfg.dtype == "bf16" ? DType::bf16 : DType::f32;
  Dist dist(world, static_cast<int>(cfg.cp), dev, cfg.timeout);
  const bool lead = dist.rank() == 0;

  // This rank's frames [F0, F0 + F) of each video (none when frames < cp: see forward()).
  const gdncp::cp::FrameSplit split = gdncp::cp::balanced_split(cfg.frames, dist.cp_size(), dist.cp_rank());
  const int64_t F = split.frames, F0 = split.offset, S = cfg.tokens, C = cfg.heads * cfg.head_dim;
  const ModelShape shape{cfg.layers, cfg.heads, cfg.head_dim};
  Model student = init_model(shape, cfg.seed, dev, /*teacher=*/false, /*trainable=*/true);
  const Model teacher = init_model(shape, kTeacherSeed, dev, /*teacher=*/true, /*trainable=*/false);

  ForwardContext ctx;
  ctx.dist = &dist;
  ctx.frames = F;
  ctx.tokens = S;
  ctx.dtype = dt;
  std::tie(ctx.rope_cos, ctx.rope_sin) = rope_rows(cfg, F0, F, dev);
  ctx.clip_starts = clip_mask(cfg, F0, F, dev);
  ctx.options.k_scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim * S));  // Sana: D^-½·S^-½
  ctx.options.checkpoint = cfg.checkpointing == "on"    ? gdncp::Checkpoint::on
                           : cfg.checkpointing == "off" ? gdncp::Checkpoint::off
                                                        : gdncp::Checkpoint::automatic;

  // The data set and the teacher's answers (Note [data]).
  std::vector<Tensor> inputs, targets;
  for (int64_t k = 0; k < cfg.pool; ++k) {
    inputs.push_back(make_latents(cfg, dist, k, F0, F, dev, dt));
    gdncp::NoGradGuard no_grad;
    targets.push_back(forward(teacher, inputs.back(), ctx));
  }

  gdncp::optim::AdamWOptions oo;
  oo.lr = cfg.lr;
  oo.weight_decay = cfg.weight_decay;
  const std::vector<Tensor> params = student.params();
  gdncp::optim::AdamW opt(params, oo);
  uint64_t rng = mix(cfg.seed, 0x5eed, 0xda7a);
  std::vector<double> history;
  const TrainState state{&student, &opt, &rng, &history};
  const int64_t start = cfg.resume.empty() ? 0 : load_checkpoint(cfg, dist, state);

  const std::string plot_path = default_plot_path(cfg);
  std::ofstream log;
  if (lead && !cfg.log_path.empty()) {
    std::error_code ec;
    const auto dir = std::filesystem::path(cfg.log_path).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);
    log.open(cfg.log_path, start > 0 ? std::ios::app : std::ios::trunc);
    if (!log) std::fprintf(stderr, "gdncp_train: warning: cannot write the log %s\n", cfg.log_path.c_str());
    log << "{\"event\":\"" << (start > 0 ? "resume" : "start") << "\",\"step\":" << start
        << ",\"ranks\":" << dist.size() << ",\"dp\":" << dist.dp_size() << ",\"cp\":" << dist.cp_size()
        << ",\"device\":\"" << cfg.device << "\",\"dtype\":\"" << cfg.dtype << "\",\"layers\":" << cfg.layers
        << ",\"heads\":" << cfg.heads << ",\"head_dim\":" << cfg.head_dim << ",\"frames\":" << cfg.frames
        << ",\"tokens\":" << cfg.tokens << ",\"batch\":" << cfg.batch << ",\"lr\":" << cfg.lr << ",\"checkpointing\":\""
        << cfg.checkpointing << "\",\"seed\":" << cfg.seed << "}\n";
    log.flush();
  }
  if (lead && cfg.print_every > 0) {
    const int64_t most = gdncp::cp::balanced_split(cfg.frames, dist.cp_size(), 0).frames,
                  least = gdncp::cp::balanced_split(cfg.frames, dist.cp_size(), dist.cp_size() - 1).frames;
    const std::string per_rank = std::to_string(most) + (most == least ? "" : " or " + std::to_string(least));
    std::printf(
        "gdncp_train: %d ranks = %d DP x %d CP on %s, %s; model L=%lld H=%lld D=%lld; video %lld frames x %lld "
        "tokens (%s frames per CP rank), batch %lld per DP group; steps %lld..%lld\n",
        dist.size(), dist.dp_size(), dist.cp_size(), cfg.device.c_str(), cfg.dtype.c_str(), (long long)cfg.layers,
        (long long)cfg.heads, (long long)cfg.head_dim, (long long)cfg.frames, (long long)cfg.tokens, per_rank.c_str(),
        (long long)cfg.batch, (long long)start + 1, (long long)cfg.steps);
  }

  Result res;
  res.first_step = start + 1;
  res.dp = dist.dp_size();
  res.cp = dist.cp_size();
  const int64_t count = cfg.batch * cfg.frames * S * C;  // elements of one DP group's batch: the mean's divisor
  const double tokens_per_step = static_cast<double>(dist.dp_size() * cfg.batch * cfg.frames * S);
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  for (int64_t step = start + 1; step <= cfg.steps; ++step) {
    const auto t0 = Clock::now();
    const int64_t k = static_cast<int64_t>(splitmix64(rng) % static_cast<uint64_t>(cfg.pool));
    const double lr = cfg.warmup > 0 ? cfg.lr * std::min(1.0, static_cast<double>(step) / cfg.warmup) : cfg.lr;
    opt.options().lr = lr;
    opt.zero_grad();
    std::vector<Tensor> empty_outs;
    const Tensor pred = forward(student, inputs[k], ctx, &empty_outs);
    double local = 0;
    if (F > 0) {
      Tensor loss = gdncp::nn::mse_loss(pred, targets[k], count);
      local = loss.item();
      gdncp::backward(loss);
    } else {  // joins the layers' backward collectives; every parameter then gets a (zero) gradient
      std::vector<Tensor> zero;
      for (const Tensor& o : empty_outs) zero.push_back(Tensor::zeros(o.shape(), o.dtype(), dev));
      if (!empty_outs.empty()) gdncp::backward(empty_outs, zero);
      for (const Tensor& p : params)
        if (!p.grad().defined()) p.meta().grad = Tensor::zeros(p.shape(), p.dtype(), dev);
    }
    dist.reduce_grads(params);
    opt.step(1.0 / dist.dp_size());
    const double global = dist.sum(local) / dist.dp_size();  // Σ over CP = the group's mean; mean over DP
    if (dev == Device::cuda) gdncp::synchronize();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    history.push_back(global);
    res.losses.push_back(global);

    const bool last = step == cfg.steps;
    if ((cfg.check_every > 0 && step % cfg.check_every == 0) || last) {
      const std::string what = "parameters after step " + std::to_string(step);
      dist.check_identical(hash_tensors(params), what.c_str());
    }
    if (lead) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
      const double per_step = elapsed / static_cast<double>(step - start);
      const double tok_s = tokens_per_step / (ms / 1000.0);
      if (cfg.print_every > 0 && (step % cfg.print_every == 0 || last || step == start + 1)) {
        std::printf("step %6lld/%lld | loss %.6f | %8.1f ms/step | %8s tok/s | ETA %s\n", (long long)step,
                    (long long)cfg.steps, global, ms, si(tok_s).c_str(), hms(per_step * (cfg.steps - step)).c_str());
        std::fflush(stdout);
      }
      if (log.is_open()) {
        char line[256];
        std::snprintf(
            line, sizeof line,
            "{\"step\":%lld,\"loss\":%.9g,\"lr\":%.6g,\"ms\":%.3f,\"tokens_per_s\":%.1f,\"batch_index\":%lld}\n",
            (long long)step, global, lr, ms, tok_s, (long long)k);
        log << line;
        log.flush();
      }
    }
    if (!cfg.save_dir.empty() && ((cfg.save_every > 0 && step % cfg.save_every == 0) || last)) {
      const std::string path = checkpoint_path(cfg.save_dir, step);
      save_checkpoint(cfg, dist, state, step, path);
      if (lead && cfg.print_every > 0) std::printf("saved %s\n", path.c_str());
      if (lead && log.is_open())
        log << "{\"event\":\"checkpoint\",\"step\":" << step << ",\"path\":\"" << json_escape(path) << "\"}\n";
    }
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  res.param_hash = hash_tensors(params);

  if (lead) {
    if (log.is_open()) {
      log << "{\"event\":\"done\",\"step\":" << cfg.steps << ",\"seconds\":" << res.seconds << "}\n";
      log.flush();
    }
    if (!plot_path.empty()) {
      char title[256];
      std::snprintf(title, sizeof title,
                    "gdncp_train: L=%lld H=%lld D=%lld, %lld frames x %lld tokens, %d DP x %d CP, %s %s",
                    (long long)cfg.layers, (long long)cfg.heads, (long long)cfg.head_dim, (long long)cfg.frames,
                    (long long)cfg.tokens, dist.dp_size(), dist.cp_size(), cfg.device.c_str(), cfg.dtype.c_str());
      const std::string why = write_atomic(plot_path, [&] {
        const std::string svg = loss_curve_svg(history, 1, title);
        return std::vector<char>(svg.begin(), svg.end());
      }());
      if (!why.empty()) std::fprintf(stderr, "gdncp_train: warning: %s\n", why.c_str());
    }
  }
  return res;
}

}  // namespace train
