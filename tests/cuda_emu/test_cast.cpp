// cast_ / to_bf16 / to_fp16 / to_fp32 on CUDA (cuda/cast.cu) against the C core
// (csrc/core/cast.c), stochastic rounding included.
#include "harness.h"
#include "mpext/cast.h"
#include "mpext/cast_cuda.h"

namespace {

using namespace emu_test;

constexpr int64_t kChunk = 65536;  // the multi-tensor kernel's elements per block

// The test's own names for the dtype pairs it covers: four casts and two copies.
enum Kind { F32_TO_BF16, F32_TO_F16, BF16_TO_F32, F16_TO_F32, COPY32, COPY16, KIND_COUNT };
int kind_src(int kind) {
  static const int src[] = {MP_F32, MP_F32, MP_BF16, MP_F16, MP_F32, MP_F16};
  return src[kind];
}
int kind_dst(int kind) {
  static const int dst[] = {MP_BF16, MP_F16, MP_F32, MP_F32, MP_F32, MP_F16};
  return dst[kind];
}
int src_bytes(int kind) { return MP_DTYPE_BYTES(kind_src(kind)); }
int dst_bytes(int kind) { return MP_DTYPE_BYTES(kind_dst(kind)); }
const char* kind_name(int kind) {
  static const char* names[] = {"f32->bf16", "f32->fp16", "bf16->f32",
                                "fp16->f32", "copy32",    "copy16"};
  return names[kind];
}
// The dtype (mp_dtype numbering) of a 16-bit destination, for NaN tests.
int dst16_dtype(int kind) { return kind == F32_TO_F16 ? MP_F16 : MP_BF16; }

// A segment of the C API.
mp_cast_segment seg_of(int kind, const void* src, void* dst, int64_t n, uint64_t position) {
  return {src, dst, kind_src(kind), kind_dst(kind), n, position};
}

struct Seg {
  int kind;
  int64_t n;
  unsigned mis_src, mis_dst;
  uint64_t sr_position;
  Buf src, dst;
  std::vector<uint8_t> want;
};

// Random source values of the kind's type (specials included), the destination pre-filled with
// a pattern that no conversion produces everywhere, and the core's result in want.
void prepare(Seg& s, Rng& r, bool stochastic, uint64_t seed) {
  const int sb = src_bytes(s.kind), db = dst_bytes(s.kind);
  std::vector<uint8_t> src(static_cast<size_t>(s.n) * sb);
  for (int64_t i = 0; i < s.n; ++i) {
    if (sb == 4) {
      const uint32_t u = random_f32_bits(r, 30);
      memcpy(&src[4 * i], &u, 4);
    } else {
      const int d = s.kind == F16_TO_F32 ? MP_F16 : MP_BF16;
      const uint16_t h = random_16_bits(r, s.kind == COPY16 ? MP_F16 : d, 30);
      memcpy(&src[2 * i], &h, 2);
    }
  }
  s.src = Buf(src.size(), s.mis_src);
  s.src.fill(src.data());
  s.dst = Buf(static_cast<size_t>(s.n) * db, s.mis_dst);
  if (s.n > 0) memset(s.dst.data(), 0x5A, s.dst.bytes());
  s.want.assign(static_cast<size_t>(s.n) * db, 0);
  const mp_status st = mp_cast(src.data(), static_cast<mp_dtype>(kind_src(s.kind)), s.want.data(),
                               static_cast<mp_dtype>(kind_dst(s.kind)), s.n, stochastic, seed,
                               s.sr_position, /*dst_fresh=*/0);
  CHECK(st == MP_OK, "core cast status %d", st);
}

// Compares dst with the core: bit for bit, except the NaN payloads of round-to-nearest
// conversions (the GPU's cvt gives its canonical NaN); stochastic rounding and copies exactly.
void compare(Seg& s, bool stochastic, const char* label) {
  char what[160];
  snprintf(what, sizeof what, "%s %s n %lld offsets %u/%u pos %llu", label, kind_name(s.kind),
           static_cast<long long>(s.n), s.mis_src, s.mis_dst,
           static_cast<unsigned long long>(s.sr_position));
  const bool exact = s.kind == COPY32 || s.kind == COPY16 ||
                     s.kind == BF16_TO_F32 ||
                     (stochastic && s.kind == F32_TO_BF16);
  same_bits(s.dst.data(), s.want.data(), s.n, dst_bytes(s.kind), dst16_dtype(s.kind), !exact,
            what);
  CHECK(s.src.canaries_ok() && s.dst.canaries_ok(), "%s: a store outside the arrays", what);
}

// The single-tensor launchers (grid-stride kernels) at sizes around the vector width and beyond
// the grid's reach (one SM: 8 blocks of 256 threads x 8 elements = 16384 elements a sweep), every
// relative alignment, and stochastic rounding at offsets that start anywhere in a Philox block,
// including the wrap of the 64-bit position.
EMU_TEST(cast_single_launchers) {
  mp_emu::set_sm_count(1);
  const int64_t sizes[] = {1, 3, 7, 8, 9, 17, 64, 1000, 16384, 16384 * 3 + 13};
  const unsigned offs[][2] = {{0, 0}, {4, 2}, {8, 8}, {0, 6}, {12, 4}, {2, 2}};
  const uint64_t positions[] = {0, 1, 2, 3, 5, ~uint64_t{0} - 6};
  uint64_t seed = 1;
  for (int variant = 0; variant < 5; ++variant) {  // bf16, bf16 SR, fp16, from bf16, from fp16
    const int kind = variant <= 1 ? F32_TO_BF16 : variant == 2 ? F32_TO_F16
                                                       : variant == 3 ? BF16_TO_F32
                                                                      : F16_TO_F32;
    const bool sr = variant == 1;
    for (int64_t n : sizes) {
      for (const auto& o : offs) {
        if (src_bytes(kind) == 4 && o[0] % 4) continue;
        if (dst_bytes(kind) == 4 && o[1] % 4) continue;
        if (n > 1000 && &o - offs > 1) continue;  // the long ones aligned and misaligned only
        Rng r(++seed);
        Seg s{kind, n, o[0], o[1], sr ? positions[seed % 6] : 0, {}, {}, {}};
        const uint64_t key = 0x1234567890ABCDEFull * seed;
        prepare(s, r, sr, key);
        const mp_cast_segment seg = seg_of(kind, s.src.data(), s.dst.data(), n, s.sr_position);
        const mp_status st = mp_cast_cuda(&seg, sr, key, nullptr);
        set_context("single %s%s", kind_name(kind), sr ? " SR" : "");
        CHECK(st == MP_OK, "status %d", st);
        compare(s, sr, "single");
      }
    }
  }
}

// The single launchers' argument checks and n == 0.
EMU_TEST(cast_single_bad_arguments_and_empty) {
  Buf a(64, 0), b(64, 0);
  const int64_t l0 = mp_emu::launch_count();
  auto single = [&](int kind, const void* s, void* d, int64_t n, int sr) {
    const mp_cast_segment seg = seg_of(kind, s, d, n, 0);
    return mp_cast_cuda(&seg, sr, 1, nullptr);
  };
  set_context("n < 0, null pointers, n == 0, unknown pairs");
  CHECK(single(F32_TO_BF16, a.data(), b.data(), -1, 0) == MP_ERR_INVALID_ARGUMENT, "n < 0");
  CHECK(single(F32_TO_F16, nullptr, b.data(), 4, 0) == MP_ERR_INVALID_ARGUMENT, "src null");
  CHECK(single(BF16_TO_F32, a.data(), nullptr, 4, 0) == MP_ERR_INVALID_ARGUMENT, "dst null");
  CHECK(single(F32_TO_F16, a.data(), b.data(), 4, 1) == MP_ERR_INVALID_ARGUMENT, "SR to fp16");
  CHECK(mp_cast_cuda(nullptr, 0, 0, nullptr) == MP_ERR_INVALID_ARGUMENT, "null segment");
  const mp_cast_segment bf16_to_fp16 = {a.data(), b.data(), MP_BF16, MP_F16, 4, 0};
  CHECK(mp_cast_cuda(&bf16_to_fp16, 0, 0, nullptr) == MP_ERR_INVALID_ARGUMENT, "bf16 -> fp16");
  // Misaligned pointers fault on a GPU (UBSan reports them here): rejected up front.
  char* ac = static_cast<char*>(a.data());
  char* bc = static_cast<char*>(b.data());
  set_context("pointers not aligned to their element size");
  CHECK(single(F32_TO_BF16, ac + 2, b.data(), 4, 0) == MP_ERR_INVALID_ARGUMENT, "f32 src at +2");
  CHECK(single(F32_TO_F16, a.data(), bc + 1, 4, 0) == MP_ERR_INVALID_ARGUMENT, "fp16 dst at +1");
  CHECK(single(F16_TO_F32, a.data(), bc + 2, 4, 0) == MP_ERR_INVALID_ARGUMENT, "f32 dst at +2");
  CHECK(single(F32_TO_BF16, a.data(), bc + 3, 4, 1) == MP_ERR_INVALID_ARGUMENT, "bf16 dst at +3");
  CHECK(single(F32_TO_BF16, nullptr, nullptr, 0, 1) == MP_OK, "n == 0");
  CHECK(single(F16_TO_F32, nullptr, nullptr, 0, 0) == MP_OK, "n == 0");
  CHECK(mp_emu::launch_count() == l0, "launched");
}

// One multi-tensor call over segments of every kind, zero-size ones, odd sizes, chunk-crossing
// ones and every relative alignment; round to nearest and stochastic.
EMU_TEST(cast_multi_every_kind) {
  for (int stochastic = 0; stochastic < 2; ++stochastic) {
    Rng r(10 + stochastic);
    const uint64_t key = stochastic ? 0xDEADBEEFCAFEF00Dull : 0;
    std::vector<Seg> segs;
    for (int k = 0; k < 60; ++k) {
      int kind = static_cast<int>(r.below(KIND_COUNT));
      if (stochastic && kind == F32_TO_F16) kind = F32_TO_BF16;
      const int64_t n = k % 9 == 0 ? 0 : k == 5 ? kChunk + 17 : static_cast<int64_t>(r.below(700));
      const unsigned ms = random_offset(r, src_bytes(kind)), md = random_offset(r, dst_bytes(kind));
      segs.push_back(Seg{kind, n, ms, md, r.next() >> static_cast<int>(r.below(64)),
                         {}, {}, {}});
    }
    std::vector<mp_cast_segment> cs;
    for (Seg& s : segs) {
      prepare(s, r, stochastic, key);
      cs.push_back(seg_of(s.kind, s.src.data(), s.dst.data(), s.n, s.sr_position));
    }
    set_context("60 segments, stochastic %d", stochastic);
    CHECK(mp_cast_multi_cuda(cs.data(), static_cast<int64_t>(cs.size()), stochastic, key,
                             nullptr) == MP_OK, "status");
    for (Seg& s : segs) compare(s, stochastic, "multi");
  }
}

// Splits: caps of 2 blocks and 3 pieces per launch; segments across chunks and launches,
// stochastic rounding continuing its stream across the cut; then more segments than one
// launch's argument holds at the real limits.
EMU_TEST(cast_multi_splits) {
  for (int stochastic = 0; stochastic < 2; ++stochastic) {
    Rng r(20 + stochastic);
    const uint64_t key = 77 + stochastic;
    std::vector<Seg> segs;
    segs.push_back(Seg{F32_TO_BF16, 3 * kChunk + 3, 4, 2, 1, {}, {}, {}});
    segs.push_back(Seg{BF16_TO_F32, kChunk + 1, 2, 4, 0, {}, {}, {}});
    segs.push_back(Seg{COPY16, 5, 0, 0, 0, {}, {}, {}});
    segs.push_back(Seg{stochastic ? COPY32 : F32_TO_F16, 2 * kChunk, 0, 0, 0,
                       {}, {}, {}});
    segs.push_back(Seg{F32_TO_BF16, 2 * kChunk - 1, 8, 8, ~uint64_t{0} - 100000, {}, {},
                       {}});
    std::vector<mp_cast_segment> cs;
    for (Seg& s : segs) {
      prepare(s, r, stochastic, key);
      cs.push_back(seg_of(s.kind, s.src.data(), s.dst.data(), s.n, s.sr_position));
    }
    Caps caps(2, 3);
    set_context("caps 2 blocks / 3 pieces, stochastic %d", stochastic);
    const int64_t l0 = mp_emu::launch_count();
    CHECK(mp_cast_multi_cuda(cs.data(), static_cast<int64_t>(cs.size()), stochastic, key,
                             nullptr) == MP_OK, "status");
    CHECK(mp_emu::launch_count() - l0 >= 6, "%lld launches: the caps did not split the work",
          static_cast<long long>(mp_emu::launch_count() - l0));
    for (Seg& s : segs) compare(s, stochastic, "split");
  }
  Rng r(30);
  std::vector<Seg> segs;
  for (int k = 0; k < 250; ++k) {
    segs.push_back(Seg{k % KIND_COUNT == F32_TO_F16 ? F32_TO_BF16
                                                                     : k % KIND_COUNT,
                       1 + k % 11, 0, 0, static_cast<uint64_t>(k) * 1000, {}, {}, {}});
  }
  std::vector<mp_cast_segment> cs;
  for (Seg& s : segs) {
    prepare(s, r, true, 5);
    cs.push_back(seg_of(s.kind, s.src.data(), s.dst.data(), s.n, s.sr_position));
  }
  set_context("250 segments");
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_cast_multi_cuda(cs.data(), 250, 1, 5, nullptr) == MP_OK, "status");
  CHECK(mp_emu::launch_count() - l0 >= 3, "250 segments in %lld launches",
        static_cast<long long>(mp_emu::launch_count() - l0));
  for (Seg& s : segs) compare(s, true, "250");
}

