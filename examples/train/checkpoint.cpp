// examples/train/checkpoint.cpp — serialisation, atomic write, and defensive
// reading of gdncp_train checkpoints (every length is bounds-checked against
// the file, so a truncated or corrupt file is a message, never a crash), and
// the trainer's state saved to and loaded from them.
#include "checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dist.h"
#include "model.h"
#include "trainer.h"

namespace train {

using gdncp::Tensor;

namespace {

constexpr char kMagic[8] = {'G', 'D', 'N', 'C', 'P', 'C', 'K', 'P'};
constexpr uint32_t kVersion = 1;

uint64_t fnv1a(const char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 1099511628211ull;
  }
  return h;
}

class Writer {
 public:
  template <typename T>
  void pod(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    out.insert(out.end(), p, p + sizeof v);
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    out.insert(out.end(), s.begin(), s.end());
  }
  void raw(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    out.insert(out.end(), c, c + n);
  }
  std::vector<char> out;
};

class Reader {
 public:
  Reader(const std::vector<char>& b, size_t end, std::string what) : b_(b), end_(end), what_(std::move(what)) {}
  void need(size_t n, const char* field) {
    if (n > end_ - pos_) throw UsageError(what_ + ": truncated or corrupt (reading " + field + ")");
  }
  template <typename T>
  T pod(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string str(const char* field) {
    const uint64_t n = pod<uint64_t>(field);
    need(n, field);
    std::string s(b_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  void raw(void* dst, size_t n, const char* field) {
    need(n, field);
    std::memcpy(dst, b_.data() + pos_, n);
    pos_ += n;
  }
  size_t pos() const { return pos_; }

 private:
  const std::vector<char>& b_;
  size_t end_, pos_ = 0;
  std::string what_;
};

}  // namespace

std::vector<char> serialize(const Checkpoint& ck) {
  Writer w;
  w.raw(kMagic, sizeof kMagic);
  w.pod(kVersion);
  w.pod<uint64_t>(ck.identity.size());
  for (const auto& kv : ck.identity) {
    w.str(kv.first);
    w.str(kv.second);
  }
  w.pod(ck.step);
  w.pod(ck.rng_state);
  w.pod(ck.optimizer_steps);
  w.pod<uint64_t>(ck.tensors.size());
  for (const auto& nt : ck.tensors) {
    const gdncp::Tensor t = nt.second.to(gdncp::Device::cpu).to(gdncp::DType::f32);
    w.str(nt.first);
    w.pod<uint64_t>(t.shape().size());
    for (int64_t d : t.shape()) w.pod(d);
    w.raw(t.data(), t.nbytes());
  }
  w.pod<uint64_t>(ck.losses.size());
  for (double l : ck.losses) w.pod(l);
  const uint64_t sum = fnv1a(w.out.data(), w.out.size());
  w.pod(sum);
  return std::move(w.out);
}

Checkpoint deserialize(const std::vector<char>& bytes, const std::string& what) {
  if (bytes.size() < sizeof kMagic + sizeof(uint32_t) + sizeof(uint64_t) ||
      std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    throw UsageError(what + ": not a gdncp_train checkpoint (bad magic)");
  const size_t body = bytes.size() - sizeof(uint64_t);
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + body, sizeof stored);
  if (stored != fnv1a(bytes.data(), body)) throw UsageError(what + ": corrupt (checksum mismatch)");
  Reader r(bytes, body, what);
  char magic[sizeof kMagic];
  r.raw(magic, sizeof magic, "magic");
  const uint32_t version = r.pod<uint32_t>("version");
  if (version != kVersion)
    throw UsageError(what + ": checkpoint version " + std::to_string(version) + ", this program reads version " +
                     std::to_string(kVersion));
  Checkpoint ck;
  const uint64_t n_id = r.pod<uint64_t>("identity count");
  for (uint64_t i = 0; i < n_id; ++i) {
    std::string k = r.str("identity key");
    ck.identity.emplace_back(std::move(k), r.str("identity value"));
  }
  ck.step = r.pod<int64_t>("step");
  ck.rng_state = r.pod<uint64_t>("rng state");
  ck.optimizer_steps = r.pod<int64_t>("optimizer steps");
  const uint64_t n_t = r.pod<uint64_t>("tensor count");
  for (uint64_t i = 0; i < n_t; ++i) {
    std::string name = r.str("tensor name");
    const uint64_t ndim = r.pod<uint64_t>("tensor rank");
    if (ndim > 8) throw UsageError(what + ": corrupt (tensor " + name + " has rank " + std::to_string(ndim) + ")");
    gdncp::Shape shape;
    uint64_t numel = 1;
    for (uint64_t d = 0; d < ndim; ++d) {
      const int64_t n = r.pod<int64_t>("tensor shape");
      if (n < 0 || (n > 0 && numel > (uint64_t(1) << 40) / static_cast<uint64_t>(n)))
        throw UsageError(what + ": corrupt (tensor " + name + " has a bad shape)");
      shape.push_back(n);
      numel *= static_cast<uint64_t>(n);
    }
    r.need(numel * sizeof(float), "tensor data");
    gdncp::Tensor t = gdncp::Tensor::empty(shape, gdncp::DType::f32);
    r.raw(t.data(), t.nbytes(), "tensor data");
    ck.tensors.emplace_back(std::move(name), t);
  }
  const uint64_t n_l = r.pod<uint64_t>("loss count");
  r.need(n_l * sizeof(double), "losses");
  for (uint64_t i = 0; i < n_l; ++i) ck.losses.push_back(r.pod<double>("losses"));
  if (r.pos() != body) throw UsageError(what + ": corrupt (trailing bytes)");
  return ck;
}

std::string write_atomic(const std::string& path, const std::vector<char>& bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir = fs::path(path).parent_path();
  if (!dir.empty()) fs::create_directories(dir, ec);
  if (ec) return "cannot create directory " + dir.string() + ": " + ec.message();
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return "cannot open " + tmp + ": " + std::strerror(errno);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return "cannot write " + tmp + ": " + why;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return "cannot flush " + tmp + ": " + std::strerror(errno);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return "cannot rename " + tmp + " to " + path + ": " + why;
  }
  return "";
}

std::string read_file(const std::string& path, std::vector<char>& bytes) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return "cannot read " + path + ": not a regular file";
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot open " + path + ": " + std::strerror(errno);
  in.seekg(0, std::ios::end);
  const std::streamoff n = in.tellg();
  if (n < 0) return "cannot read " + path;
  in.seekg(0);
  bytes.resize(static_cast<size_t>(n));
  if (n > 0 && !in.read(bytes.data(), n)) return "cannot read " + path + ": short read";
  return "";
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step_%08lld.ckpt", static_cast<long long>(step));
  return (std::filesystem::path(dir) / name).string();
}

std::vector<std::string> checkpoint_candidates(const std::string& path, std::string* why) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    *why = path + " does not exist";
    return {};
  }
  if (!fs::is_directory(path, ec)) return {path};
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() == 18 && name.rfind("step_", 0) == 0 && name.substr(13) == ".ckpt") names.push_back(name);
  }
  if (ec) {
    *why = "cannot list " + path + ": " + ec.message();
    return {};
  }
  if (names.empty()) {
    *why = "no step_*.ckpt checkpoint in directory " + path;
    return {};
  }
  std::sort(names.rbegin(), names.rend());  // 8-digit steps: newest first
  std::vector<std::string> paths;
  for (const std::string& n : names) paths.push_back((fs::path(path) / n).string());
  return paths;
}

