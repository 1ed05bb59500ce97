// The emulator itself: barriers, __syncthreads_or, shared memory per block, the random orders,
// the launch checks, and the shim's conversions against NVIDIA's own host implementation.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include "harness.h"

#if defined(MP_EMU_NV_REFERENCE)
extern "C" unsigned short mp_nv_float2bfloat16_rn(float f);
extern "C" unsigned short mp_nv_float2half_rn(float f);
extern "C" float mp_nv_bfloat162float(unsigned short h);
extern "C" float mp_nv_half2float(unsigned short h);
#endif

namespace {

using namespace emu_test;

constexpr unsigned kThreads = 256;

// Every thread writes its slot, waits, reads its neighbour's; the block's id is in every value,
// so a block that saw another block's shared memory is caught too.
__global__ void neighbour_kernel(unsigned* out) {
  __shared__ unsigned s[kThreads];
  const unsigned t = threadIdx.x, b = blockIdx.x;
  s[t] = b * 1000u + t;
  __syncthreads();
  const unsigned mine = s[(t + 1) % blockDim.x];
  __syncthreads();
  s[t] = mine + 1u;  // overwrite after everyone read
  __syncthreads();
  out[b * blockDim.x + t] = s[(t + blockDim.x - 1) % blockDim.x];
}

EMU_TEST(emu_barrier_and_shared_memory) {
  const unsigned blocks = 5;
  std::vector<unsigned> out(blocks * kThreads, 0);
  mp_emu::launch(neighbour_kernel, blocks, kThreads, 0, nullptr, out.data());
  CHECK(cudaGetLastError() == cudaSuccess, "launch");
  int bad = 0;
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned t = 0; t < kThreads; ++t) {
      // thread t reads slot t-1, which holds (thread t-1's neighbour t) + 1
      bad += out[b * kThreads + t] != b * 1000u + t + 1u;
    }
  }
  CHECK(bad == 0, "%d threads read a wrong value", bad);
}

__global__ void or_kernel(const int* pred, int* out) {
  const unsigned t = threadIdx.x;
  const int a = __syncthreads_or(pred[t]);
  const int b = __syncthreads_or(0);
  const int c = __syncthreads_or(t == blockDim.x - 1);
  out[t] = a * 4 + b * 2 + c;
}

EMU_TEST(emu_syncthreads_or) {
  for (int who : {-1, 0, 77, 255}) {
    std::vector<int> pred(kThreads, 0), out(kThreads, -1);
    if (who >= 0) pred[who] = 5;
    mp_emu::launch(or_kernel, 1, kThreads, 0, nullptr, pred.data(), out.data());
    set_context("predicate set by thread %d", who);
    const int want = (who >= 0 ? 4 : 0) + 1;
    CHECK(std::count(out.begin(), out.end(), want) == kThreads, "thread 0 got %d, want %d",
          out[0], want);
  }
}

// The log of the order threads ran in (no barrier: each runs to its end in one go).
__global__ void order_kernel(unsigned* log, unsigned* next) {
  log[(*next)++] = blockIdx.x * 1000u + threadIdx.x;
}

std::vector<unsigned> run_order(uint64_t seed) {
  mp_emu::set_seed(seed);
  std::vector<unsigned> log(4 * 64, 0);
  unsigned next = 0;
  mp_emu::launch(order_kernel, 4, 64, 0, nullptr, log.data(), &next);
  return log;
}

// The blocks and threads run in a seeded random order: not the index order, different from one
// seed to another, the same for the same seed, and each exactly once.
EMU_TEST(emu_random_orders) {
  const std::vector<unsigned> a = run_order(1), b = run_order(2), c = run_order(1);
  std::vector<unsigned> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  bool once = true;
  for (unsigned b4 = 0; b4 < 4; ++b4) {
    for (unsigned t = 0; t < 64; ++t) once = once && sorted[b4 * 64 + t] == b4 * 1000u + t;
  }
  CHECK(once, "not every thread ran exactly once");
  CHECK(a != sorted, "threads ran in index order");
  CHECK(a != b, "two seeds gave the same order");
  CHECK(a == c, "the same seed gave another order");
  bool blocks_shuffled = false;
  for (size_t i = 1; i < a.size(); ++i) blocks_shuffled |= a[i] / 1000u < a[i - 1] / 1000u;
  CHECK(blocks_shuffled, "blocks ran in index order");
}

