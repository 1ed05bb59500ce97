// The scheduler of the CUDA emulation (see README.md): runs a grid's blocks one at a time in a
// seeded random order, and a block's threads as ucontext fibers on one OS thread. A thread runs
// until it reaches a barrier or returns; when every thread of the block waits at the barrier it
// opens (with the OR of their predicates), and the next round resumes them in a fresh random
// order. A warp shuffle is a barrier of the 32 threads of a warp: it opens once they all wait
// at it. A barrier that some threads can never reach (they have returned, or wait elsewhere) is
// reported and aborts, as it would hang or corrupt a real block. Also the few runtime calls the
// launchers make.
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <vector>

#include "cuda_emu.h"

#if defined(__SANITIZE_ADDRESS__)
#define MP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MP_EMU_ASAN 1
#endif
#endif
#if defined(MP_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

// The __shared__ section (see cuda_emu.h); weak, so that a build without any still links.
extern "C" char __start_mp_emu_shared[] __attribute__((weak));
extern "C" char __stop_mp_emu_shared[] __attribute__((weak));

namespace mp_emu {

ThreadCoords g_coords;

namespace {

[[noreturn]] void fatal(const char* what) {
  fprintf(stderr, "cuda-emu: %s\n", what);
  fflush(stderr);
  abort();
}

// splitmix64: a seeded stream for the block order, thread order and shared-memory contents.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }
};

template <class T>
void shuffle(std::vector<T>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

enum class State { kRunnable, kWaiting, kWarpWaiting, kDone };

constexpr size_t kStackBytes = 256 * 1024;
constexpr unsigned kMaxThreadsPerBlock = 1024;

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;  // kStackBytes, above a guard page
  State state = State::kRunnable;
  int predicate = 0;  // what it passed to the barrier it waits at
  int opened = 0;     // the barrier's result, once it opened
  unsigned int shfl_value = 0, shfl_result = 0;  // a warp shuffle's operand and result
  int shfl_lane_mask = 0;
  uint3 thread;
  void* fake_stack = nullptr;  // AddressSanitizer's handle while it is switched out
};

struct Runtime {
  uint64_t seed = 0x6D70657874ull;
  uint64_t launches = 0;
  uint64_t seeded_launches = 0;  // since the last set_seed: the launch's random stream
  int64_t blocks = 0;
  int sms = 132;
  int64_t fail_countdown = -1;
  cudaError_t error = cudaSuccess;
  std::vector<Fiber> fibers{kMaxThreadsPerBlock};
  ucontext_t scheduler;
  Fiber* current = nullptr;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  const void* main_stack_bottom = nullptr;  // the scheduler's stack, for AddressSanitizer
  size_t main_stack_size = 0;
};

Runtime rt;

// ---- fiber switches, annotated for AddressSanitizer ----

void enter_fiber(Fiber& f) {
#if defined(MP_EMU_ASAN)
  void* save = nullptr;
  __sanitizer_start_switch_fiber(&save, f.stack, kStackBytes);
  swapcontext(&rt.scheduler, &f.ctx);
  __sanitizer_finish_switch_fiber(save, nullptr, nullptr);
#else
  swapcontext(&rt.scheduler, &f.ctx);
#endif
}

// In a fiber, right after the switch into it.
void arrived(Fiber& f) {
#if defined(MP_EMU_ASAN)
  __sanitizer_finish_switch_fiber(f.fake_stack, &rt.main_stack_bottom, &rt.main_stack_size);
#else
  (void)f;
#endif
}

void leave_fiber(Fiber& f) {
#if defined(MP_EMU_ASAN)
  __sanitizer_start_switch_fiber(&f.fake_stack, rt.main_stack_bottom, rt.main_stack_size);
  swapcontext(&f.ctx, &rt.scheduler);
  arrived(f);
#else
  swapcontext(&f.ctx, &rt.scheduler);
#endif
}

void fiber_main() {
  Fiber& f = *rt.current;
  arrived(f);
  rt.body(rt.arg);
  f.state = State::kDone;
#if defined(MP_EMU_ASAN)
  // nullptr: this fiber is finished, its fake stack can go.
  __sanitizer_start_switch_fiber(nullptr, rt.main_stack_bottom, rt.main_stack_size);
#endif
  // Returning resumes uc_link, the scheduler.
}

char* stack_for(Fiber& f) {
  if (f.stack == nullptr) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fatal("cannot map a fiber stack");
    mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
    f.stack = static_cast<char*>(p) + page;
  }
  return f.stack;
}

// Random bytes in every __shared__ variable: a read before the block's own write sees garbage.
__attribute__((no_sanitize_address)) void scramble_shared(Rng& rng) {
  if (__start_mp_emu_shared == nullptr) return;
  for (char* p = __start_mp_emu_shared; p < __stop_mp_emu_shared; ++p) {
    *p = static_cast<char>(rng.next());
  }
}

// A fresh fiber for thread t of the block (getcontext returns twice: kept out of run_block).
__attribute__((noinline)) void start_fiber(Fiber& f, unsigned t, dim3 bd) {
  f.thread = uint3{t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)};
  f.state = State::kRunnable;
  f.fake_stack = nullptr;
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack_for(f);
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = &rt.scheduler;
  makecontext(&f.ctx, fiber_main, 0);
}

