// src/kernels/camera/cam_ref.cpp — CPU twins of the camera-branch kernels (phase A and
// the numerator output), forward and backward side by side, templated on
// float and double. q, k, v are (B, H, D, N): token n of head bh is the column
// x[bh][:, n]. Inputs of any float dtype are read through the compute dtype.
//
// Gradient rule: every output is overwritten (activation gradients).
#include <vector>

#include "gdncp/error.h"
#include "kernels/cp_kernels.h"

namespace gdncp {
namespace cp {
namespace cpu {
namespace {

template <typename T>
Tensor as(const Tensor& t) {
  return t.dtype() == dtype_of<T>::value ? t : t.to(dtype_of<T>::value);
}

// Writes a compute-dtype host buffer into dst (dst's dtype).
template <typename T>
void store(Tensor& dst, const std::vector<T>& v) {
  Tensor tmp = Tensor::empty(dst.shape(), dtype_of<T>::value);
  std::copy(v.begin(), v.end(), tmp.data_ptr<T>());
  if (dst.dtype() == tmp.dtype())
    dst.copy_from(tmp);
  else
    dst.copy_from(tmp.to(dst.dtype()));
}

template <typename T>
T beta_at(const T* b, const CamDims& d, int64_t bh, int64_t f, int64_t s) {
  return d.beta_per_frame ? b[bh * d.F + f] : b[(bh * d.F + f) * d.S + s];
}

template <typename T>
void phase_a_fwd(Tensor& Pc, Tensor& Ac, const Tensor& k_in, const Tensor& v_in, const Tensor& beta_in,
                 const CamDims& d) {
  const Tensor kt = as<T>(k_in), vt = as<T>(v_in), bt = as<T>(beta_in);
  const T* k = kt.data_ptr<T>();
  const T* v = vt.data_ptr<T>();
  const T* b = bt.data_ptr<T>();
  T* pc = Pc.data_ptr<T>();
  T* ac = Ac.data_ptr<T>();
  const int64_t D = d.D, N = d.N(), DD = D * D;
  for (int64_t bh = 0; bh < d.BH(); ++bh)
    for (int64_t f = 0; f < d.F; ++f) {
      T* p = pc + (bh * d.F + f) * DD;
      T* a = ac + (bh * d.F + f) * DD;
      const T* kb = k + bh * D * N;
      const T* vb = v + bh * D * N;
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) {
          T sp = 0, sa = 0;
          for (int64_t s = 0; s < d.S; ++s) {
            const int64_t n = f * d.S + s;
            const T bk = beta_at(b, d, bh, f, s) * kb[i * N + n];
            sp += bk * kb[j * N + n];
            sa += bk * vb[j * N + n];
          }
          p[i * D + j] = sp;
          a[i * D + j] = sa;
        }
    }
}

template <typename T>
void phase_a_bwd(Tensor& dk, Tensor& dv, Tensor& dbeta, const Tensor& dPc_in, const Tensor& dAc_in, const Tensor& k_in,
                 const Tensor& v_in, const Tensor& beta_in, const CamDims& d) {
  const Tensor kt = as<T>(k_in), vt = as<T>(v_in), bt = as<T>(beta_in);
  const T* k = kt.data_ptr<T>();
  const T* v = vt.data_ptr<T>();
  const T* b = bt.data_ptr<T>();
  const T* dpc = dPc_in.data_ptr<T>();
  const T* dac = dAc_in.data_ptr<T>();
  const int64_t D = d.D, N = d.N(), DD = D * D;
  std::vector<T> gk(static_cast<size_t>(d.BH() * D * N)), gv(gk.size());
  std::vector<T> gb(static_cast<size_t>(beta_in.numel()), T(0));
  for (int64_t bh = 0; bh < d.BH(); ++bh)
    for (int64_t f = 0; f < d.F; ++f) {
      const T* dp = dpc + (bh * d.F + f) * DD;
      const T* da = dac + (bh * d.F + f) * DD;
      const T* kb = k + bh * D * N;
      const T* vb = v + bh * D * N;
      for (int64_t s = 0; s < d.S; ++s) {
        const int64_t n = f * d.S + s;
        const T beta = beta_at(b, d, bh, f, s);
        T db = 0;
        for (int64_t i = 0; i < D; ++i) {
          T sk = 0, sv = 0, sdb = 0;
          for (int64_t j = 0; j < D; ++j) {
            const T kj = kb[j * N + n], vj = vb[j * N + n];
            sk += (dp[i * D + j] + dp[j * D + i]) * kj + da[i * D + j] * vj;
            sv += da[j * D + i] * kb[j * N + n];
            sdb += dp[i * D + j] * kj + da[i * D + j] * vj;
          }
          gk[static_cast<size_t>((bh * D + i) * N + n)] = beta * sk;
          gv[static_cast<size_t>((bh * D + i) * N + n)] = beta * sv;
          db += kb[i * N + n] * sdb;
        }
        if (d.beta_per_frame)
          gb[static_cast<size_t>(bh * d.F + f)] += db;
        else
          gb[static_cast<size_t>((bh * d.F + f) * d.S + s)] = db;
      }
    }
  store(dk, gk);
  store(dv, gv);
  store(dbeta, gb);
}

template <typename T>
void out_fwd(Tensor& out, const Tensor& q_in, const Tensor& M, const CamDims& d) {
  const Tensor qt = as<T>(q_in);
  const T* q = qt.data_ptr<T>();
  const T* m = M.data_ptr<T>();
  const int64_t D = d.D, N = d.N(), DD = D * D;
  std::vector<T> o(static_cast<size_t>(d.BH() * D * N));
  for (int64_t bh = 0; bh < d.BH(); ++bh)
    for (int64_t n = 0; n < N; ++n) {
      const T* mf = m + (bh * d.F + n / d.S) * DD;
      for (int64_t j = 0; j < D; ++j) {
        T acc = 0;
        for (int64_t i = 0; i < D; ++i) acc += mf[i * D + j] * q[(bh * D + i) * N + n];
        o[static_cast<size_t>((bh * D + j) * N + n)] = acc;
      }
    }
  store(out, o);
}

template <typename T>
void out_bwd(Tensor& dq, Tensor& dM, const Tensor& dout_in, const Tensor& q_in, const Tensor& M, const CamDims& d) {
  const Tensor qt = as<T>(q_in), gt = as<T>(dout_in);
  const T* q = qt.data_ptr<T>();
  const T* go = gt.data_ptr<T>();
  const T* m = M.data_ptr<T>();
  T* dm = dM.data_ptr<T>();
  const int64_t D = d.D, N = d.N(), DD = D * D;
  std::vector<T> gq(static_cast<size_t>(d.BH() * D * N));
  for (int64_t bh = 0; bh < d.BH(); ++bh)
    for (int64_t f = 0; f < d.F; ++f) {
      const T* mf = m + (bh * d.F + f) * DD;
      T* dmf = dm + (bh * d.F + f) * DD;
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) {
          T acc = 0;
          for (int64_t s = 0; s < d.S; ++s) {
            const int64_t n = f * d.S + s;
            acc += q[(bh * D + i) * N + n] * go[(bh * D + j) * N + n];
          }
          dmf[i * D + j] = acc;
        }
      for (int64_t s = 0; s < d.S; ++s) {
        const int64_t n = f * d.S + s;
        for (int64_t i = 0; i < D; ++i) {
          T acc = 0;
          for (int64_t j = 0; j < D; ++j) acc += mf[i * D + j] * go[(bh * D + j) * N + n];
          gq[static_cast<size_t>((bh * D + i) * N + n)] = acc;
        }
      }
    }
  store(dq, gq);
}

bool f64(const Tensor& t) { return t.dtype() == DType::f64; }

}  // namespace

void cam_phase_a_fwd(Tensor& Pc, Tensor& Ac, const Tensor& k, const Tensor& v, const Tensor& beta, const CamDims& d) {
  if (f64(Pc))
    phase_a_fwd<double>(Pc, Ac, k, v, beta, d);
  else
    phase_a_fwd<float>(Pc, Ac, k, v, beta, d);
}

void cam_phase_a_bwd(Tensor& dk, Tensor& dv, Tensor& dbeta, const Tensor& dPc, const Tensor& dAc, const Tensor& k,
                     const Tensor& v, const Tensor& beta, const CamDims& d) {
  if (f64(dPc))
    phase_a_bwd<double>(dk, dv, dbeta, dPc, dAc, k, v, beta, d);
  else
    phase_a_bwd<float>(dk, dv, dbeta, dPc, dAc, k, v, beta, d);
}

void cam_out_fwd(Tensor& out, const Tensor& q, const Tensor& M, const CamDims& d) {
  if (f64(M))
    out_fwd<double>(out, q, M, d);
  else
    out_fwd<float>(out, q, M, d);
}

void cam_out_bwd(Tensor& dq, Tensor& dM, const Tensor& dout, const Tensor& q, const Tensor& M, const CamDims& d) {
  if (f64(M))
    out_bwd<double>(dq, dM, dout, q, M, d);
  else
    out_bwd<float>(dq, dM, dout, q, M, d);
}

}  // namespace cpu
}  // namespace cp
}  // namespace gdncp
