// examples/train/checkpoint.cpp — serialisation, atomic write, and defensive
// reading of gdncp_train checkpoints (every length is bounds-checked against
// the file, so a truncated or corrupt file is a message, never a crash).
#include "checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "trainer.h"

namespace train {
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

std::string resolve_checkpoint(const std::string& path, std::string* why) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    *why = path + " does not exist";
    return "";
  }
  if (!fs::is_directory(path, ec)) return path;
  std::string best;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() == 18 && name.rfind("step_", 0) == 0 && name.substr(13) == ".ckpt" && name > best) best = name;
  }
  if (ec) {
    *why = "cannot list " + path + ": " + ec.message();
    return "";
  }
  if (best.empty()) {
    *why = "no step_*.ckpt checkpoint in directory " + path;
    return "";
  }
  return (fs::path(path) / best).string();
}

}  // namespace train
