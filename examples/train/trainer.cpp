// examples/train/trainer.cpp — flags, data, the training loop and logging
// (see trainer.h for the model and the rank layout; checkpoint.cpp saves and
// loads the state).
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
// Note [layout]: a checkpoint records the rank layout it was written with
// (--cp, --dp) but does not depend on it: the parameters, the optimizer state,
// the RNG and the loss history are the same on every rank. So a run resumes on
// any other layout. A different CP degree computes the same model on the same
// videos (each frame's data depends only on the global frame); with
// --deterministic the layer's results, the gradients and the losses are bitwise
// those of the uninterrupted run. A different DP degree changes which videos
// each step sees (the videos of a DP group depend on its index and the DP
// degree; --batch is per DP group), so the run continues on other data; the
// trainer says so and proceeds.
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
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>

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
  bool is_switch = false;  // "--name" alone means "--name=1"
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

// A switch: --name (on), or --name=1|0|true|false.
Flag switch_flag(const std::string& name, const std::string& help, bool Config::*field) {
  return {name, help,
          [=](Config& c, const std::string& v) {
            if (v == "1" || v == "true")
              c.*field = true;
            else if (v == "0" || v == "false")
              c.*field = false;
            else
              throw UsageError("--" + name + ": expected no value, 1, 0, true or false, got '" + v + "'");
          },
          [=](const Config& c) { return std::string(c.*field ? "on" : "off"); }, true};
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
      switch_flag("deterministic",
                  "the layer's deterministic mode: losses and parameters bitwise the same for every --cp (a run "
                  "resumed on another --cp continues bitwise)",
                  &Config::deterministic),
      switch_flag("overlap-exchange",
                  "CUDA: the CP layer's all-gather exchange runs on a communication stream beside the sweeps it "
                  "does not read (bitwise the same results; log and hierarchical exchanges and CPU runs unchanged)",
                  &Config::overlap_exchange),
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

// a·b of sizes given by flags, or a UsageError naming them.
int64_t mul(int64_t a, int64_t b, const std::string& flags) {
  try {
    return gdncp::checked_mul(a, b, flags.c_str());
  } catch (const gdncp::Error&) {
    throw UsageError(flags + ": too large: " + std::to_string(a) + " × " + std::to_string(b) +
                     " overflows a 64-bit count");
  }
}

// The sizes the flags imply, computed without overflow, and the data set
// (held for the whole run) against the host's memory: a run that cannot fit
// stops here with the flags named, not in an allocation after start-up.
void check_sizes(const Config& c) {
  const std::string data_flags = "--pool × --batch × --frames × --tokens × --heads × --head-dim";
  const int64_t C = mul(c.heads, c.head_dim, "--heads × --head-dim");
  const int64_t tokens = mul(mul(c.batch, c.frames, "--batch × --frames"), c.tokens, "--batch × --frames × --tokens");
  mul(tokens, C, "--batch × --frames × --tokens × --heads × --head-dim");
  const int64_t per_rank = mul(mul(c.pool, tokens / c.cp, data_flags), C, data_flags);
  const int64_t bytes = mul(per_rank, 2 * (c.dtype == "bf16" ? 2 : 4), data_flags);  // latents and targets
  mul(mul(c.layers, mul(C, 4 * C, "--heads × --head-dim"), "--layers × (--heads × --head-dim)²"), 16,
      "--layers × (--heads × --head-dim)²");  // parameters, teacher and AdamW moments (f32)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (c.device == "cpu" && pages > 0 && page > 0 && bytes / page > pages)
    throw UsageError(data_flags + ": the data set needs " + std::to_string(bytes) + " bytes per rank (" +
                     std::to_string(c.pool) + " × " + std::to_string(c.batch) + " × " +
                     std::to_string(c.frames / c.cp) + " × " + std::to_string(c.tokens) + " × " + std::to_string(C) +
                     " values, inputs and targets), more than this host's " + std::to_string(int64_t(pages) * page) +
                     " bytes of memory");
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
  if (c.save_every > 0 && c.save_dir.empty())
    throw UsageError("--save-every " + std::to_string(c.save_every) +
                     ": needs --save-dir (the directory the checkpoints go to)");
  if (c.device == "cuda" && !gdncp::cuda_available())
    throw UsageError("--device cuda: no CUDA device is visible (or gdncp was built without CUDA)");
  check_sizes(c);
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

}  // namespace

std::string default_plot_path(const Config& c) {
  if (!c.plot_path.empty() || c.log_path.empty()) return c.plot_path;
  // Beside the log only when the log is (or will be) a regular file: not
  // beside /dev/stdout, /dev/full or a pipe.
  std::error_code ec;
  const std::filesystem::file_status s = std::filesystem::status(c.log_path, ec);
  if (std::filesystem::exists(s) && !std::filesystem::is_regular_file(s)) return "";
  return (std::filesystem::path(c.log_path).parent_path() / "loss.svg").string();
}

namespace {

// Writes text to the log and flushes it: a failed write (a full disk) is an
// error naming the file, not a log silently cut short.
void log_write(std::ofstream& log, const std::string& path, const std::string& text) {
  errno = 0;
  log << text;
  log.flush();
  if (!log)
    throw std::runtime_error("--log " + path +
                             ": cannot write the log: " + (errno ? std::strerror(errno) : "the stream failed"));
}

// The clips of the run as a JSON array ([] = one clip per video).
std::string clips_json(const Config& c) {
  std::string s = "[";
  for (size_t i = 0; i < c.clips.size(); ++i) s += (i ? "," : "") + std::to_string(c.clips[i]);
  return s + "]";
}

// "" when a file can be written at path (its directory is made if missing;
// an existing file is left as it is), else the reason.
std::string probe_writable(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return path + " is a directory";
  const fs::path dir = fs::path(path).parent_path();
  if (!dir.empty()) fs::create_directories(dir, ec);
  if (ec) return "cannot create directory " + dir.string() + ": " + ec.message();
  const bool existed = fs::exists(path, ec);
  std::ofstream f(path, std::ios::app);
  if (!f) return "cannot open " + path + " for writing: " + std::strerror(errno);
  f.close();
  if (!existed) fs::remove(path, ec);
  return "";
}

// Every path flag, checked on rank 0 before the model and the data set are
// built; the first problem becomes a UsageError naming the flag on every rank.
// Also removes the temporary files of an interrupted save (reported).
void check_paths(const Config& c, const Dist& dist) {
  namespace fs = std::filesystem;
  std::string error;
  if (dist.rank() == 0) {
    std::error_code ec;
    if (!c.save_dir.empty()) {
      if (fs::exists(c.save_dir, ec) && !fs::is_directory(c.save_dir, ec))
        error = "--save-dir " + c.save_dir + ": exists and is not a directory";
      else if (const std::string why = probe_writable((fs::path(c.save_dir) / ".gdncp_train_probe").string());
               !why.empty())
        error = "--save-dir " + c.save_dir + ": cannot write checkpoints there: " + why;
    }
    if (error.empty() && !c.log_path.empty())
      if (const std::string why = probe_writable(c.log_path); !why.empty()) error = "--log " + c.log_path + ": " + why;
    const std::string plot = default_plot_path(c);
    if (error.empty() && !plot.empty())
      if (const std::string why = probe_writable(plot); !why.empty())
        error = std::string(c.plot_path.empty() ? "--plot (default, beside --log) " : "--plot ") + plot + ": " + why;
    if (error.empty() && !c.resume.empty()) {
      std::string why;
      if (checkpoint_candidates(c.resume, &why).empty()) error = "--resume " + c.resume + ": " + why;
    }
    if (error.empty()) {
      std::vector<std::string> dirs = {c.save_dir};
      if (!c.resume.empty() && fs::is_directory(c.resume, ec) && fs::path(c.resume) != fs::path(c.save_dir))
        dirs.push_back(c.resume);
      for (const std::string& d : dirs)
        for (const std::string& f : remove_stale_temps(d))
          std::fprintf(stderr, "gdncp_train: removed %s (left by an interrupted save)\n", f.c_str());
    }
  }
  std::vector<char> status(error.begin(), error.end());
  dist.broadcast_bytes(status);
  if (!status.empty()) throw UsageError(std::string(status.begin(), status.end()));
}

// The log of a resumed run continues the interrupted one: its records of
// steps after the checkpoint (run again now) are dropped first, so no step is
// logged twice.
std::string trim_log(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return "";  // no log yet
  std::string kept, line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"step\":");
    if (at != std::string::npos && std::strtoll(line.c_str() + at + 7, nullptr, 10) > step) continue;
    kept += line + "\n";
  }
  in.close();
  return write_atomic(path, std::vector<char>(kept.begin(), kept.end()));
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

}  // namespace