std::vector<std::string> remove_stale_temps(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return removed;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() == 22 && name.rfind("step_", 0) == 0 && name.substr(13) == ".ckpt.tmp" && fs::remove(e.path(), ec))
      removed.push_back(e.path().string());
  }
  return removed;
}

// --- the trainer's state ------------------------------------------------------------------
// "5" or, with packed clips, "5 = 2,2,1": a run resumes only with the same packing.
std::string frames_identity(const Config& c) {
  std::string s = std::to_string(c.frames);
  for (size_t k = 0; k < c.clips.size(); ++k) s += (k == 0 ? " = " : ",") + std::to_string(c.clips[k]);
  return s;
}

std::vector<std::pair<std::string, std::string>> run_identity(const Config& c) {
  return {{"layers", std::to_string(c.layers)},
          {"heads", std::to_string(c.heads)},
          {"head-dim", std::to_string(c.head_dim)},
          {"frames", frames_identity(c)},
          {"tokens", std::to_string(c.tokens)},
          {"batch", std::to_string(c.batch)},
          {"pool", std::to_string(c.pool)},
          {"seed", std::to_string(c.seed)},
          {"dtype", c.dtype}};
}

std::vector<std::pair<std::string, std::string>> run_layout(const Dist& d) {
  return {{"cp", std::to_string(d.cp_size())}, {"dp", std::to_string(d.dp_size())}};
}