// Shared memory starts as garbage in every block (a kernel that reads before writing is caught).
__global__ void uninit_kernel(unsigned* out) {
  __shared__ unsigned s;
  if (threadIdx.x == 0) out[blockIdx.x] = s;
  if (threadIdx.x == 0) s = 0;
}

EMU_TEST(emu_shared_memory_starts_undefined) {
  std::vector<unsigned> out(8, 0);
  mp_emu::launch(uninit_kernel, 8, 32, 0, nullptr, out.data());
  int zeros = 0;
  for (unsigned v : out) zeros += v == 0;
  CHECK(zeros <= 1, "%d of 8 blocks saw zeroed shared memory", zeros);
}

// 3-D grids and blocks: every (block, thread) runs once with the right coordinates.
__global__ void coords_kernel(unsigned* hits) {
  const unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const unsigned t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  hits[b * (blockDim.x * blockDim.y * blockDim.z) + t] += 1;
}

EMU_TEST(emu_multidimensional_coordinates) {
  std::vector<unsigned> hits(3 * 2 * 2 * 4 * 3 * 2, 0);
  mp_emu::launch(coords_kernel, dim3(3, 2, 2), dim3(4, 3, 2), 0, nullptr, hits.data());
  CHECK(std::count(hits.begin(), hits.end(), 1u) == static_cast<long>(hits.size()),
        "some thread ran twice or never");
}

// Launch configurations CUDA rejects are rejected: the error is set and nothing runs.
struct Big {
  char bytes[4100];
};
__global__ void big_kernel(Big) {}
__global__ void count_kernel(unsigned* n) { ++*n; }

EMU_TEST(emu_rejects_bad_launches) {
  unsigned n = 0;
  mp_emu::launch(count_kernel, 0, 32, 0, nullptr, &n);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration && n == 0, "empty grid");
  mp_emu::launch(count_kernel, 1, 1025, 0, nullptr, &n);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration && n == 0, "1025 threads");
  mp_emu::launch(count_kernel, dim3(1, 65536), 1, 0, nullptr, &n);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration && n == 0, "grid.y 65536");
  mp_emu::launch(big_kernel, 1, 1, 0, nullptr, Big{});
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "4100 bytes of arguments");
  mp_emu::launch(count_kernel, 2, 3, 0, nullptr, &n);
  CHECK(cudaGetLastError() == cudaSuccess && n == 6, "a good launch ran %u threads", n);
}

// A barrier that part of the block never reaches (those threads returned) aborts the run, as it
// would hang or corrupt a real block. Checked in a child process.
__global__ void divergent_kernel() {
  if (threadIdx.x >= 100) return;
  __syncthreads();
}

EMU_TEST(emu_divergent_barrier_aborts) {
  fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    if (freopen("/dev/null", "w", stderr) == nullptr) _exit(3);
    mp_emu::launch(divergent_kernel, 1, 128, 0, nullptr);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, "the child ended with status 0x%x",
        status);
}

#if defined(MP_EMU_NV_REFERENCE)
// The shim's conversions against cuda_bf16.hpp / cuda_fp16.hpp's host code: every 16-bit input,
// and fp32 inputs sweeping every exponent with both many mantissas and the rounding-critical
// low bits (ties, just above and below them).
EMU_TEST(emu_shim_conversions_match_nvidia) {
  int64_t bad = 0;
  uint32_t first = 0;
  auto f2 = [&](uint32_t u) {
    const float f = f32_of(u);
    const unsigned short b = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    const unsigned short h = __half_as_ushort(__float2half_rn(f));
    if (b != mp_nv_float2bfloat16_rn(f) || h != mp_nv_float2half_rn(f)) {
      if (bad++ == 0) first = u;
    }
  };
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 251) f2(static_cast<uint32_t>(u));
  static const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF,
                                  0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x3000, 0x17FF};
  for (uint32_t high = 0; high < (1u << 16); ++high) {
    for (uint32_t low : lows) f2((high << 16) | low);
  }
  CHECK(bad == 0, "%lld fp32 -> bf16/fp16 conversions differ, first 0x%08x",
        static_cast<long long>(bad), first);
  int64_t bad16 = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const unsigned short s = static_cast<unsigned short>(h);
    bad16 += bits_of(__half2float(__ushort_as_half(s))) != bits_of(mp_nv_half2float(s));
    bad16 += bits_of(__bfloat162float(__ushort_as_bfloat16(s))) != bits_of(mp_nv_bfloat162float(s));
  }
  CHECK(bad16 == 0, "%lld bf16/fp16 -> fp32 conversions differ", static_cast<long long>(bad16));
}
#endif

}  // namespace
