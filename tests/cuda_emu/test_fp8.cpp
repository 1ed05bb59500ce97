// FP8 block quantization on CUDA (cuda/fp8.cu) against the C core (csrc/core/fp8.c): every
// input dtype x format x scale rounding x rounding mode, rows whose last block is short or
// whole, block sizes below, at and above the warp width, grids smaller than the work (the
// grid-stride loop), all bit for bit (NaN payloads included: both use the same integer code).
#include "harness.h"
#include "mpext/fp8.h"
#include "mpext/fp8_cuda.h"

namespace {

using namespace emu_test;

void fill_random(Buf& b, int dtype, int64_t n, Rng& r, float spread) {
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == MP_F32) {
      // mostly normal values over many magnitudes, some specials
      const uint32_t u = r.below(50) == 0 ? random_f32_bits(r, 300)
                                           : bits_of(r.uniform(-1.0f, 1.0f) * spread *
                                                     static_cast<float>(1u << r.below(20)));
      memcpy(b.f32() + i, &u, 4);
    } else {
      b.u16()[i] = random_16_bits(r, dtype, 20);
    }
  }
}

struct Case {
  int dtype, fmt, pow2, sr;
  int64_t rows, cols, block;
};

void run_case(const Case& c, Rng& r) {
  const int64_t n = c.rows * c.cols, nb = (c.cols + c.block - 1) / c.block;
  const int eb = elem_bytes(c.dtype);
  Buf x(n * eb, random_offset(r, eb));
  fill_random(x, c.dtype, n, r, 100.0f);
  Buf q_gpu(n, r.below(16)), q_cpu(n, 0), s_gpu(nb * c.rows * 4, random_offset(r, 4)),
      s_cpu(nb * c.rows * 4, 0);
  const uint64_t seed = r.next(), pos = r.below(1000);
  set_context("dtype %d fmt %d pow2 %d sr %d rows %lld cols %lld block %lld", c.dtype, c.fmt,
              c.pow2, c.sr, (long long)c.rows, (long long)c.cols, (long long)c.block);
  CHECK(mp_fp8_quantize_cuda(x.data(), (mp_dtype)c.dtype, (uint8_t*)q_gpu.data(), s_gpu.f32(),
                             c.rows, c.cols, c.block, c.fmt, c.pow2, c.sr, seed, pos,
                             nullptr) == MP_OK, "quantize status");
  CHECK(mp_fp8_quantize(x.data(), (mp_dtype)c.dtype, (uint8_t*)q_cpu.data(), s_cpu.f32(), c.rows,
                        c.cols, c.block, c.fmt, c.pow2, c.sr, seed, pos) == MP_OK, "core");
  same_bits(q_gpu.data(), q_cpu.data(), n, 1, 0, false, "codes");
  same_bits(s_gpu.data(), s_cpu.data(), nb * c.rows, 4, MP_F32, false, "scales");
  for (int out = MP_F32; out <= MP_F16; ++out) {
    const int ob = elem_bytes(out);
    Buf o_gpu(n * ob, random_offset(r, ob)), o_cpu(n * ob, 0);
    CHECK(mp_fp8_dequantize_cuda((const uint8_t*)q_cpu.data(), s_cpu.f32(), o_gpu.data(),
                                 (mp_dtype)out, c.rows, c.cols, c.block, c.fmt, nullptr) == MP_OK,
          "dequantize status");
    CHECK(mp_fp8_dequantize((const uint8_t*)q_cpu.data(), s_cpu.f32(), o_cpu.data(),
                            (mp_dtype)out, c.rows, c.cols, c.block, c.fmt) == MP_OK, "core");
    same_bits(o_gpu.data(), o_cpu.data(), n, ob, out, false, "restored");
    CHECK(o_gpu.canaries_ok(), "a store outside out");
  }
  CHECK(x.canaries_ok() && q_gpu.canaries_ok() && s_gpu.canaries_ok(),
        "a store outside the arrays");
}