void save_checkpoint(const Config& c, const Dist& dist, const TrainState& st, int64_t step, const std::string& path) {
  std::vector<char> status;  // rank 0's error message, empty when the save worked
  if (dist.rank() == 0) {
    Checkpoint ck;
    ck.identity = run_identity(c);
    for (const auto& kv : run_layout(dist)) ck.identity.push_back(kv);  // recorded, not checked on resume
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

Resumed load_checkpoint(const Config& c, const Dist& dist, const TrainState& st) {
  std::vector<char> status, bytes;
  Resumed res;
  std::string& path = res.path;
  if (dist.rank() == 0) {
    // Newest first; an unreadable or corrupt file is skipped for the next.
    std::string why;
    const std::vector<std::string> candidates = checkpoint_candidates(c.resume, &why);
    for (const std::string& cand : candidates) {
      why = read_file(cand, bytes);
      if (why.empty()) {
        try {
          deserialize(bytes, "checkpoint " + cand);
          path = cand;
          break;
        } catch (const UsageError& e) {
          why = e.what();
        }
      }
      res.skipped.push_back(why);
    }
    std::string error;
    if (candidates.empty()) {
      error = "--resume " + c.resume + ": " + why;
    } else if (path.empty()) {
      error = "--resume " + c.resume + ": no usable checkpoint:";
      for (const std::string& s : res.skipped) error += " " + s + ";";
    }
    status.assign(error.begin(), error.end());
  }
  dist.broadcast_bytes(status);
  if (!status.empty()) throw UsageError(std::string(status.begin(), status.end()));
  std::vector<char> name(path.begin(), path.end());
  dist.broadcast_bytes(name);
  path.assign(name.begin(), name.end());
  std::string skipped;  // the skips, one a line: every rank reports the same
  for (const std::string& why : res.skipped) skipped += why + "\n";
  std::vector<char> lines(skipped.begin(), skipped.end());
  dist.broadcast_bytes(lines);
  res.skipped.clear();
  std::istringstream in(std::string(lines.begin(), lines.end()));
  for (std::string line; std::getline(in, line);) res.skipped.push_back(line);
  dist.broadcast_bytes(bytes);

  // From here every rank parses the same bytes: errors are the same everywhere.
  const Checkpoint ck = deserialize(bytes, "checkpoint " + path);
  const auto want = run_identity(c);
  for (const auto& kv : run_layout(dist)) {  // the layout it was written with ("?" before it was recorded)
    auto it = std::find_if(ck.identity.begin(), ck.identity.end(), [&](const auto& p) { return p.first == kv.first; });
    res.layout.emplace_back(kv.first, it == ck.identity.end() ? "?" : it->second);
  }
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
  res.step = ck.step;
  return res;
}

}  // namespace train
