// gdncp/error.h — the one error type of the library and the checks that raise it.
//
// Every public entry validates its arguments before any work is launched and
// throws gdncp::Error whose message names the argument and says why
// (docs/design.md §9). Failures of CUDA, cuBLAS, NCCL and MPI calls surface as the same
// exception, naming the failed call. Nothing here aborts the process.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace gdncp {

// The only exception type gdncp throws. what() reads "file:line: message",
// the file relative to the source root (src/kernels/x.cpp).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}

// __FILE__ as the build gave it, less leading "./" and "../": the build maps
// the source root away (-ffile-prefix-map), a compiler cache may leave the
// path relative to the build directory instead.
inline const char* source_relative(const char* file) {
  for (;;) {
    if (file[0] == '.' && file[1] == '/')
      file += 2;
    else if (file[0] == '.' && file[1] == '.' && file[2] == '/')
      file += 3;
    else
      return file;
  }
}

template <typename... Args>
[[noreturn]] void fail(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  os << source_relative(file) << ":" << line << ": ";
  append(os, args...);
  throw Error(os.str());
}

}  // namespace detail

// The overflow test of every product of sizes (extents, element counts, byte
// counts) before it sizes an allocation or an offset: true when a·b does not
// fit in int64, else false with *r = a·b.
inline bool mul_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

// a·b for sizes a, b >= 0, or a gdncp::Error naming `what` when the product
// does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0) detail::fail(__FILE__, __LINE__, what, ": negative size in ", a, " × ", b);
  if (mul_overflows(a, b, &r))
    detail::fail(__FILE__, __LINE__, what, ": ", a, " × ", b, " overflows int64 (more than 2^63 - 1)");
  return r;
}

}  // namespace gdncp

// GDNCP_CHECK(cond, msg...) throws gdncp::Error("file:line: msg...") when cond is false.
// The message parts are streamed, so GDNCP_CHECK(n > 0, "qkv: N must be > 0, got ", n) works.
#define GDNCP_CHECK(cond, ...)                                           \
  do {                                                                   \
    if (!(cond)) ::gdncp::detail::fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define GDNCP_FAIL(...) ::gdncp::detail::fail(__FILE__, __LINE__, __VA_ARGS__)

// Checks of library calls. Each evaluates its argument once and throws
// gdncp::Error naming the call (the expression text) and the library's reason.
// The macros expand to the library's own error-string function, so they may be
// used only where that library's header is included; error.h itself includes none.
#define GDNCP_CUDA_CHECK(expr)                                                                                        \
  do {                                                                                                                \
    const cudaError_t gdncp_err_ = (expr);                                                                            \
    if (gdncp_err_ != cudaSuccess)                                                                                    \
      ::gdncp::detail::fail(__FILE__, __LINE__, "CUDA call ", #expr, " failed: ", cudaGetErrorName(gdncp_err_), " (", \
                            cudaGetErrorString(gdncp_err_), ")");                                                     \
  } while (0)

// After a kernel launch: reports a launch error (configuration, shared memory, no image for
// the device) naming the kernel and the launch site. kernel_name is any streamable value, so
// a name chosen at run time is reported too.
#define GDNCP_CUDA_CHECK_LAUNCH(kernel_name)                                                                           \
  do {                                                                                                                 \
    const cudaError_t gdncp_err_ = cudaGetLastError();                                                                 \
    if (gdncp_err_ != cudaSuccess)                                                                                     \
      ::gdncp::detail::fail(__FILE__, __LINE__, "CUDA kernel ", kernel_name,                                           \
                            " failed to launch: ", cudaGetErrorName(gdncp_err_), " (", cudaGetErrorString(gdncp_err_), \
                            ")");                                                                                      \
  } while (0)

#define GDNCP_CUBLAS_CHECK(expr)                                                                                    \
  do {                                                                                                              \
    const cublasStatus_t gdncp_st_ = (expr);                                                                        \
    if (gdncp_st_ != CUBLAS_STATUS_SUCCESS)                                                                         \
      ::gdncp::detail::fail(__FILE__, __LINE__, "cuBLAS call ", #expr, " failed: ", cublasGetStatusName(gdncp_st_), \
                            " (", cublasGetStatusString(gdncp_st_), ")");                                           \
  } while (0)

#define GDNCP_NCCL_CHECK(expr)                                                                                    \
  do {                                                                                                            \
    const ncclResult_t gdncp_nr_ = (expr);                                                                        \
    if (gdncp_nr_ != ncclSuccess && gdncp_nr_ != ncclInProgress)                                                  \
      ::gdncp::detail::fail(__FILE__, __LINE__, "NCCL call ", #expr, " failed: ", ncclGetErrorString(gdncp_nr_)); \
  } while (0)

#define GDNCP_MPI_CHECK(expr)                                                                       \
  do {                                                                                              \
    const int gdncp_mr_ = (expr);                                                                   \
    if (gdncp_mr_ != MPI_SUCCESS) {                                                                 \
      char gdncp_msg_[MPI_MAX_ERROR_STRING];                                                        \
      int gdncp_len_ = 0;                                                                           \
      MPI_Error_string(gdncp_mr_, gdncp_msg_, &gdncp_len_);                                         \
      ::gdncp::detail::fail(__FILE__, __LINE__, "MPI call ", #expr,                                 \
                            " failed: ", std::string(gdncp_msg_, static_cast<size_t>(gdncp_len_))); \
    }                                                                                               \
  } while (0)
