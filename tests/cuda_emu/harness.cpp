// The harness's runner: runs every registered test (or those whose name contains an argument),
// prints one line per test and exits non-zero if any check failed.
//
//   test_cuda_emu [--seed N] [--list] [name-substring ...]
#include "harness.h"

#include <stdarg.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

namespace emu_test {

std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}

namespace {
const char* g_test = "";
char g_context[512];
int64_t g_checks = 0, g_failures = 0, g_failures_in_test = 0;
bool g_line_open = false;  // the test's name is printed, its result not yet (a crash shows it)
constexpr int kReportPerTest = 12;
}  // namespace

bool check(bool cond, const char* file, int line, const char* fmt, ...) {
  ++g_checks;
  if (cond) return true;
  ++g_failures;
  if (g_failures_in_test++ < kReportPerTest) {
    if (g_line_open) printf("\n");
    g_line_open = false;
    const char* slash = strrchr(file, '/');
    printf("FAIL %s (%s:%d)%s%s: ", g_test, slash ? slash + 1 : file, line,
           g_context[0] ? " in " : "", g_context);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
  }
  return false;
}

void set_context(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_context, sizeof g_context, fmt, ap);
  va_end(ap);
}

// ---- Buf ----

namespace {
constexpr size_t kCanary = 32;
size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
}  // namespace

Buf::Buf(size_t bytes, unsigned misalign, bool mmapped) : bytes_(bytes), mmapped_(mmapped) {
  const size_t lead = kCanary + (misalign % 16u);
  total_ = lead + bytes + kCanary;
  if (mmapped) {
    total_ = (total_ + page_size() - 1) / page_size() * page_size();
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) abort();
    base_ = static_cast<uint8_t*>(p);
  } else {
    base_ = static_cast<uint8_t*>(aligned_alloc(64, (total_ + 63) / 64 * 64));
    if (base_ == nullptr) abort();
  }
  memset(base_, 0xFF, total_);
  data_ = base_ + lead;
}

Buf& Buf::operator=(Buf&& o) noexcept {
  if (this != &o) {
    this->~Buf();
    base_ = o.base_;
    total_ = o.total_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    mmapped_ = o.mmapped_;
    o.base_ = nullptr;
  }
  return *this;
}

Buf::~Buf() {
  if (base_ == nullptr) return;
  if (mmapped_) {
    munmap(base_, total_);
  } else {
    free(base_);
  }
  base_ = nullptr;
}

bool Buf::canaries_ok() const {
  const uint8_t* d = static_cast<const uint8_t*>(data_);
  for (const uint8_t* p = base_; p < d; ++p) {
    if (*p != 0xFF) return false;
  }
  for (const uint8_t* p = d + bytes_; p < base_ + total_; ++p) {
    if (*p != 0xFF) return false;
  }
  return true;
}

void Buf::protect(bool read_only) {
  if (!mmapped_) abort();
  mprotect(base_, total_, read_only ? PROT_READ : PROT_READ | PROT_WRITE);
}

// ---- values ----

float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