// --- public --------------------------------------------------------------------------------

std::string usage() {
  const Config d;
  std::ostringstream o;
  o << "gdncp_train — trains a small BiGDN video model against a fixed teacher, across ranks.\n\n"
       "usage: mpirun -np <ranks> gdncp_train [--flag value | --flag=value]...\n"
       "  ranks = DP x CP: consecutive ranks form a context-parallel group (--cp) that splits each\n"
       "  video's frames; the groups are data-parallel replicas training on different videos.\n\n";
  const auto name = [](const std::string& flag) {  // the flags' column, the longest name and a space wide
    char line[64];
    std::snprintf(line, sizeof line, "  --%-17s", flag.c_str());
    return std::string(line);
  };
  for (const Flag& f : flags()) o << name(f.name) << f.help << " [" << f.get(d) << "]\n";
  o << name("help") << "this text\n";
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
      const Flag* f = find_flag(a);
      if (!f) throw UsageError("unknown flag --" + a + " (see --help)");
      if (f->is_switch) {
        value = "1";
      } else {
        if (i + 1 >= argc) throw UsageError("--" + a + ": missing value");
        value = argv[++i];
      }
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
  check_paths(cfg, dist);

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
  ctx.options.deterministic = cfg.deterministic;
  ctx.cp_options.overlap_exchange = cfg.overlap_exchange;
  FrameGrads frame_grads;  // --deterministic: the projections' weight gradients in frame order
  if (cfg.deterministic) ctx.frame_grads = &frame_grads;

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
  Result res;
  if (!cfg.resume.empty()) {
    const Resumed r = load_checkpoint(cfg, dist, state);
    res.resumed_from = r.path;
    res.skipped_checkpoints = r.skipped;
    res.first_step = r.step + 1;
    if (lead)
      for (const std::string& why : r.skipped)
        std::fprintf(stderr, "gdncp_train: warning: --resume: skipped %s; resuming from %s\n", why.c_str(),
                     r.path.c_str());
    // Note [layout]: another layout resumes; a DP change changes the data order.
    for (const auto& kv : r.layout) (kv.first == "dp" ? res.resumed_dp : res.resumed_cp) = std::atoi(kv.second.c_str());
    if (lead && res.resumed_cp > 0 && res.resumed_cp != dist.cp_size())
      std::fprintf(stderr, "gdncp_train: note: --resume: %s was written with --cp %d; continuing on --cp %d%s\n",
                   r.path.c_str(), res.resumed_cp, dist.cp_size(),
                   cfg.deterministic ? " (bitwise as the uninterrupted run)" : "");
    if (lead && res.resumed_dp > 0 && res.resumed_dp != dist.dp_size())
      std::fprintf(stderr,
                   "gdncp_train: note: --resume: %s was written with %d data-parallel groups, this run has %d: the "
                   "videos each step draws change from here (the data order), the model and optimizer state carry "
                   "over\n",
                   r.path.c_str(), res.resumed_dp, dist.dp_size());
  }
  const int64_t start = res.first_step - 1;

  const std::string plot_path = default_plot_path(cfg);
  std::ofstream log;
  if (lead && !cfg.log_path.empty()) {
    std::error_code ec;
    const auto dir = std::filesystem::path(cfg.log_path).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);
    if (start > 0) {
      const std::string why = trim_log(cfg.log_path, start);
      if (!why.empty()) std::fprintf(stderr, "gdncp_train: warning: --log: %s\n", why.c_str());
    }
    log.open(cfg.log_path, start > 0 ? std::ios::app : std::ios::trunc);
    if (!log) throw std::runtime_error("--log " + cfg.log_path + ": cannot open the log: " + std::strerror(errno));
    std::ostringstream e;
    e << "{\"event\":\"" << (start > 0 ? "resume" : "start") << "\",\"step\":" << start << ",\"ranks\":" << dist.size()
      << ",\"dp\":" << dist.dp_size() << ",\"cp\":" << dist.cp_size() << ",\"frames_per_cp_rank\":[";
    for (int r = 0; r < dist.cp_size(); ++r)
      e << (r ? "," : "") << gdncp::cp::balanced_split(cfg.frames, dist.cp_size(), r).frames;
    e << "],\"device\":\"" << cfg.device << "\",\"dtype\":\"" << cfg.dtype << "\",\"layers\":" << cfg.layers
      << ",\"heads\":" << cfg.heads << ",\"head_dim\":" << cfg.head_dim << ",\"frames\":" << cfg.frames
      << ",\"clips\":" << clips_json(cfg) << ",\"tokens\":" << cfg.tokens << ",\"batch\":" << cfg.batch
      << ",\"lr\":" << cfg.lr << ",\"checkpointing\":\"" << cfg.checkpointing << "\",\"seed\":" << cfg.seed
      << ",\"deterministic\":" << (cfg.deterministic ? "true" : "false")
      << ",\"overlap_exchange\":" << (cfg.overlap_exchange ? "true" : "false");
    if (start > 0)
      e << ",\"checkpoint\":\"" << json_escape(res.resumed_from)
        << "\",\"skipped_checkpoints\":" << res.skipped_checkpoints.size();
    e << "}\n";
    log_write(log, cfg.log_path, e.str());
  }
  if (lead && cfg.print_every > 0) {
    const int64_t most = gdncp::cp::balanced_split(cfg.frames, dist.cp_size(), 0).frames,
                  least = gdncp::cp::balanced_split(cfg.frames, dist.cp_size(), dist.cp_size() - 1).frames;
    const std::string per_rank = std::to_string(most) + (most == least ? "" : " or " + std::to_string(least));
    std::printf(
        "gdncp_train: %d ranks = %d DP x %d CP on %s, %s; model L=%lld H=%lld D=%lld; video %lld frames x %lld "
        "tokens (%s frames per CP rank), clips %s; batch %lld per DP group; steps %lld..%lld\n",
        dist.size(), dist.dp_size(), dist.cp_size(), cfg.device.c_str(), cfg.dtype.c_str(), (long long)cfg.layers,
        (long long)cfg.heads, (long long)cfg.head_dim, (long long)cfg.frames, (long long)cfg.tokens, per_rank.c_str(),
        cfg.clips.empty() ? "one per video" : join(cfg.clips).c_str(), (long long)cfg.batch, (long long)start + 1,
        (long long)cfg.steps);
  }

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
      local = cfg.deterministic ? 0.0 : loss.item();
      gdncp::backward(loss);
    } else {  // joins the layers' backward collectives; every parameter then gets a (zero) gradient
      std::vector<Tensor> zero;
      for (const Tensor& o : empty_outs) zero.push_back(Tensor::zeros(o.shape(), o.dtype(), dev));
      if (!empty_outs.empty()) gdncp::backward(empty_outs, zero);
      for (const Tensor& p : params)
        if (!p.grad().defined()) Tensor(p).set_grad(Tensor::zeros(p.shape(), p.dtype(), dev));
    }
    if (cfg.deterministic) {  // sums over the CP group's tokens in global frame order (frame_grads.h)
      local = frame_ordered_loss(pred, targets[k], F, S, count, dist);
      frame_grads.reduce(student.projections(), dist);
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
        log_write(log, cfg.log_path, line);
      }
    }
    if (!cfg.save_dir.empty() && ((cfg.save_every > 0 && step % cfg.save_every == 0) || last)) {
      const std::string path = checkpoint_path(cfg.save_dir, step);
      save_checkpoint(cfg, dist, state, step, path);
      if (lead && cfg.print_every > 0) std::printf("saved %s\n", path.c_str());
      if (lead && log.is_open())
        log_write(log, cfg.log_path,
                  "{\"event\":\"checkpoint\",\"step\":" + std::to_string(step) + ",\"path\":\"" + json_escape(path) +
                      "\"}\n");
    }
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  res.param_hash = hash_tensors(params);

  if (lead) {
    if (log.is_open()) {
      std::ostringstream e;
      e << "{\"event\":\"done\",\"step\":" << cfg.steps << ",\"seconds\":" << res.seconds << "}\n";
      log_write(log, cfg.log_path, e.str());
      log.close();
      if (!log) throw std::runtime_error("--log " + cfg.log_path + ": cannot close the log: " + std::strerror(errno));
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
      if (!why.empty()) throw std::runtime_error("--plot " + plot_path + ": " + why);
    }
  }
  return res;
}

}  // namespace train
