// grad_norm on CUDA (cuda/norm.cu) against the C core (csrc/core/norm.c).
//
// The two sum in different orders, so on general data they agree only to rounding (checked to
// one ulp of the fp32 result). On data whose squares and partial sums are all exact in double
// (small integers times a power of two) every order gives the same sum: there the results must
// be equal bit for bit, and a skipped, repeated or misplaced element changes the sum.
#include <math.h>

#include "harness.h"
#include "mpext/norm.h"
#include "mpext/norm_cuda.h"

namespace {

using namespace emu_test;

constexpr int64_t kChunk = MP_GRAD_NORM_CUDA_CHUNK;

struct Tensor {
  int dtype;
  int64_t n;
  unsigned misalign;
  Buf dev;
  std::vector<uint8_t> host;
};

enum class Data { kExact, kGeneral };

// Exact data: k * 2^-12 with |k| < 2^8 (fits bf16, fp16 incl. its subnormals, and fp32), so
// with a power-of-two inv_scale every square is a multiple of 2^-24 * 2^-2e below 2^-8, and any
// sum of up to 2^40 of them is exact in double. General data: mixed magnitudes.
Tensor make_tensor(Rng& r, int dtype, int64_t n, unsigned misalign, Data data) {
  Tensor t{dtype, n, misalign, Buf(static_cast<size_t>(n) * elem_bytes(dtype), misalign), {}};
  t.host.resize(t.dev.bytes());
  for (int64_t i = 0; i < n; ++i) {
    float v;
    if (data == Data::kExact) {
      v = static_cast<float>(static_cast<int>(r.below(511)) - 255) * 0x1p-12f;
    } else {
      v = r.uniform(-1.0f, 1.0f) * ldexpf(1.0f, static_cast<int>(r.below(20)) - 10);
    }
    if (dtype == MP_F32) {
      memcpy(&t.host[4 * i], &v, 4);
    } else if (dtype == MP_BF16) {
      const uint16_t h = static_cast<uint16_t>(bits_of(v) >> 16);  // exact for exact data
      memcpy(&t.host[2 * i], &h, 2);
    } else {
      const uint16_t h = __half_as_ushort(__float2half_rn(v));  // exact for exact data
      memcpy(&t.host[2 * i], &h, 2);
    }
  }
  t.dev.fill(t.host.data());
  return t;
}

// The core's norm: each tensor in pieces of MP_GRAD_NORM_BLOCK elements (as the CPU binding
// splits it), the partial sums finished in order.
float cpu_norm(const std::vector<Tensor>& ts, float inv) {
  std::vector<double> partials;
  for (const Tensor& t : ts) {
    for (int64_t s = 0; s < t.n; s += MP_GRAD_NORM_BLOCK) {
      const int64_t c = t.n - s < MP_GRAD_NORM_BLOCK ? t.n - s : MP_GRAD_NORM_BLOCK;
      double p = 0;
      const mp_status st = mp_grad_norm_sumsq(
          reinterpret_cast<const char*>(t.host.data()) +
              s * MP_DTYPE_BYTES(t.dtype),
          static_cast<mp_dtype>(t.dtype), c, inv, &p);
      CHECK(st == MP_OK, "core sumsq status %d", st);
      partials.push_back(p);
    }
  }
  float out = -1.0f;
  CHECK(mp_grad_norm_finish(partials.data(), static_cast<int64_t>(partials.size()), &out) ==
            MP_OK, "core finish");
  return out;
}

// The CUDA norm of the list, through the public API: sizes the workspace, gives it a NaN-filled
// spare tail that must stay untouched, runs. inv: NaN for no inv_scale pointer.
float cuda_norm(const std::vector<Tensor>& ts, float inv) {
  std::vector<mp_norm_segment> segs;
  int64_t expect = 0;
  for (const Tensor& t : ts) {
    segs.push_back({t.dev.data(), t.dtype, t.n});
    expect += (t.n + kChunk - 1) / kChunk;
  }
  const int64_t need = mp_grad_norm_workspace_cuda(segs.data(), static_cast<int64_t>(segs.size()));
  CHECK(need == expect, "workspace %lld doubles, want %lld", static_cast<long long>(need),
        static_cast<long long>(expect));
  Buf ws(8 * static_cast<size_t>(need + 3), 0), out(4, 0), inv_dev(4, 0);
  memset(ws.data(), 0xFF, ws.bytes());
  *inv_dev.f32() = inv;
  *out.f32() = -1.0f;
  const mp_status st = mp_grad_norm_multi_cuda(
      segs.data(), static_cast<int64_t>(segs.size()), isnan(inv) ? nullptr : inv_dev.f32(),
      static_cast<double*>(ws.data()), need + 3, out.f32(), nullptr);
  CHECK(st == MP_OK, "status %d", st);
  const uint8_t* spare = static_cast<const uint8_t*>(ws.data()) + 8 * need;
  bool untouched = true;
  for (int i = 0; i < 24; ++i) untouched = untouched && spare[i] == 0xFF;
  CHECK(untouched, "a workspace entry past the %lld needed was written",
        static_cast<long long>(need));
  for (const Tensor& t : ts) CHECK(t.dev.canaries_ok(), "a tensor's canary changed");
  return *out.f32();
}

void exact_case(const std::vector<Tensor>& ts, float inv) {
  const float want = cpu_norm(ts, isnan(inv) ? 1.0f : inv);
  const float got = cuda_norm(ts, inv);
  CHECK(bits_of(got) == bits_of(want), "norm %a (0x%08x), want %a (0x%08x)",
        static_cast<double>(got), bits_of(got), static_cast<double>(want), bits_of(want));
}

// Exact data in every dtype, sizes around the vector width and the chunk, every misalignment
// (one list per dtype and size, a tensor at each offset).
EMU_TEST(grad_norm_exact_sizes_alignments) {
  const int64_t sizes[] = {1, 7, 8, 9, 17, 100, 4097, kChunk - 1, kChunk, kChunk + 5};
  uint64_t seed = 1;
  for (int dtype = MP_F32; dtype <= MP_F16; ++dtype) {
    for (int64_t n : sizes) {
      Rng r(++seed);
      std::vector<Tensor> ts;
      for (unsigned mis = 0; mis < 16; mis += elem_bytes(dtype)) {
        if (n >= kChunk && mis % 8 != 0) continue;
        ts.push_back(make_tensor(r, dtype, n, mis, Data::kExact));
      }
      const float inv = seed % 3 == 0 ? NAN : seed % 3 == 1 ? 0.5f : 0x1p-3f;
      set_context("%s n=%lld inv=%g", dtype_name(dtype), static_cast<long long>(n),
                  static_cast<double>(inv));
      exact_case(ts, inv);
      for (size_t k = 0; k < ts.size(); ++k) {  // and each tensor on its own
        std::vector<Tensor> one;
        one.push_back(std::move(ts[k]));
        set_context("%s n=%lld misalign=%u inv=%g", dtype_name(dtype), static_cast<long long>(n),
                    one[0].misalign, static_cast<double>(inv));
        if (n < 100 || k < 2) exact_case(one, inv);
      }
    }
  }
}

// A list of mixed tensors, zero-size ones included; forced splits across chunks and launches;
// more tensors than one launch's argument holds.
EMU_TEST(grad_norm_lists_and_splits) {
  Rng r(50);
  std::vector<Tensor> ts;
  for (int k = 0; k < 30; ++k) {
    const int dtype = static_cast<int>(r.below(3));
    const int64_t n = k % 6 == 0 ? 0 : k == 7 ? 3 * kChunk + 11 : static_cast<int64_t>(r.below(2000));
    const unsigned offset = random_offset(r, elem_bytes(dtype));
    ts.push_back(make_tensor(r, dtype, n, offset, Data::kExact));
  }
  set_context("30 tensors");
  exact_case(ts, 0.25f);
  {
    Caps caps(2, 3);
    set_context("30 tensors, caps 2 blocks / 3 pieces");
    const int64_t l0 = mp_emu::launch_count();
    exact_case(ts, 0.25f);
    CHECK(mp_emu::launch_count() - l0 >= 8, "%lld launches: the caps did not split the work",
          static_cast<long long>(mp_emu::launch_count() - l0));
  }
  std::vector<Tensor> many;
  for (int k = 0; k < 420; ++k) many.push_back(make_tensor(r, k % 3, 1 + k % 9, 0, Data::kExact));
  set_context("420 tensors");
  const int64_t l0 = mp_emu::launch_count();
  exact_case(many, NAN);
  CHECK(mp_emu::launch_count() - l0 >= 4, "420 tensors in %lld launches",
        static_cast<long long>(mp_emu::launch_count() - l0));
  set_context("no tensors / only empty ones");
  std::vector<Tensor> none;
  CHECK(cuda_norm(none, 0.5f) == 0.0f, "empty list");
  none.push_back(make_tensor(r, MP_BF16, 0, 0, Data::kExact));
  CHECK(cuda_norm(none, 0.5f) == 0.0f, "zero-size tensor");
}

// General data: equal to the core within one ulp, and the same bits on every run whatever the
// order blocks and threads run in.
EMU_TEST(grad_norm_general_data_deterministic) {
  Rng r(60);
  std::vector<Tensor> ts;
  for (int k = 0; k < 12; ++k) {
    const unsigned offset = random_offset(r, elem_bytes(k % 3));
    ts.push_back(make_tensor(r, k % 3, k == 4 ? 2 * kChunk + 3 : 500 + 97 * k, offset,
                             Data::kGeneral));
  }
  const float want = cpu_norm(ts, 0.75f);
  set_context("12 tensors of mixed magnitudes");
  uint32_t first = 0;
  for (uint64_t seed : {1ull, 2ull, 3ull}) {
    mp_emu::set_seed(seed);
    const float got = cuda_norm(ts, 0.75f);
    const uint32_t g = bits_of(got), w = bits_of(want);
    CHECK((g > w ? g - w : w - g) <= 1, "norm %a, core %a", static_cast<double>(got),
          static_cast<double>(want));
    if (seed == 1) first = g;
    CHECK(g == first, "seed %llu gave 0x%08x, seed 1 0x%08x", static_cast<unsigned long long>(seed),
          g, first);
  }
}

// NaN (the canonical NaN, whatever the payloads), Inf, squares beyond the fp32 range (among
// values so much smaller that every summation order rounds them away alike).
EMU_TEST(grad_norm_nan_inf_and_range) {
  Rng r(70);
  struct Case {
    const char* what;
    int dtype;
    std::vector<std::pair<int64_t, uint32_t>> pokes;  // (index, bits)
  };
  const int64_t n = kChunk + 40;
  const Case cases[] = {
      {"f32 NaN payload", MP_F32, {{5, 0xFFA00001u}}},
      {"f32 +Inf and -Inf", MP_F32, {{0, 0x7F800000u}, {kChunk + 3, 0xFF800000u}}},
      {"f32 Inf and NaN", MP_F32, {{9, 0x7F800000u}, {n - 1, 0x7F800001u}}},
      {"f32 2^100 squares", MP_F32, {{1, 0x71800000u}, {2, 0xF1800000u}, {kChunk, 0x71800000u}}},
      {"bf16 NaN", MP_BF16, {{n - 2, 0x7FC1u}}},
      {"bf16 -Inf", MP_BF16, {{kChunk, 0xFF80u}}},
      {"fp16 NaN", MP_F16, {{3, 0xFE01u}}},
      {"fp16 2048s", MP_F16, {{0, 0x6800u}, {1, 0xE800u}, {n - 1, 0x6800u}}},
  };
  for (const Case& c : cases) {
    std::vector<Tensor> ts;
    ts.push_back(make_tensor(r, c.dtype, n, 4, Data::kExact));
    for (const auto& p : c.pokes) {
      if (c.dtype == MP_F32) {
        memcpy(&ts[0].host[4 * p.first], &p.second, 4);
      } else {
        const uint16_t h = static_cast<uint16_t>(p.second);
        memcpy(&ts[0].host[2 * p.first], &h, 2);
      }
    }
    ts[0].dev.fill(ts[0].host.data());
    set_context("%s", c.what);
    exact_case(ts, 1.0f);
  }
}

// A failed launch, pass 1's or the finish's: MP_ERR_CUDA, nothing launched after it, *out
// untouched, no workspace entry written from the failed launch on, the error left pending.
EMU_TEST(grad_norm_launch_failure) {
  Caps caps(1, 0);  // one block per pass-1 launch: 3 for these tensors, then the finish launch
  Rng r(80);
  std::vector<Tensor> ts;
  ts.push_back(make_tensor(r, MP_F32, kChunk + 5, 0, Data::kExact));
  ts.push_back(make_tensor(r, MP_BF16, 9, 2, Data::kExact));
  const mp_norm_segment segs[2] = {{ts[0].dev.data(), MP_F32, ts[0].n},
                                   {ts[1].dev.data(), MP_BF16, ts[1].n}};
  const int64_t need = mp_grad_norm_workspace_cuda(segs, 2);
  CHECK(need == 3, "workspace %lld doubles, want 3", static_cast<long long>(need));
  for (int64_t fail_at = 0; fail_at <= need; ++fail_at) {
    set_context("launch %lld of %lld fails", static_cast<long long>(fail_at),
                static_cast<long long>(need + 1));
    Buf ws(8 * static_cast<size_t>(need), 0), out(4, 0);
    memset(ws.data(), 0xFF, ws.bytes());
    *out.f32() = -1.0f;
    mp_emu::fail_launch_in(fail_at);
    const int64_t l0 = mp_emu::launch_count();
    const mp_status st = mp_grad_norm_multi_cuda(segs, 2, nullptr, static_cast<double*>(ws.data()),
                                                 need, out.f32(), nullptr);
    mp_emu::fail_launch_in(-1);
    CHECK(st == MP_ERR_CUDA, "status %d", st);
    CHECK(mp_emu::launch_count() - l0 == fail_at + 1, "%lld launches: launched after the failure",
          static_cast<long long>(mp_emu::launch_count() - l0));
    CHECK(bits_of(*out.f32()) == bits_of(-1.0f), "out written: %a",
          static_cast<double>(*out.f32()));
    const uint8_t* w = static_cast<const uint8_t*>(ws.data());
    bool untouched = true;
    for (int64_t i = 8 * fail_at; i < 8 * need; ++i) untouched = untouched && w[i] == 0xFF;
    CHECK(untouched, "a workspace entry from the failed launch on was written");
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "the error was not left pending");
  }
}