bool is_nan32(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

bool is_nan16(int dtype, uint16_t h) {
  return dtype == 1 ? (h & 0x7FFFu) > 0x7F80u : (h & 0x7FFFu) > 0x7C00u;
}

uint32_t random_f32_bits(Rng& r, int special_per_mille) {
  const uint32_t sign = (r.u32() & 1u) << 31;
  if (static_cast<int>(r.below(1000)) < special_per_mille) {
    static const uint32_t specials[] = {
        0x00000000u, 0x00000001u, 0x007FFFFFu, 0x00800000u,  // zero, subnormals, min normal
        0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x7FA5A5A5u,  // Inf, NaNs (quiet, signalling)
        0x7F7FFFFFu, 0x477FE000u, 0x477FF000u, 0x477FEFFFu,  // max; fp16 max, overflow edges
        0x3F808000u, 0x3F818000u, 0x3F801000u, 0x3F803000u,  // bf16 ties; fp16 ties
        0x33000000u, 0x33000001u, 0x387FC000u, 0x38800000u,  // fp16 subnormal range edges
        0x7F7F8000u, 0x7F7FFFFFu,                            // bf16 overflow edges
    };
    return sign | specials[r.below(sizeof specials / sizeof specials[0])];
  }
  // Exponents from about 2^-30 to 2^30 mostly, with some across the whole range.
  const uint32_t e = r.below(8) == 0 ? static_cast<uint32_t>(r.below(254)) + 1u
                                     : static_cast<uint32_t>(97 + r.below(60));
  return sign | (e << 23) | (r.u32() & 0x7FFFFFu);
}

uint16_t random_16_bits(Rng& r, int dtype, int special_per_mille) {
  if (static_cast<int>(r.below(1000)) < special_per_mille) {
    static const uint16_t bf16[] = {0x0000, 0x0001, 0x007F, 0x0080, 0x7F80, 0x7FC0, 0x7F81, 0x7F7F};
    static const uint16_t fp16[] = {0x0000, 0x0001, 0x03FF, 0x0400, 0x7C00, 0x7E00, 0x7C01, 0x7BFF};
    const uint16_t sign = static_cast<uint16_t>((r.u32() & 1u) << 15);
    return static_cast<uint16_t>(sign | (dtype == 1 ? bf16[r.below(8)] : fp16[r.below(8)]));
  }
  if (dtype == 1) {  // exponents ~2^-30 .. 2^30
    const uint32_t e = static_cast<uint32_t>(97 + r.below(60));
    return static_cast<uint16_t>(((r.u32() & 1u) << 15) | (e << 7) | (r.u32() & 0x7Fu));
  }
  const uint32_t e = static_cast<uint32_t>(1 + r.below(30));  // every finite exponent
  return static_cast<uint16_t>(((r.u32() & 1u) << 15) | (e << 10) | (r.u32() & 0x3FFu));
}

std::vector<uint8_t> random_elems(Rng& r, int dtype, int64_t n, int special_per_mille) {
  std::vector<uint8_t> out(static_cast<size_t>(n) * elem_bytes(dtype));
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == MP_F32) {
      const uint32_t u = random_f32_bits(r, special_per_mille);
      memcpy(&out[4 * i], &u, 4);
    } else {
      const uint16_t h = random_16_bits(r, dtype, special_per_mille);
      memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

bool same_bits(const void* got, const void* want, int64_t n, int bytes, int dtype,
               bool nan_any_payload, const char* what, const char* file, int line) {
  int64_t bad = 0, first = -1;
  uint32_t first_got = 0, first_want = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t g, w;
    bool gn, wn;
    if (bytes == 4) {
      g = static_cast<const uint32_t*>(got)[i];
      w = static_cast<const uint32_t*>(want)[i];
      gn = is_nan32(g);
      wn = is_nan32(w);
    } else if (bytes == 1) {  // fp8 codes: compared as raw bytes
      g = static_cast<const uint8_t*>(got)[i];
      w = static_cast<const uint8_t*>(want)[i];
      gn = wn = false;
    } else {
      g = static_cast<const uint16_t*>(got)[i];
      w = static_cast<const uint16_t*>(want)[i];
      gn = is_nan16(dtype, static_cast<uint16_t>(g));
      wn = is_nan16(dtype, static_cast<uint16_t>(w));
    }
    if (g == w || (nan_any_payload && gn && wn)) continue;
    if (bad++ == 0) {
      first = i;
      first_got = g;
      first_want = w;
    }
  }
  return check(bad == 0, file, line,
               "%s: %lld of %lld elements differ, first [%lld]: got 0x%0*x, want 0x%0*x", what,
               static_cast<long long>(bad), static_cast<long long>(n),
               static_cast<long long>(first), bytes * 2, first_got, bytes * 2, first_want);
}

void noop_kernel() {}

}  // namespace emu_test

int main(int argc, char** argv) {
  using namespace emu_test;
  uint64_t seed = 0x6D70657874ull;
  bool list = false;
  std::vector<const char*> filters;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      seed = strtoull(argv[++i], nullptr, 0);
    } else if (strcmp(argv[i], "--list") == 0) {
      list = true;
    } else {
      filters.push_back(argv[i]);
    }
  }
  int run = 0, failed = 0;
  // A first fiber switch before any output: AddressSanitizer prints its one-time note about
  // swapcontext here rather than in the middle of a test's line.
  if (!list) mp_emu::launch(noop_kernel, 1, 1, 0, nullptr);
  for (const Test& t : registry()) {
    bool selected = filters.empty();
    for (const char* f : filters) selected = selected || strstr(t.name, f) != nullptr;
    if (!selected) continue;
    if (list) {
      printf("%s\n", t.name);
      continue;
    }
    mp_emu::set_seed(seed);
    mp_emu::set_sm_count(132);
    g_test = t.name;
    g_context[0] = '\0';
    g_failures_in_test = 0;
    const int64_t checks0 = g_checks, launches0 = mp_emu::launch_count();
    const int64_t blocks0 = mp_emu::blocks_run();
    printf("%-40s ", t.name);
    fflush(stdout);
    g_line_open = true;
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    t.fn();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double secs = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    ++run;
    if (cudaPeekAtLastError() != cudaSuccess) {
      g_context[0] = '\0';
      CHECK(false, "a CUDA error was left pending: %d", static_cast<int>(cudaGetLastError()));
    }
    if (g_failures_in_test > 0) ++failed;
    if (!g_line_open) printf("%-40s ", t.name);
    printf("%-6s %7lld checks %5lld launches %7lld blocks %6.2f s\n",
           g_failures_in_test ? "FAILED" : "ok",
           static_cast<long long>(g_checks - checks0),
           static_cast<long long>(mp_emu::launch_count() - launches0),
           static_cast<long long>(mp_emu::blocks_run() - blocks0), secs);
    fflush(stdout);
  }
  if (!list) {
    printf("cuda-emu: %d tests, %d failed, %lld checks (seed %llu)\n", run, failed,
           static_cast<long long>(g_checks), static_cast<unsigned long long>(seed));
  }
  return failed ? 1 : 0;
}
