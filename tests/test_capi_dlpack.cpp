// tests/test_capi_dlpack.cpp — the DLPack conversions behind the C ABI
// (src/capi/dlpack.cpp): both directions share memory, ownership ends
// exactly once on either side, and a bad DLPack tensor is refused by name.
#include <gtest/gtest.h>

#include <vector>

#include "capi/dlpack.h"
#include "gdncp/error.h"
#include "gdncp/tensor.h"

namespace gdncp {
namespace {

struct Counted {
  DLManagedTensor m{};
  std::vector<int64_t> shape, strides;
  int deleted = 0;
};

DLManagedTensor* counted(Counted& c, void* data, std::vector<int64_t> shape, DLDataType dtype) {
  c.shape = std::move(shape);
  c.m.dl_tensor.data = data;
  c.m.dl_tensor.device = DLDevice{kDLCPU, 0};
  c.m.dl_tensor.ndim = static_cast<int>(c.shape.size());
  c.m.dl_tensor.dtype = dtype;
  c.m.dl_tensor.shape = c.shape.data();
  c.m.manager_ctx = &c;
  c.m.deleter = [](DLManagedTensor* self) { static_cast<Counted*>(self->manager_ctx)->deleted += 1; };
  return &c.m;
}

TEST(CApiDlpack, ImportSharesMemoryAndDeletesOnce) {
  std::vector<double> buf = {1, 2, 3, 4, 5, 6};
  Counted c;
  {
    Tensor t = detail::from_dlpack(counted(c, buf.data(), {2, 3}, DLDataType{kDLFloat, 64, 1}), "x");
    EXPECT_EQ(t.data(), buf.data());
    EXPECT_EQ(t.shape(), (Shape{2, 3}));
    EXPECT_EQ(t.dtype(), DType::f64);
    Tensor alias = t.reshape({6});
    t = Tensor();
    EXPECT_EQ(c.deleted, 0) << "a reshape still shares the storage";
    alias.fill_(7.0);
    EXPECT_EQ(buf[5], 7.0) << "writes land in the caller's memory";
  }
  EXPECT_EQ(c.deleted, 1);
}

TEST(CApiDlpack, ExportSharesMemoryAndRoundTrips) {
  Tensor t = Tensor::randn({3, 4}, DType::f32, Device::cpu, 7);
  const void* p = t.data();
  DLManagedTensor* m = detail::to_dlpack(t);
  EXPECT_EQ(m->dl_tensor.data, p);
  EXPECT_EQ(m->dl_tensor.ndim, 2);
  EXPECT_EQ(m->dl_tensor.shape[1], 4);
  EXPECT_EQ(m->dl_tensor.strides[0], 4);
  EXPECT_EQ(m->dl_tensor.dtype.bits, 32);
  EXPECT_FALSE(t.storage_unique()) << "the export holds the storage";
  Tensor back = detail::from_dlpack(m, "back");  // owns m now
  EXPECT_EQ(back.data(), p);
  EXPECT_EQ(back.to_vector(), t.to_vector());
  back = Tensor();
  EXPECT_TRUE(t.storage_unique()) << "the round trip let go of the storage";
}

TEST(CApiDlpack, SizeOneDimsMayCarryAnyStride) {
  std::vector<float> buf(6, 1.0f);
  Counted c;
  DLManagedTensor* m = counted(c, buf.data(), {1, 2, 3}, DLDataType{kDLFloat, 32, 1});
  c.strides = {999, 3, 1};
  m->dl_tensor.strides = c.strides.data();
  Tensor t = detail::from_dlpack(m, "x");
  EXPECT_EQ(t.numel(), 6);
}

TEST(CApiDlpack, BadTensorsAreRefusedByNameAndStillDeleted) {
  std::vector<float> buf(6, 1.0f);
  Counted a, b, d;
  EXPECT_THROW(
      {
        try {
          detail::from_dlpack(counted(a, buf.data(), {2, 3}, DLDataType{kDLInt, 32, 1}), "my_arg");
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("my_arg"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  EXPECT_EQ(a.deleted, 1);
  DLManagedTensor* m = counted(b, buf.data(), {2, 3}, DLDataType{kDLFloat, 32, 1});
  b.strides = {1, 2};  // column-major
  m->dl_tensor.strides = b.strides.data();
  EXPECT_THROW(detail::from_dlpack(m, "x"), Error);
  EXPECT_EQ(b.deleted, 1);
  m = counted(d, buf.data(), {2, 3}, DLDataType{kDLFloat, 32, 1});
  m->dl_tensor.device = DLDevice{kDLOpenCL, 0};
  EXPECT_THROW(detail::from_dlpack(m, "x"), Error);
  EXPECT_EQ(d.deleted, 1);
}

}  // namespace
}  // namespace gdncp
