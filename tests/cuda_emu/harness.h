// The test harness of tests/cuda_emu: a small registry of test functions, checks that report
// the first mismatches, "device" buffers with canaries, value generators and bit comparisons.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "access.cuh"  // mp_cuda::test_caps

namespace emu_test {

// ---- registry and checks ----

struct Test {
  const char* name;
  void (*fn)();
};
std::vector<Test>& registry();
struct Register {
  Register(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};
#define EMU_TEST(name)                                         \
  static void name();                                          \
  static ::emu_test::Register register_##name(#name, &name);   \
  static void name()

// Counts a check; on failure prints where and what (the first few per test) and marks the test
// failed. Returns cond.
bool check(bool cond, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define CHECK(cond, ...) ::emu_test::check((cond), __FILE__, __LINE__, __VA_ARGS__)

// A short description of the case being run, printed with every failure of the test.
void set_context(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- "device" memory ----

// Host memory standing in for device memory: `bytes` bytes whose address is `misalign` modulo
// 16, between 32-byte canaries of 0xFF bytes (a NaN in fp32, bf16 and fp16: a kernel that reads
// past its tensor sees a NaN, one that writes there breaks a canary; check_canaries reports it).
// Read-only buffers (protect()) live in their own pages, so that any store into them faults.
class Buf {
 public:
  Buf() = default;
  Buf(size_t bytes, unsigned misalign, bool mmapped = false);
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept { *this = static_cast<Buf&&>(o); }
  Buf& operator=(Buf&& o) noexcept;
  ~Buf();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  float* f32() const { return static_cast<float*>(data_); }
  uint16_t* u16() const { return static_cast<uint16_t*>(data_); }
  void fill(const void* src) {
    if (bytes_ > 0) memcpy(data_, src, bytes_);
  }
  std::vector<uint8_t> snapshot() const {
    const uint8_t* p = static_cast<const uint8_t*>(data_);
    return std::vector<uint8_t>(p, p + bytes_);
  }
  bool canaries_ok() const;
  void protect(bool read_only);  // mmapped buffers only

 private:
  uint8_t* base_ = nullptr;
  size_t total_ = 0;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool mmapped_ = false;
};

// ---- values ----

// splitmix64, for the test data.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  uint64_t below(uint64_t n) { return next() % n; }
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  }
};

// A random address offset modulo 16 bytes that keeps `bytes`-sized elements aligned.
inline unsigned random_offset(Rng& r, int bytes) {
  return static_cast<unsigned>(r.below(16 / bytes)) * static_cast<unsigned>(bytes);
}

// An element's bytes and name by mp_dtype (fp32, bf16, fp16).
inline int elem_bytes(int dtype) { return dtype == MP_F32 ? 4 : 2; }
inline const char* dtype_name(int dtype) {
  return dtype == MP_F32 ? "f32" : dtype == MP_BF16 ? "bf16" : "fp16";
}

float f32_of(uint32_t u);
uint32_t bits_of(float f);
bool is_nan32(uint32_t u);
bool is_nan16(int dtype, uint16_t h);  // dtype: 1 bf16, 2 fp16 (mp_dtype numbering)

// fp32 bit patterns of mixed magnitudes, with special values (signed zeros, subnormals, +-Inf,
// NaNs with payloads, the largest finite values, bf16/fp16 rounding ties) at rate special/1000.
uint32_t random_f32_bits(Rng& r, int special_per_mille);
// A random bf16 / fp16 bit pattern, specials at the same rate.
uint16_t random_16_bits(Rng& r, int dtype, int special_per_mille);
// n random elements of dtype (random_f32_bits / random_16_bits), as raw bytes.
std::vector<uint8_t> random_elems(Rng& r, int dtype, int64_t n, int special_per_mille);

// Compares n elements of `bytes`-sized raw values; NaNs match any NaN when nan_any_payload
// (the round-to-nearest paths, where the GPU's NaN bits differ from the CPU's by design).
// One check: reports how many differ and the first one, with what and the caller's line;
// returns true when all match.
bool same_bits(const void* got, const void* want, int64_t n, int bytes, int dtype,
               bool nan_any_payload, const char* what, const char* file = __builtin_FILE(),
               int line = __builtin_LINE());

// ---- emulator state around a test ----

// Sets the packers' caps for the scope of one test.
struct Caps {
  Caps(int64_t max_blocks, int max_pieces) {
    mp_cuda::test_caps.max_blocks = max_blocks;
    mp_cuda::test_caps.max_pieces = max_pieces;
  }
  ~Caps() { mp_cuda::test_caps = mp_cuda::LaunchCaps{0, 0}; }
};

}  // namespace emu_test