EMU_TEST(grad_norm_bad_arguments) {
  Buf x(64, 0), ws(8 * 4, 0), out(4, 0);
  *out.f32() = -1.0f;
  double* w = static_cast<double*>(ws.data());
  struct Case {
    const char* what;
    mp_norm_segment seg;
    double* ws;
    int64_t ws_len;
    float* out;
  };
  const Case cases[] = {
      {"unknown dtype", {x.data(), 3, 4}, w, 4, out.f32()},
      {"n < 0", {x.data(), MP_F32, -1}, w, 4, out.f32()},
      {"x null", {nullptr, MP_BF16, 4}, w, 4, out.f32()},
      {"f32 misaligned", {static_cast<char*>(x.data()) + 2, MP_F32, 4}, w, 4, out.f32()},
      {"fp16 odd address", {static_cast<char*>(x.data()) + 1, MP_F16, 4}, w, 4, out.f32()},
      {"workspace too short", {x.data(), MP_F32, 4}, w, 1, out.f32()},
      {"workspace null", {x.data(), MP_F32, 4}, nullptr, 4, out.f32()},
      {"out null", {x.data(), MP_F32, 4}, w, 4, nullptr},
  };
  for (const Case& c : cases) {
    const mp_norm_segment segs[2] = {{x.data(), MP_BF16, 8}, c.seg};
    set_context("%s", c.what);
    const int64_t l0 = mp_emu::launch_count();
    CHECK(mp_grad_norm_multi_cuda(segs, 2, nullptr, c.ws, c.ws_len, c.out, nullptr) ==
              MP_ERR_INVALID_ARGUMENT, "status");
    CHECK(mp_emu::launch_count() == l0, "launched");
  }
  set_context("workspace sizing of bad lists");
  const mp_norm_segment bad = {nullptr, MP_F32, 4};
  CHECK(mp_grad_norm_workspace_cuda(&bad, 1) == -1, "null x");
  CHECK(mp_grad_norm_workspace_cuda(nullptr, 1) == -1, "null list");
  CHECK(mp_grad_norm_workspace_cuda(nullptr, -1) == -1, "negative count");
  CHECK(mp_grad_norm_workspace_cuda(nullptr, 0) == 0, "empty list");
  CHECK(*out.f32() == -1.0f, "out written");
}

}  // namespace
