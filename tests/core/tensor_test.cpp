#include "core/tensor.h"

#include <gtest/gtest.h>

#include "core/arena.h"

namespace fp8t {
namespace {

TEST(Tensor, ContiguousShapeStridesAndBytes) {
  float storage[24];
  const TensorView view(storage, DType::F32, {2, 3, 4});
  EXPECT_EQ(view.rank(), 3);
  EXPECT_EQ(view.numel(), 24);
  EXPECT_EQ(view.bytes(), 96u);
  EXPECT_EQ(view.stride(0), 12);
  EXPECT_EQ(view.stride(1), 4);
  EXPECT_EQ(view.stride(2), 1);
  EXPECT_TRUE(view.is_contiguous());
  EXPECT_EQ(view.data<float>(), storage);
  EXPECT_THROW(view.data<int32_t>(), Error);  // the dtype is checked
  EXPECT_THROW(view.dim(3), Error);
}

TEST(Tensor, ReshapeKeepsMemoryAndChecksCount) {
  float storage[24];
  TensorView view(storage, DType::F32, {2, 3, 4});
  const TensorView flat = view.reshaped({6, 4});
  EXPECT_EQ(flat.raw(), view.raw());
  EXPECT_EQ(flat.dim(0), 6);
  EXPECT_THROW(view.reshaped({5, 5}), Error);
}

TEST(Tensor, Fp8DtypesCarryFormatsAndMetadata) {
  uint8_t storage[8];
  float scale_inv = 0.5f;
  TensorView view(storage, dtype_of(Fp8Format::E5M2FNUZ), {8});
  EXPECT_EQ(view.dtype(), DType::E5M2FNUZ);
  EXPECT_EQ(fp8_format_of(view.dtype()), Fp8Format::E5M2FNUZ);
  EXPECT_EQ(dtype_size(view.dtype()), 1u);
  view.fp8().scale_inv = &scale_inv;
  EXPECT_EQ(view.reshaped({2, 4}).fp8().scale_inv, &scale_inv);
  EXPECT_EQ(view.fp8_data(), storage);
  EXPECT_FALSE(fp8_format_of(DType::BF16).has_value());
  EXPECT_THROW(TensorView(storage, DType::BF16, {4}).fp8_data(), Error);
  EXPECT_THROW(dtype_of(Fp8Format::E8M0), Error);
}

TEST(Arena, AllocatesAlignedPiecesAndNamesItselfWhenFull) {
  Arena arena("test activations",
              Arena::footprint(DType::F32, 10) + Arena::footprint(DType::BF16, 3));
  const TensorView a = arena.allocate(DType::F32, {10});
  const TensorView b = arena.allocate(DType::BF16, {3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.raw()) % Arena::kAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.raw()) % Arena::kAlignment, 0u);
  EXPECT_EQ(arena.used(), arena.capacity());
  try {
    arena.allocate(DType::F32, {1});
    FAIL() << "an over-full arena must throw";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("test activations"), std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace fp8t
