// unscale_ and update_scale_ on CUDA (cuda/scale.cu) against the C core (csrc/core/scale.c).
#include "harness.h"
#include "mpext/scale.h"
#include "mpext/scale_cuda.h"

namespace {

using namespace emu_test;

constexpr int64_t kChunk = 65536;  // the kernel's elements per block, to aim sizes at its edges

// One grad: the device copy and the values the CPU reference works on.
struct Grad {
  int dtype = 0;
  int64_t n = 0;
  Buf dev;
  std::vector<uint8_t> ref;  // aligned host copy for the core
};

Grad make_grad(Rng& r, int dtype, int64_t n, unsigned misalign, int special, bool mmapped) {
  Grad g;
  g.dtype = dtype;
  g.n = n;
  g.ref = random_elems(r, dtype, n, special);
  g.dev = Buf(g.ref.size(), misalign, mmapped);
  g.dev.fill(g.ref.data());
  return g;
}

// The core's unscale of g.ref in place; returns its found flag (0/1).
int32_t cpu_unscale(Grad& g, float inv) {
  int32_t found = 0;
  const mp_status st = mp_unscale(g.ref.data(), static_cast<mp_dtype>(g.dtype), g.n, inv, &found);
  CHECK(st == MP_OK, "core unscale failed");
  return found;
}

struct GradSpec {
  int dtype;
  int64_t n;
  unsigned misalign;
};

// Unscales the list on "CUDA" and on the CPU and compares everything. found_init is the device
// flag before the call. Read-only (inv == 1) cases run on write-protected buffers: the check-only
// path must store nothing at all. Returns the number of launches.
int64_t unscale_case(const std::vector<GradSpec>& specs, float inv, float found_init,
                     uint64_t seed, int special = 20) {
  Rng r(seed);
  const bool check_only = inv == 1.0f;
  std::vector<Grad> grads;
  for (const GradSpec& s : specs) grads.push_back(make_grad(r, s.dtype, s.n, s.misalign, special,
                                                           check_only));
  Buf inv_dev(4, 0), found_dev(4, 0);
  memcpy(inv_dev.data(), &inv, 4);
  memcpy(found_dev.data(), &found_init, 4);
  std::vector<mp_unscale_segment> segs;
  int32_t found = 0;
  for (Grad& g : grads) {
    segs.push_back({g.dev.data(), g.dtype, g.n});
    found |= cpu_unscale(g, inv);
    if (check_only) g.dev.protect(true);
  }
  const int64_t launches0 = mp_emu::launch_count();
  const mp_status st = mp_unscale_multi_cuda(segs.data(), static_cast<int64_t>(segs.size()),
                                             found_dev.f32(), inv_dev.f32(), nullptr);
  CHECK(st == MP_OK, "status %d", st);
  for (size_t k = 0; k < grads.size(); ++k) {
    Grad& g = grads[k];
    if (check_only) g.dev.protect(false);
    char what[96];
    snprintf(what, sizeof what, "grad %zu (%s, n %lld, misalign %u)", k, dtype_name(g.dtype),
             static_cast<long long>(g.n), specs[k].misalign);
    same_bits(g.dev.data(), g.ref.data(), g.n, elem_bytes(g.dtype), g.dtype, true, what);
    CHECK(g.dev.canaries_ok(), "%s: a store outside the tensor", what);
  }
  const float want = found ? 1.0f : found_init;
  CHECK(bits_of(*found_dev.f32()) == bits_of(want), "found_inf %a, want %a (core found %d)",
        static_cast<double>(*found_dev.f32()), static_cast<double>(want), found);
  CHECK(bits_of(*inv_dev.f32()) == bits_of(inv), "inv_scale was modified");
  return mp_emu::launch_count() - launches0;
}

// Every dtype, sizes around the vector width and the chunk, every misalignment a tensor can
// have, several factors (exact, inexact, to subnormal, overflowing), specials included.
EMU_TEST(unscale_dtypes_sizes_alignments) {
  const int64_t sizes[] = {1, 7, 8, 9, 15, 16, 17, 31, 100, 1000, kChunk - 1, kChunk, kChunk + 9};
  const float invs[] = {0.5f, 3.0f, 0x1p-20f, 1e-41f, 1e30f};
  uint64_t seed = 1;
  for (int dtype = 0; dtype < MP_DTYPE_COUNT; ++dtype) {
    for (int64_t n : sizes) {
      for (unsigned mis = 0; mis < 16; mis += elem_bytes(dtype)) {
        if (n >= kChunk && mis % 4 != 0) continue;  // the big ones at a few offsets only
        const float inv = invs[seed % 5];
        set_context("%s n=%lld misalign=%u inv=%a", dtype_name(dtype), static_cast<long long>(n),
                    mis, static_cast<double>(inv));
        unscale_case({{dtype, n, mis}}, inv, 0.0f, ++seed);
      }
    }
  }
}

// A list of mixed dtypes, sizes and offsets in one call, clean and with NaN/Inf.
EMU_TEST(unscale_multi_mixed_list) {
  std::vector<GradSpec> specs;
  Rng r(99);
  for (int k = 0; k < 40; ++k) {
    const int dtype = static_cast<int>(r.below(3));
    const int64_t n = k % 7 == 0 ? 0 : static_cast<int64_t>(r.below(3000));
    specs.push_back({dtype, n, random_offset(r, elem_bytes(dtype))});
  }
  specs.push_back({MP_BF16, 2 * kChunk + 5, 6});
  set_context("40 tensors, clean");
  unscale_case(specs, 0x1p-16f, 0.0f, 5, 0);
  set_context("40 tensors, with NaN/Inf");
  unscale_case(specs, 0.25f, 0.0f, 6, 2);
}

// inv_scale == 1: only a check; the buffers are write-protected. A single bad element at the
// head, in the body, in the tail, right after a chunk boundary, or none.
EMU_TEST(unscale_check_only_writes_nothing) {
  for (int dtype = 0; dtype < MP_DTYPE_COUNT; ++dtype) {
    const int64_t n = kChunk + 21;
    for (int64_t bad : {int64_t{-1}, int64_t{0}, int64_t{3}, int64_t{4000}, kChunk - 1, kChunk,
                        n - 1}) {
      Rng r(static_cast<uint64_t>(bad + 7 * dtype + 100));
      Grad g = make_grad(r, dtype, n, elem_bytes(dtype) == 2 ? 2u : 0u, 0, true);
      if (bad >= 0) {
        if (dtype == MP_F32) {
          reinterpret_cast<uint32_t*>(g.dev.data())[bad] = 0xFF800000u;  // -Inf
        } else {
          g.dev.u16()[bad] = dtype == MP_BF16 ? 0x7FC1 : 0xFE01;  // NaNs
        }
      }
      const std::vector<uint8_t> before = g.dev.snapshot();
      Buf inv(4, 0), found(4, 0);
      *inv.f32() = 1.0f;
      *found.f32() = 0.0f;
      g.dev.protect(true);
      const mp_unscale_segment seg = {g.dev.data(), dtype, n};
      set_context("%s bad element at %lld", dtype_name(dtype), static_cast<long long>(bad));
      CHECK(mp_unscale_multi_cuda(&seg, 1, found.f32(), inv.f32(), nullptr) == MP_OK, "status");
      g.dev.protect(false);
      CHECK(g.dev.snapshot() == before, "values changed");
      CHECK(*found.f32() == (bad >= 0 ? 1.0f : 0.0f), "found_inf %g", *found.f32());
    }
  }
}

// found_inf already set: it stays 1 and the grads are still unscaled (as torch does).
EMU_TEST(unscale_found_inf_already_set) {
  set_context("clean grads, found_inf = 1");
  unscale_case({{MP_F32, 1000, 0}, {MP_F16, 33, 2}}, 0.125f, 1.0f, 11, 0);
  set_context("check only, found_inf = 1");
  unscale_case({{MP_BF16, 77, 2}}, 1.0f, 1.0f, 12, 0);
}

// Splits: caps of 2 blocks and 3 pieces per launch make tensors span chunks and launches.
EMU_TEST(unscale_split_across_chunks_and_launches) {
  Caps caps(2, 3);
  const std::vector<GradSpec> specs = {{MP_F32, 3 * kChunk + 5, 4},
                                       {MP_BF16, 1, 0},
                                       {MP_F16, kChunk + 1, 2},
                                       {MP_F32, 0, 0},
                                       {MP_BF16, 2 * kChunk, 14},
                                       {MP_F16, 17, 6}};
  set_context("caps 2 blocks / 3 pieces, clean");
  const int64_t launches = unscale_case(specs, 0.5f, 0.0f, 21, 0);
  CHECK(launches >= 5, "only %lld launches: the caps did not split the work",
        static_cast<long long>(launches));
  set_context("caps 2 blocks / 3 pieces, a NaN somewhere");
  unscale_case(specs, 3.0f, 0.0f, 22, 1);
}

// More tensors than one launch's argument holds, at the real limits.
EMU_TEST(unscale_more_tensors_than_one_launch) {
  std::vector<GradSpec> specs;
  for (int k = 0; k < 450; ++k) specs.push_back({k % 3, 1 + k % 13, static_cast<unsigned>(k % 2) * 4});
  set_context("450 small tensors");
  const int64_t launches = unscale_case(specs, 0.5f, 0.0f, 31, 3);
  CHECK(launches >= 3, "450 tensors in %lld launches", static_cast<long long>(launches));
}

// One tensor of each dtype on its own, and an empty list.
EMU_TEST(unscale_single_and_empty) {
  Rng r(41);
  for (int dtype = 0; dtype < MP_DTYPE_COUNT; ++dtype) {
    Grad g = make_grad(r, dtype, 1003, elem_bytes(dtype) == 2 ? 2u : 0u, 10, false);
    Buf inv(4, 0), found(4, 0);
    *inv.f32() = 0.75f;
    *found.f32() = 0.0f;
    const int32_t want = cpu_unscale(g, 0.75f);
    const mp_unscale_segment seg = {g.dev.data(), dtype, g.n};
    const mp_status st = mp_unscale_multi_cuda(&seg, 1, found.f32(), inv.f32(), nullptr);
    set_context("single %s", dtype_name(dtype));
    CHECK(st == MP_OK, "status %d", st);
    same_bits(g.dev.data(), g.ref.data(), g.n, elem_bytes(dtype), dtype, true, "grad");
    CHECK(*found.f32() == (want ? 1.0f : 0.0f), "found_inf");
  }
  set_context("empty list");
  Buf inv(4, 0), found(4, 0);
  *inv.f32() = 0.5f;
  *found.f32() = 0.0f;
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_unscale_multi_cuda(nullptr, 0, found.f32(), inv.f32(), nullptr) == MP_OK, "status");
  const mp_unscale_segment zero[2] = {{nullptr, MP_F32, 0}, {nullptr, MP_F16, 0}};
  CHECK(mp_unscale_multi_cuda(zero, 2, found.f32(), inv.f32(), nullptr) == MP_OK, "status");
  CHECK(mp_emu::launch_count() == l0, "an empty list launched something");
  CHECK(*found.f32() == 0.0f, "found_inf");
}

