// The int8 block code of saved activations on CUDA (cuda/int8_block.cu) against the C core
// (csrc/core/int8_block.c): every input dtype x scale rounding x output dtype, rows whose last
// block is short or whole, block sizes below, at and above the warp width, blocks with NaN and
// Inf, grids smaller than the work (the grid-stride loop), all bit for bit (NaN payloads
// included: both use the same integer code on this CPU).
#include "harness.h"
#include "mpext/int8_block.h"
#include "mpext/int8_block_cuda.h"

namespace {

using namespace emu_test;

void fill_random(Buf& b, int dtype, int64_t n, Rng& r, int special) {
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == MP_F32) {
      // mostly normal values over many magnitudes, some specials
      const uint32_t u = r.below(1000) < static_cast<uint32_t>(special)
                             ? random_f32_bits(r, 300)
                             : bits_of(r.uniform(-1.0f, 1.0f) *
                                       static_cast<float>(1u << r.below(20)));
      memcpy(b.f32() + i, &u, 4);
    } else {
      b.u16()[i] = random_16_bits(r, dtype, special);
    }
  }
}

struct Case {
  int dtype, pow2;
  int64_t rows, cols, block;
  int special;  // per mille
};

void run_case(const Case& c, Rng& r) {
  const int64_t n = c.rows * c.cols, nb = (c.cols + c.block - 1) / c.block;
  const int eb = elem_bytes(c.dtype);
  Buf x(n * eb, random_offset(r, eb));
  fill_random(x, c.dtype, n, r, c.special);
  Buf q_gpu(n, r.below(16)), q_cpu(n, 0), s_gpu(nb * c.rows * 4, random_offset(r, 4)),
      s_cpu(nb * c.rows * 4, 0);
  set_context("dtype %d pow2 %d rows %lld cols %lld block %lld special %d", c.dtype, c.pow2,
              (long long)c.rows, (long long)c.cols, (long long)c.block, c.special);
  CHECK(mp_int8_block_quantize_cuda(x.data(), (mp_dtype)c.dtype, (int8_t*)q_gpu.data(),
                                    s_gpu.f32(), c.rows, c.cols, c.block, c.pow2,
                                    nullptr) == MP_OK, "quantize status");
  CHECK(mp_int8_block_quantize(x.data(), (mp_dtype)c.dtype, (int8_t*)q_cpu.data(), s_cpu.f32(),
                               c.rows, c.cols, c.block, c.pow2) == MP_OK, "core");
  same_bits(q_gpu.data(), q_cpu.data(), n, 1, 0, false, "codes");
  same_bits(s_gpu.data(), s_cpu.data(), nb * c.rows, 4, MP_F32, false, "scales");
  for (int out = MP_F32; out <= MP_F16; ++out) {
    const int ob = elem_bytes(out);
    Buf o_gpu(n * ob, random_offset(r, ob)), o_cpu(n * ob, 0);
    CHECK(mp_int8_block_dequantize_cuda((const int8_t*)q_cpu.data(), s_cpu.f32(), o_gpu.data(),
                                        (mp_dtype)out, c.rows, c.cols, c.block,
                                        nullptr) == MP_OK, "dequantize status");
    CHECK(mp_int8_block_dequantize((const int8_t*)q_cpu.data(), s_cpu.f32(), o_cpu.data(),
                                   (mp_dtype)out, c.rows, c.cols, c.block) == MP_OK, "core");
    same_bits(o_gpu.data(), o_cpu.data(), n, ob, out, false, "restored");
    CHECK(o_gpu.canaries_ok(), "a store outside out");
  }
  CHECK(x.canaries_ok() && q_gpu.canaries_ok() && s_gpu.canaries_ok(),
        "a store outside the arrays");
}

EMU_TEST(int8_block_every_mode_and_shape) {
  Rng r(42);
  const int64_t shapes[][3] = {{1, 1, 1}, {3, 5, 2}, {2, 31, 32}, {4, 32, 32}, {3, 33, 32},
                               {2, 200, 128}, {5, 257, 128}, {2, 300, 7}, {1, 1000, 1000}};
  for (int dtype = MP_F32; dtype <= MP_F16; ++dtype)
    for (int pow2 = 0; pow2 <= 1; ++pow2)
      for (const auto& s : shapes)
        for (int special : {0, 20}) run_case({dtype, pow2, s[0], s[1], s[2], special}, r);
}

EMU_TEST(int8_block_grid_smaller_than_the_work) {
  Caps caps(2, 0);  // two CUDA blocks: 16 warps walk 200 blocks of the tensor
  Rng r(43);
  run_case({MP_BF16, 0, 40, 600, 128, 5}, r);
  run_case({MP_F32, 1, 7, 1000, 33, 5}, r);
}

EMU_TEST(int8_block_bad_arguments_and_empty) {
  Buf x(64, 0), q(64, 0), s(64, 0);
  const int64_t l0 = mp_emu::launch_count();
  int8_t* qp = (int8_t*)q.data();
  set_context("bad arguments launch nothing");
  CHECK(mp_int8_block_quantize_cuda(x.data(), MP_F32, qp, s.f32(), -1, 4, 4, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "rows < 0");
  CHECK(mp_int8_block_quantize_cuda(x.data(), MP_F32, qp, s.f32(), 1, 4, 0, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "block 0");
  CHECK(mp_int8_block_quantize_cuda(x.data(), MP_I8, qp, s.f32(), 1, 4, 4, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "dtype");
  CHECK(mp_int8_block_quantize_cuda(nullptr, MP_F32, qp, s.f32(), 1, 4, 4, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "null x");
  CHECK(mp_int8_block_quantize_cuda(static_cast<char*>(x.data()) + 2, MP_F32, qp, s.f32(), 1, 4,
                                    4, 0, nullptr) == MP_ERR_INVALID_ARGUMENT, "misaligned x");
  CHECK(mp_int8_block_dequantize_cuda(qp, s.f32(), x.data(), MP_U8, 1, 4, 4, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "dequantize dtype");
  CHECK(mp_int8_block_dequantize_cuda(qp, s.f32(), static_cast<char*>(x.data()) + 1, MP_BF16, 1,
                                      4, 4, nullptr) == MP_ERR_INVALID_ARGUMENT, "misaligned out");
  CHECK(mp_int8_block_quantize_cuda(nullptr, MP_F32, nullptr, nullptr, 0, 4, 4, 0, nullptr) ==
            MP_OK, "empty");
  CHECK(mp_int8_block_dequantize_cuda(nullptr, nullptr, nullptr, MP_BF16, 3, 0, 4, nullptr) ==
            MP_OK, "empty");
  CHECK(mp_emu::launch_count() == l0, "launched %lld", (long long)(mp_emu::launch_count() - l0));
}

EMU_TEST(int8_block_launch_failure) {
  Buf x(4 * 64, 0), q(64, 0), s(64, 0);
  set_context("a failed launch is reported and left pending");
  mp_emu::fail_launch_in(0);
  CHECK(mp_int8_block_quantize_cuda(x.data(), MP_F32, (int8_t*)q.data(), s.f32(), 2, 32, 32, 0,
                                    nullptr) == MP_ERR_CUDA, "quantize");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "pending");
  mp_emu::fail_launch_in(0);
  CHECK(mp_int8_block_dequantize_cuda((int8_t*)q.data(), s.f32(), x.data(), MP_F32, 2, 32, 32,
                                      nullptr) == MP_ERR_CUDA, "dequantize");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "pending");
  mp_emu::fail_launch_in(-1);
}

}  // namespace