void run_block(uint3 block, unsigned nthreads, Rng& rng) {
  g_coords.block = block;
  scramble_shared(rng);
  std::vector<unsigned> order(nthreads);
  for (unsigned t = 0; t < nthreads; ++t) {
    start_fiber(rt.fibers[t], t, g_coords.block_dim);
    order[t] = t;
  }
  for (;;) {
    shuffle(order, rng);
    for (unsigned t : order) {
      Fiber& f = rt.fibers[t];
      if (f.state != State::kRunnable) continue;
      rt.current = &f;
      g_coords.thread = f.thread;
      enter_fiber(f);
    }
    rt.current = nullptr;
    // Warp shuffles first: a warp whose threads all wait at one exchanges and runs on.
    bool shuffled = false;
    for (unsigned w = 0; w * 32 < nthreads; ++w) {
      unsigned at = 0;
      for (unsigned t = 32 * w; t < 32 * w + 32 && t < nthreads; ++t) {
        at += rt.fibers[t].state == State::kWarpWaiting ? 1u : 0u;
      }
      if (at == 0) continue;
      if (at != 32) {
        fprintf(stderr, "cuda-emu: block (%u,%u,%u) warp %u: %u of 32 threads wait at a shuffle "
                "but the others have returned or wait at __syncthreads\n", block.x, block.y,
                block.z, w, at);
        fatal("a warp shuffle not reached by every thread of its warp");
      }
      for (unsigned t = 32 * w; t < 32 * w + 32; ++t) {
        Fiber& f = rt.fibers[t];
        f.shfl_result = rt.fibers[32 * w + ((t - 32 * w) ^ static_cast<unsigned>(
                                                  f.shfl_lane_mask & 31))].shfl_value;
      }
      for (unsigned t = 32 * w; t < 32 * w + 32; ++t) rt.fibers[t].state = State::kRunnable;
      shuffled = true;
    }
    if (shuffled) continue;
    unsigned waiting = 0, any = 0;
    for (unsigned t = 0; t < nthreads; ++t) {
      if (rt.fibers[t].state == State::kWaiting) {
        ++waiting;
        any |= rt.fibers[t].predicate ? 1u : 0u;
      }
    }
    if (waiting == 0) return;
    if (waiting != nthreads) {
      fprintf(stderr,
              "cuda-emu: block (%u,%u,%u): %u of %u threads wait at __syncthreads but the others "
              "have returned\n",
              block.x, block.y, block.z, waiting, nthreads);
      fatal("a barrier not reached by every thread of its block");
    }
    for (unsigned t = 0; t < nthreads; ++t) {
      rt.fibers[t].state = State::kRunnable;
      rt.fibers[t].opened = static_cast<int>(any);
    }
  }
}

}  // namespace

int barrier(int predicate) {
  Fiber* f = rt.current;
  if (f == nullptr) fatal("__syncthreads called outside a kernel");
  f->predicate = predicate;
  f->state = State::kWaiting;
  leave_fiber(*f);
  return f->opened;
}

unsigned int shfl_xor(unsigned int mask, unsigned int value, int lane_mask, int width) {
  Fiber* f = rt.current;
  if (f == nullptr) fatal("__shfl_xor_sync called outside a kernel");
  if (mask != 0xFFFFFFFFu || width != 32) fatal("__shfl_xor_sync: only the full mask and width 32");
  f->shfl_value = value;
  f->shfl_lane_mask = lane_mask;
  f->state = State::kWarpWaiting;
  leave_fiber(*f);
  return f->shfl_result;
}

void run_grid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
              size_t param_bytes, void (*body)(void*), void* arg) {
  (void)stream;  // one in-order queue: running the grid now is a valid schedule of any stream
  ++rt.launches;
  if (rt.current != nullptr) fatal("a kernel launched from device code");
  if (rt.fail_countdown >= 0 && rt.fail_countdown-- == 0) {
    rt.error = cudaErrorLaunchFailure;
    return;
  }
  const uint64_t nthreads = static_cast<uint64_t>(block.x) * block.y * block.z;
  // CUDA's limits: grid.x < 2^31, grid.y and grid.z <= 65535, 1024 threads per block, the
  // kernel arguments in 4 KB (what cuda/*.cu design for), 48 KB of dynamic shared memory.
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7FFFFFFFu || grid.y > 65535u ||
      grid.z > 65535u || nthreads == 0 || nthreads > kMaxThreadsPerBlock || block.z > 64 ||
      shared_bytes > 48 * 1024 || param_bytes > 4096) {
    rt.error = cudaErrorInvalidConfiguration;
    return;
  }
  Rng rng{rt.seed ^ (++rt.seeded_launches * 0xD1B54A32D192ED03ull)};
  rt.body = body;
  rt.arg = arg;
  g_coords.grid_dim = grid;
  g_coords.block_dim = block;
  std::vector<uint3> blocks;
  blocks.reserve(static_cast<size_t>(grid.x) * grid.y * grid.z);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(uint3{x, y, z});
    }
  }
  shuffle(blocks, rng);
  for (const uint3& b : blocks) run_block(b, static_cast<unsigned>(nthreads), rng);
  rt.blocks += static_cast<int64_t>(blocks.size());
}

void set_seed(uint64_t seed) {
  rt.seed = seed;
  rt.seeded_launches = 0;
}
void set_sm_count(int sms) { rt.sms = sms; }
void fail_launch_in(int64_t countdown) { rt.fail_countdown = countdown; }
int64_t launch_count() { return static_cast<int64_t>(rt.launches); }
int64_t blocks_run() { return rt.blocks; }

}  // namespace mp_emu

cudaError_t cudaGetLastError() {
  const cudaError_t e = mp_emu::rt.error;
  mp_emu::rt.error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return mp_emu::rt.error; }

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = mp_emu::rt.sms;
  return cudaSuccess;
}