EMU_TEST(fp8_every_mode_and_shape) {
  Rng r(11);
  const int64_t shapes[][3] = {{1, 1, 1}, {3, 5, 2}, {2, 31, 32}, {4, 32, 32}, {3, 33, 32},
                               {2, 200, 128}, {5, 257, 128}, {2, 300, 7}, {1, 1000, 1000}};
  for (int dtype = MP_F32; dtype <= MP_F16; ++dtype)
    for (int fmt = MP_FP8_E4M3; fmt <= MP_FP8_E5M2; ++fmt)
      for (int pow2 = 0; pow2 <= 1; ++pow2)
        for (int sr = 0; sr <= 1; ++sr)
          for (const auto& s : shapes) run_case({dtype, fmt, pow2, sr, s[0], s[1], s[2]}, r);
}

EMU_TEST(fp8_grid_smaller_than_the_work) {
  Caps caps(2, 0);  // two CUDA blocks: 16 warps walk 200 blocks of the tensor
  Rng r(12);
  run_case({MP_BF16, MP_FP8_E4M3, 0, 1, 40, 600, 128}, r);
  run_case({MP_F32, MP_FP8_E5M2, 1, 0, 7, 1000, 33}, r);
}

EMU_TEST(fp8_bad_arguments_and_empty) {
  Buf x(64, 0), q(64, 0), s(64, 0);
  const int64_t l0 = mp_emu::launch_count();
  uint8_t* qp = (uint8_t*)q.data();
  set_context("bad arguments launch nothing");
  CHECK(mp_fp8_quantize_cuda(x.data(), MP_F32, qp, s.f32(), -1, 4, 4, 0, 0, 0, 0, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "rows < 0");
  CHECK(mp_fp8_quantize_cuda(x.data(), MP_F32, qp, s.f32(), 1, 4, 0, 0, 0, 0, 0, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "block 0");
  CHECK(mp_fp8_quantize_cuda(x.data(), MP_F32, qp, s.f32(), 1, 4, 4, 2, 0, 0, 0, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "format");
  CHECK(mp_fp8_quantize_cuda(x.data(), MP_I8, qp, s.f32(), 1, 4, 4, 0, 0, 0, 0, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "dtype");
  CHECK(mp_fp8_quantize_cuda(nullptr, MP_F32, qp, s.f32(), 1, 4, 4, 0, 0, 0, 0, 0, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "null x");
  CHECK(mp_fp8_quantize_cuda(static_cast<char*>(x.data()) + 2, MP_F32, qp, s.f32(), 1, 4, 4, 0,
                             0, 0, 0, 0, nullptr) == MP_ERR_INVALID_ARGUMENT, "misaligned x");
  CHECK(mp_fp8_dequantize_cuda(qp, s.f32(), x.data(), MP_F32, 1, 4, 4, 5, nullptr) ==
            MP_ERR_INVALID_ARGUMENT, "dequantize format");
  CHECK(mp_fp8_quantize_cuda(nullptr, MP_F32, nullptr, nullptr, 0, 4, 4, 0, 0, 0, 0, 0,
                             nullptr) == MP_OK, "empty");
  CHECK(mp_fp8_dequantize_cuda(nullptr, nullptr, nullptr, MP_BF16, 3, 0, 4, 0, nullptr) == MP_OK,
        "empty");
  CHECK(mp_emu::launch_count() == l0, "launched %lld", (long long)(mp_emu::launch_count() - l0));
}

EMU_TEST(fp8_launch_failure) {
  Buf x(4 * 64, 0), q(64, 0), s(64, 0);
  set_context("a failed launch is reported and left pending");
  mp_emu::fail_launch_in(0);
  CHECK(mp_fp8_quantize_cuda(x.data(), MP_F32, (uint8_t*)q.data(), s.f32(), 2, 32, 32, 0, 0, 0,
                             0, 0, nullptr) == MP_ERR_CUDA, "quantize");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "pending");
  mp_emu::fail_launch_in(0);
  CHECK(mp_fp8_dequantize_cuda((uint8_t*)q.data(), s.f32(), x.data(), MP_F32, 2, 32, 32, 0,
                               nullptr) == MP_ERR_CUDA, "dequantize");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "pending");
  mp_emu::fail_launch_in(-1);
}

}  // namespace