// Bad arguments: MP_ERR_INVALID_ARGUMENT, nothing launched, nothing written.
EMU_TEST(unscale_bad_arguments) {
  Buf g(64, 0), inv(4, 0), found(4, 0);
  *inv.f32() = 0.5f;
  *found.f32() = 0.0f;
  const std::vector<uint8_t> before = g.snapshot();
  float* fi = found.f32();
  const float* is = inv.f32();
  struct Case {
    const char* what;
    std::vector<mp_unscale_segment> segs;
    int64_t n;
    float* found;
    const float* inv;
  };
  const Case cases[] = {
      {"nsegs < 0", {}, -1, fi, is},
      {"segs null", {}, 1, fi, is},
      {"unknown dtype", {{g.data(), 3, 4}}, 1, fi, is},
      {"negative dtype", {{g.data(), -1, 4}}, 1, fi, is},
      {"n < 0", {{g.data(), MP_F32, -1}}, 1, fi, is},
      {"g null", {{g.data(), MP_F32, 4}, {nullptr, MP_BF16, 4}}, 2, fi, is},
      {"found_inf null", {{g.data(), MP_F32, 4}}, 1, nullptr, is},
      {"inv_scale null", {{g.data(), MP_F32, 4}}, 1, fi, nullptr},
      // Misaligned pointers fault on a GPU (UBSan reports them here): rejected up front.
      {"f32 not 4-byte aligned", {{static_cast<char*>(g.data()) + 2, MP_F32, 4}}, 1, fi, is},
      {"fp16 odd address", {{static_cast<char*>(g.data()) + 1, MP_F16, 4}}, 1, fi, is},
  };
  for (const Case& c : cases) {
    set_context("%s", c.what);
    const int64_t l0 = mp_emu::launch_count();
    const mp_status st = mp_unscale_multi_cuda(c.segs.empty() ? nullptr : c.segs.data(), c.n,
                                               c.found, c.inv, nullptr);
    CHECK(st == MP_ERR_INVALID_ARGUMENT, "status %d", st);
    CHECK(mp_emu::launch_count() == l0, "launched");
  }
  CHECK(g.snapshot() == before && *found.f32() == 0.0f, "something was written");
}

