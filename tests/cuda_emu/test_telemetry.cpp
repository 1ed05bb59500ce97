// unscale_stats_ on CUDA (cuda/telemetry.cu) against the C core (csrc/core/telemetry.c): the
// gradients, found_inf, every count, max_abs and first_nonfinite, bit for bit.
#include "harness.h"
#include "mpext/telemetry.h"
#include "mpext/telemetry_cuda.h"

namespace {

using namespace emu_test;

constexpr int64_t kChunk = 65536;

struct Spec {
  int dtype;
  int64_t n;
  unsigned misalign;
};

// Runs the list on "CUDA" and through the core (one mp_unscale_stats per tensor) from the same
// starting totals, and compares everything.
void stats_case(const std::vector<Spec>& specs, float inv, const float* stat_inv, uint64_t seed,
                int special) {
  Rng r(seed);
  const bool check_only = inv == 1.0f;
  const int64_t nt = static_cast<int64_t>(specs.size());
  std::vector<Buf> dev;
  std::vector<std::vector<uint8_t>> ref;
  std::vector<mp_stats_segment> segs;
  for (int64_t k = 0; k < nt; ++k) {
    const Spec& s = specs[k];
    const std::vector<uint8_t> host = random_elems(r, s.dtype, s.n, special);
    dev.emplace_back(host.size(), s.misalign, check_only);
    dev.back().fill(host.data());
    ref.push_back(host);
  }
  // Starting totals: non-zero, so that accumulation is checked too.
  std::vector<int64_t> counts0(static_cast<size_t>(nt) * MP_TEL_NCOUNTS);
  std::vector<float> amax0(static_cast<size_t>(nt));
  for (size_t i = 0; i < counts0.size(); ++i) counts0[i] = static_cast<int64_t>(r.below(5));
  for (size_t i = 0; i < amax0.size(); ++i) amax0[i] = r.below(4) == 0 ? 1e-3f : 0.0f;
  const int64_t first0 = INT64_MAX;
  Buf c_dev(counts0.size() * 8 + 8, 0), m_dev(amax0.size() * 4 + 4, 0), f_dev(8, 0),
      inv_dev(4, 0), sinv_dev(4, 0), found_dev(4, 0);
  if (!counts0.empty()) memcpy(c_dev.data(), counts0.data(), counts0.size() * 8);
  if (!amax0.empty()) memcpy(m_dev.data(), amax0.data(), amax0.size() * 4);
  memcpy(f_dev.data(), &first0, 8);
  memcpy(inv_dev.data(), &inv, 4);
  if (stat_inv) memcpy(sinv_dev.data(), stat_inv, 4);
  *found_dev.f32() = 0.0f;
  for (int64_t k = 0; k < nt; ++k) {
    segs.push_back({dev[k].data(), specs[k].dtype, specs[k].n, k});
    if (check_only) dev[k].protect(true);
  }
  // The core, tensor by tensor.
  std::vector<int64_t> counts = counts0;
  std::vector<float> amax = amax0;
  int64_t first = first0;
  int32_t found = 0;
  for (int64_t k = 0; k < nt; ++k) {
    if (specs[k].n == 0) continue;
    mp_grad_stats s = {{0, 0, 0, 0}, 0.0f};
    CHECK(mp_unscale_stats(ref[k].data(), static_cast<mp_dtype>(specs[k].dtype), specs[k].n, inv,
                           stat_inv ? *stat_inv : inv, &found, &s) == MP_OK, "core status");
    for (int j = 0; j < MP_TEL_NCOUNTS; ++j) counts[k * MP_TEL_NCOUNTS + j] += s.count[j];
    amax[k] = mp_tel_max_bits(amax[k], s.max_abs);
    if (s.count[MP_TEL_NONFINITE] > 0 && k < first) first = k;
  }
  const mp_status st = mp_unscale_stats_multi_cuda(
      segs.data(), nt, found_dev.f32(), inv_dev.f32(), stat_inv ? sinv_dev.f32() : nullptr,
      static_cast<int64_t*>(c_dev.data()), m_dev.f32(), static_cast<int64_t*>(f_dev.data()),
      nullptr);
  CHECK(st == MP_OK, "status %d", st);
  for (int64_t k = 0; k < nt; ++k) {
    if (check_only) dev[k].protect(false);
    char what[64];
    snprintf(what, sizeof what, "grad %lld", static_cast<long long>(k));
    same_bits(dev[k].data(), ref[k].data(), specs[k].n, elem_bytes(specs[k].dtype),
              specs[k].dtype, true, what);
    CHECK(dev[k].canaries_ok(), "%s: a store outside the tensor", what);
  }
  const int64_t* cd = static_cast<const int64_t*>(c_dev.data());
  for (size_t i = 0; i < counts.size(); ++i) {
    CHECK(cd[i] == counts[i], "counts[%zu][%zu] = %lld, core %lld", i / 4, i % 4,
          static_cast<long long>(cd[i]), static_cast<long long>(counts[i]));
  }
  for (size_t i = 0; i < amax.size(); ++i) {
    CHECK(bits_of(m_dev.f32()[i]) == bits_of(amax[i]), "max_abs[%zu] = %a, core %a", i,
          static_cast<double>(m_dev.f32()[i]), static_cast<double>(amax[i]));
  }
  int64_t fd;
  memcpy(&fd, f_dev.data(), 8);
  CHECK(fd == first, "first_nonfinite %lld, core %lld", static_cast<long long>(fd),
        static_cast<long long>(first));
  CHECK(*found_dev.f32() == (found ? 1.0f : 0.0f), "found_inf %g, core %d",
        static_cast<double>(*found_dev.f32()), found);
}

EMU_TEST(telemetry_dtypes_sizes_alignments) {
  const int64_t sizes[] = {1, 7, 8, 9, 17, 1000, kChunk - 1, kChunk + 9};
  const float invs[] = {0.5f, 0x1p-16f, 1.0f, 3.0f};
  const float sinv = 0x1p-12f;
  uint64_t seed = 1;
  for (int dtype = 0; dtype < MP_DTYPE_COUNT; ++dtype) {
    for (int64_t n : sizes) {
      for (unsigned mis = 0; mis < 16; mis += 2 * elem_bytes(dtype)) {
        if (n >= kChunk && mis != 0) continue;
        const float inv = invs[seed % 4];
        set_context("dtype %d n=%lld misalign=%u inv=%a", dtype, static_cast<long long>(n), mis,
                    static_cast<double>(inv));
        stats_case({{dtype, n, mis}}, inv, inv == 1.0f ? &sinv : nullptr, ++seed,
                   static_cast<int>(seed % 3) * 150);
      }
    }
  }
}

// A mixed list split across chunks and launches (caps: 2 blocks, 3 pieces per launch), empty
// tensors included, NaN/Inf in some: rows, first_nonfinite and the per-block merges.
EMU_TEST(telemetry_mixed_list_split) {
  Caps caps(2, 3);
  std::vector<Spec> specs;
  Rng r(7);
  for (int k = 0; k < 12; ++k) {
    const int dtype = static_cast<int>(r.below(3));
    const int64_t n = k % 5 == 0 ? 0 : static_cast<int64_t>(r.below(5000));
    specs.push_back({dtype, n, random_offset(r, elem_bytes(dtype))});
  }
  specs.push_back({MP_F16, 2 * kChunk + 3, 2});
  set_context("12 tensors, clean");
  stats_case(specs, 0x1p-8f, nullptr, 5, 0);
  set_context("12 tensors, specials");
  stats_case(specs, 0.25f, nullptr, 6, 20);
}

EMU_TEST(telemetry_bad_arguments) {
  Buf g(64, 0), inv(4, 0), found(4, 0), c(64, 0), m(16, 0), f(8, 0);
  *inv.f32() = 0.5f;
  const mp_stats_segment ok = {g.data(), MP_F32, 4, 0};
  const mp_stats_segment neg_row = {g.data(), MP_F32, 4, -1};
  const int64_t l0 = mp_emu::launch_count();
  int64_t* cp = static_cast<int64_t*>(c.data());
  int64_t* fp = static_cast<int64_t*>(f.data());
  set_context("null counts / max_abs / first, negative row, bad dtype");
  CHECK(mp_unscale_stats_multi_cuda(&ok, 1, found.f32(), inv.f32(), nullptr, nullptr, m.f32(),
                                    fp, nullptr) == MP_ERR_INVALID_ARGUMENT, "counts null");
  CHECK(mp_unscale_stats_multi_cuda(&ok, 1, found.f32(), inv.f32(), nullptr, cp, nullptr, fp,
                                    nullptr) == MP_ERR_INVALID_ARGUMENT, "max_abs null");
  CHECK(mp_unscale_stats_multi_cuda(&ok, 1, found.f32(), inv.f32(), nullptr, cp, m.f32(),
                                    nullptr, nullptr) == MP_ERR_INVALID_ARGUMENT, "first null");
  CHECK(mp_unscale_stats_multi_cuda(&neg_row, 1, found.f32(), inv.f32(), nullptr, cp, m.f32(),
                                    fp, nullptr) == MP_ERR_INVALID_ARGUMENT, "row < 0");
  CHECK(mp_unscale_stats_multi_cuda(&ok, 1, nullptr, inv.f32(), nullptr, cp, m.f32(), fp,
                                    nullptr) == MP_ERR_INVALID_ARGUMENT, "found null");
  CHECK(mp_emu::launch_count() == l0, "launched");
}

}  // namespace