EMU_TEST(cast_multi_bad_arguments_and_empty) {
  Buf a(64, 0), b(64, 0);
  const std::vector<uint8_t> before = b.snapshot();
  struct Case {
    const char* what;
    mp_cast_segment seg;
    int stochastic;
  };
  char* ac = static_cast<char*>(a.data());
  char* bc = static_cast<char*>(b.data());
  const Case cases[] = {
      {"unknown src dtype", {a.data(), b.data(), MP_DTYPE_COUNT, MP_F32, 4, 0}, 0},
      {"negative dst dtype", {a.data(), b.data(), MP_F32, -1, 4, 0}, 0},
      {"bf16 -> fp16", {a.data(), b.data(), MP_BF16, MP_F16, 4, 0}, 0},
      {"n < 0", seg_of(COPY32, a.data(), b.data(), -4, 0), 0},
      {"src null", seg_of(COPY32, nullptr, b.data(), 4, 0), 0},
      {"dst null", seg_of(F16_TO_F32, a.data(), nullptr, 4, 0), 0},
      {"stochastic fp16", seg_of(F32_TO_F16, a.data(), b.data(), 4, 0), 1},
      // Misaligned pointers fault on a GPU (UBSan reports them here): rejected up front.
      {"f32 src at +2", seg_of(F32_TO_BF16, ac + 2, b.data(), 4, 0), 1},
      {"bf16 src at +1", seg_of(BF16_TO_F32, ac + 1, b.data(), 4, 0), 0},
      {"f32 dst at +6", seg_of(F16_TO_F32, a.data(), bc + 6, 4, 0), 0},
      {"copy16 dst at +1", seg_of(COPY16, a.data(), bc + 1, 4, 0), 0},
  };
  for (const Case& c : cases) {
    const mp_cast_segment segs[2] = {seg_of(COPY16, a.data(), b.data(), 8, 0), c.seg};
    set_context("%s", c.what);
    const int64_t l0 = mp_emu::launch_count();
    CHECK(mp_cast_multi_cuda(segs, 2, c.stochastic, 1, nullptr) == MP_ERR_INVALID_ARGUMENT,
          "status");
    CHECK(mp_emu::launch_count() == l0, "launched");
  }
  set_context("null list, negative count, empty lists");
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_cast_multi_cuda(nullptr, 1, 0, 0, nullptr) == MP_ERR_INVALID_ARGUMENT, "null");
  CHECK(mp_cast_multi_cuda(nullptr, -1, 0, 0, nullptr) == MP_ERR_INVALID_ARGUMENT, "count");
  CHECK(mp_cast_multi_cuda(nullptr, 0, 1, 0, nullptr) == MP_OK, "empty");
  const mp_cast_segment zero = seg_of(F32_TO_F16, nullptr, nullptr, 0, 0);
  CHECK(mp_cast_multi_cuda(&zero, 1, 0, 0, nullptr) == MP_OK, "zero-size");
  CHECK(mp_emu::launch_count() == l0, "launched");
  CHECK(b.snapshot() == before, "written");
}

EMU_TEST(cast_launch_failure) {
  Buf a(4 * 100, 0), b(2 * 100, 0);
  mp_emu::fail_launch_in(0);
  set_context("single and multi");
  const mp_cast_segment one = seg_of(F32_TO_BF16, a.data(), b.data(), 100, 0);
  CHECK(mp_cast_cuda(&one, 0, 0, nullptr) == MP_ERR_CUDA, "single");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "pending");
  mp_emu::fail_launch_in(0);
  CHECK(mp_cast_multi_cuda(&one, 1, 0, 0, nullptr) == MP_ERR_CUDA, "multi");
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "pending");
  mp_emu::fail_launch_in(-1);
}

}  // namespace