// A failed launch: MP_ERR_CUDA, the error left for cudaGetLastError, which clears it.
EMU_TEST(unscale_launch_failure) {
  Caps caps(1, 0);  // one block per launch: three launches for this tensor
  Rng r(51);
  Grad g = make_grad(r, MP_F32, 2 * kChunk + 1, 0, 0, false);
  Buf inv(4, 0), found(4, 0);
  *inv.f32() = 0.5f;
  *found.f32() = 0.0f;
  const mp_unscale_segment seg = {g.dev.data(), MP_F32, g.n};
  mp_emu::fail_launch_in(1);
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_unscale_multi_cuda(&seg, 1, found.f32(), inv.f32(), nullptr) == MP_ERR_CUDA, "status");
  mp_emu::fail_launch_in(-1);
  CHECK(mp_emu::launch_count() - l0 == 2, "launched again after a failed launch");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "the error was not left pending");
  CHECK(cudaGetLastError() == cudaSuccess, "cudaGetLastError did not clear it");
}

// ---- update_scale_ ----

// The core's and the CUDA update with the fields of their struct as arguments.
mp_scale_update update_of(float* scale, int32_t* growth, const float* found, double growth_factor,
                          double backoff_factor, int64_t interval, int32_t* hyst,
                          int32_t hysteresis, double min_scale, double max_scale,
                          int64_t* stats) {
  return {scale,         growth,         found,    hyst,       stats,    growth_factor,
          backoff_factor, interval,      hysteresis, min_scale, max_scale};
}
mp_status cpu_update(float* scale, int32_t* growth, const float* found, double growth_factor,
                     double backoff_factor, int64_t interval, int32_t* hyst, int32_t hysteresis,
                     double min_scale, double max_scale, int64_t* stats) {
  const mp_scale_update u = update_of(scale, growth, found, growth_factor, backoff_factor,
                                      interval, hyst, hysteresis, min_scale, max_scale, stats);
  return mp_update_scale(&u);
}
mp_status cuda_update(float* scale, int32_t* growth, const float* found, double growth_factor,
                      double backoff_factor, int64_t interval, int32_t* hyst, int32_t hysteresis,
                      double min_scale, double max_scale, int64_t* stats, cudaStream_t stream) {
  const mp_scale_update u = update_of(scale, growth, found, growth_factor, backoff_factor,
                                      interval, hyst, hysteresis, min_scale, max_scale, stats);
  return mp_update_scale_cuda(&u, stream);
}

struct ScaleState {
  float scale;
  int32_t growth, hyst;
  int64_t stats[2];
};

// The loss-scale rule over a sequence of steps (found_inf from the pattern), on "CUDA" and the
// CPU side by side, compared after every step.
void scale_sequence(const char* what, float scale0, double growth, double backoff,
                    int64_t interval, int32_t hysteresis, double min_scale, double max_scale,
                    bool with_stats, bool with_hyst, uint64_t seed, int steps, int inf_per_16) {
  Rng r(seed);
  ScaleState cpu{scale0, 0, hysteresis, {0, 0}};
  Buf dev(sizeof(ScaleState), 0), found(4, 0);
  memcpy(dev.data(), &cpu, sizeof cpu);
  ScaleState* d = static_cast<ScaleState*>(dev.data());
  for (int s = 0; s < steps; ++s) {
    const float fi = static_cast<int>(r.below(16)) < inf_per_16 ? (r.below(2) ? 1.0f : 2.0f) : 0.0f;
    *found.f32() = fi;
    set_context("%s, step %d (found_inf %g)", what, s, fi);
    const mp_status a = cpu_update(&cpu.scale, &cpu.growth, &fi, growth, backoff, interval,
                                        with_hyst ? &cpu.hyst : nullptr, hysteresis, min_scale,
                                        max_scale, with_stats ? cpu.stats : nullptr);
    const mp_status b = cuda_update(&d->scale, &d->growth, found.f32(), growth, backoff,
                                             interval, with_hyst ? &d->hyst : nullptr, hysteresis,
                                             min_scale, max_scale,
                                             with_stats ? d->stats : nullptr, nullptr);
    CHECK(a == b, "status: core %d, cuda %d", a, b);
    if (!CHECK(bits_of(d->scale) == bits_of(cpu.scale) && d->growth == cpu.growth &&
                   d->hyst == cpu.hyst && d->stats[0] == cpu.stats[0] &&
                   d->stats[1] == cpu.stats[1],
               "cuda (%a, %d, %d, %lld, %lld) != core (%a, %d, %d, %lld, %lld)",
               static_cast<double>(d->scale), d->growth, d->hyst,
               static_cast<long long>(d->stats[0]), static_cast<long long>(d->stats[1]),
               static_cast<double>(cpu.scale), cpu.growth, cpu.hyst,
               static_cast<long long>(cpu.stats[0]), static_cast<long long>(cpu.stats[1]))) {
      return;
    }
  }
}

EMU_TEST(update_scale_rule_sequences) {
  scale_sequence("torch defaults", 65536.0f, 2.0, 0.5, 3, 1, 0, 0, false, false, 1, 300, 4);
  scale_sequence("stats", 1024.0f, 2.0, 0.5, 2, 1, 0, 0, true, false, 2, 300, 6);
  scale_sequence("hysteresis 3", 65536.0f, 2.0, 0.5, 4, 3, 0, 0, true, true, 3, 400, 7);
  scale_sequence("hysteresis 1 with tracker", 8.0f, 2.0, 0.5, 2, 1, 0, 0, true, true, 4, 200, 5);
  scale_sequence("min_scale", 4.0f, 2.0, 0.5, 50, 1, 1.0, 0, true, false, 5, 300, 10);
  scale_sequence("min above the scale", 0.25f, 2.0, 0.5, 50, 1, 1.0, 0, false, false, 6, 50, 10);
  scale_sequence("max_scale", 1.0f, 3.0, 0.5, 1, 1, 0, 1e6, true, false, 7, 300, 2);
  scale_sequence("growth to Inf is refused", 1e38f, 4.0, 0.5, 1, 1, 0, 0, false, false, 8, 20, 0);
  scale_sequence("down to subnormal and zero", 1e-30f, 2.0, 0.001, 1000, 1, 0, 0, false, false,
                 9, 40, 16);
  scale_sequence("inexact factors", 3.0f, 1.7, 0.3, 2, 2, 1e-3, 1e9, true, true, 10, 300, 6);
}

// A failed launch: MP_ERR_CUDA, the scale state as it was, the error left pending.
EMU_TEST(update_scale_launch_failure) {
  ScaleState before{1024.0f, 1, 2, {3, 4}};
  Buf dev(sizeof(ScaleState), 0), found(4, 0);
  memcpy(dev.data(), &before, sizeof before);
  *found.f32() = 0.0f;
  ScaleState* d = static_cast<ScaleState*>(dev.data());
  set_context("launch 0 fails");
  mp_emu::fail_launch_in(0);
  const int64_t l0 = mp_emu::launch_count();
  // Growth due on this step (interval 2, tracker 1): a launch that ran would change the state.
  CHECK(cuda_update(&d->scale, &d->growth, found.f32(), 2.0, 0.5, 2, &d->hyst, 2, 0, 0,
                    d->stats, nullptr) == MP_ERR_CUDA, "status");
  mp_emu::fail_launch_in(-1);
  CHECK(mp_emu::launch_count() - l0 == 1, "%lld launches",
        static_cast<long long>(mp_emu::launch_count() - l0));
  CHECK(memcmp(dev.data(), &before, sizeof before) == 0, "the scale state was written");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "the error was not left pending");
  set_context("the same call, no failure");
  CHECK(cuda_update(&d->scale, &d->growth, found.f32(), 2.0, 0.5, 2, &d->hyst, 2, 0, 0,
                    d->stats, nullptr) == MP_OK, "status");
  CHECK(d->scale == 2048.0f && d->growth == 0, "scale %g, growth tracker %d: want 2048, 0",
        static_cast<double>(d->scale), d->growth);
}

EMU_TEST(update_scale_bad_arguments) {
  Buf dev(64, 0), found(4, 0);
  float* scale = dev.f32();
  int32_t* growth = reinterpret_cast<int32_t*>(dev.f32() + 1);
  *scale = 2.0f;
  *growth = 0;
  *found.f32() = 0.0f;
  const int64_t l0 = mp_emu::launch_count();
  set_context("null scale / growth_tracker / found_inf, hysteresis without tracker");
  CHECK(cuda_update(nullptr, growth, found.f32(), 2, 0.5, 2, nullptr, 1, 0, 0, nullptr,
                             nullptr) == MP_ERR_INVALID_ARGUMENT, "scale null");
  CHECK(cuda_update(scale, nullptr, found.f32(), 2, 0.5, 2, nullptr, 1, 0, 0, nullptr,
                             nullptr) == MP_ERR_INVALID_ARGUMENT, "growth null");
  CHECK(cuda_update(scale, growth, nullptr, 2, 0.5, 2, nullptr, 1, 0, 0, nullptr,
                             nullptr) == MP_ERR_INVALID_ARGUMENT, "found_inf null");
  CHECK(cuda_update(scale, growth, found.f32(), 2, 0.5, 2, nullptr, 2, 0, 0, nullptr,
                             nullptr) == MP_ERR_INVALID_ARGUMENT, "hysteresis 2 without tracker");
  CHECK(mp_update_scale_cuda(nullptr, nullptr) == MP_ERR_INVALID_ARGUMENT, "null update");
  CHECK(mp_emu::launch_count() == l0, "launched");
  CHECK(*scale == 2.0f && *growth == 0, "written");
}

}  // namespace
