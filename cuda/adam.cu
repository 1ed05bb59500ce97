// The fused Adam/AdamW step on CUDA devices: the kernels and the launcher behind
// mpext/adam_cuda.h.
//
// Work layout. One multi-tensor kernel covers a list of params of mixed dtypes: the launcher packs
// up to kMaxPieces params (or pieces of one) into a by-value kernel argument under the 4 KB limit,
// one chunk of kChunk elements per block, and launches again only when a launch is full. A block
// finds its piece by binary search over the pieces' first blocks. Thread 0 computes the block's
// scalars (the skip decision from *found_inf, *inv_scale, *lr, and the bias corrections from the
// param's step count) into shared memory; then every thread runs the same per-thread routine,
// adam_range, over the block's chunk. adam_range peels the elements before the point where all
// five arrays (param, grad, master, exp_avg, exp_avg_sq) are 16-byte aligned, moves 8 elements
// per step with 16-byte loads and stores, and finishes the tail one element at a time; when the
// arrays have different offsets modulo 16 bytes no peel aligns them all, and the whole chunk
// goes one element at a time. All indices and counts are int64_t.
//
// Step counts. Every block of a param computes t = step + 1 from the stored (old) step, so all of
// them use the same t wherever and whenever they run. The stored steps are advanced by a second,
// one-thread-per-param kernel enqueued after every launch of the first on the same stream, so no
// block can still be reading a step when it changes. Both kernels read *found_inf and, when it is
// non-zero, return before writing anything; nothing writes found_inf, so they agree.
//
// Numerics. Per element exactly mpext/adam.h's formula in fp32, each operation rounded in that
// order: the device path uses the _rn intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn),
// which nvcc never contracts into fused multiply-adds and which fast-math flags do not change, so
// the results do not depend on compiler flags. The per-call scalars are computed in double as
// torch does and rounded once to fp32 (again with _rn intrinsics on the device). bf16/fp16 values
// are widened exactly and the new master is rounded back with __float2bfloat16_rn /
// __float2half_rn.
//
// The per-thread routines are __host__ __device__ so that a host-side test can drive them with
// emulated block and thread indices; only the __global__ wrappers and the launchers are
// device-specific.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mpext/adam.h"
#include "mpext/adam_cuda.h"
#include "access.cuh"
#include "mpext/mpext.h"

namespace {

using mp_cuda::bits_from_f32;
using mp_cuda::element_aligned;
using mp_cuda::f32_from_bits;
using mp_cuda::load1;
using mp_cuda::load8;
using mp_cuda::store1;
using mp_cuda::store8;

#define MP_ADAM_HD __host__ __device__ __forceinline__

constexpr int kThreads = 256;            // threads per block of the main kernel
constexpr int kStepThreads = 128;        // threads per block of the step kernel
constexpr int64_t kVec = 8;              // elements per vectorized step (16-byte accesses)
constexpr int64_t kChunk = 65536;        // elements per block
constexpr int kMaxPieces = 64;           // params (or pieces of one) per main launch
constexpr int kMaxSteps = 500;           // step counters per step launch
constexpr int64_t kMaxBlocks = 1 << 30;  // blocks per launch (grid.x < 2^31)

static_assert(kChunk % kVec == 0, "a chunk must keep its piece's alignment modulo 16 bytes");

template <int D>
struct Elem {
  static constexpr int kBytes = D == MP_F32 ? 4 : 2;
};

int dtype_bytes(int dtype) { return dtype == MP_F32 ? 4 : 2; }

// ---- fp32 arithmetic, rounded once per operation (never contracted) ----

MP_ADAM_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MP_ADAM_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MP_ADAM_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MP_ADAM_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

MP_ADAM_HD float fsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

// ---- the same for the per-call scalars in double ----

MP_ADAM_HD double dsub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

MP_ADAM_HD double dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

MP_ADAM_HD double ddiv(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// An element of dtype D (raw bits, 16-bit values in the low half) widened to fp32 (exact).
template <int D>
MP_ADAM_HD float widen(uint32_t x) {
  if constexpr (D == MP_F32) {
    return f32_from_bits(x);
  } else if constexpr (D == MP_BF16) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(x)));
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(x)));
  }
}

// An fp32 value as the bits of dtype D, rounded to nearest even.
template <int D>
MP_ADAM_HD uint32_t narrow(float f) {
  if constexpr (D == MP_F32) {
    return bits_from_f32(f);
  } else if constexpr (D == MP_BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
  }
}

// The fp32 scalars one block applies to every element of its chunk (adam.h's mp_adam_params,
// plus the skip decision). A plain aggregate, so that it can live in __shared__ memory.
struct AdamScalars {
  float inv_scale;      // 1 when the grads are not scaled
  float weight_decay;   // Adam (L2)
  float decay;          // AdamW: 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1 (subtracted in double)
  float lerp_rest;      // 1 - lerp_weight (in fp32, as torch's lerp)
  float beta2;
  float one_minus_beta2;  // subtracted in double
  float eps;
  float neg_step_size;  // -(lr / (1 - beta1^t))
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  int32_t decoupled;
  int32_t maximize;
  int32_t lerp_from_start;  // lerp_weight < 0.5: m + w * (g - m); else g - (g - m) * (1 - w)
  int32_t skip;             // *found_inf != 0: write nothing
};

// One element of adam.h's formula: grad value gin (widened), fp32 param/master value p, moments
// m and v updated in place; returns the new p.
MP_ADAM_HD float adam_element(float gin, float p, float& m, float& v, const AdamScalars& s) {
  float g = fmul(gin, s.inv_scale);
  if (s.maximize) g = -g;
  if (s.decoupled) {
    p = fmul(p, s.decay);
  } else {
    g = fadd(g, fmul(s.weight_decay, p));
  }
  const float diff = fsub(g, m);
  m = s.lerp_from_start ? fadd(m, fmul(s.lerp_weight, diff)) : fsub(g, fmul(diff, s.lerp_rest));
  v = fadd(fmul(v, s.beta2), fmul(fmul(s.one_minus_beta2, g), g));
  const float denom = fadd(fdiv(fsqrt(v), s.bc2_sqrt), s.eps);
  return fadd(p, fdiv(fmul(s.neg_step_size, m), denom));
}

// Element i, on its own.
template <int P, int G>
MP_ADAM_HD void adam_one(void* param, const void* grad, float* master, float* exp_avg,
                         float* exp_avg_sq, int64_t i, const AdamScalars& s) {
  constexpr bool kMaster = P != MP_F32;
  const float g = widen<G>(load1<Elem<G>::kBytes>(grad, i));
  float p = kMaster ? master[i] : widen<MP_F32>(load1<4>(param, i));
  float m = exp_avg[i];
  float v = exp_avg_sq[i];
  p = adam_element(g, p, m, v, s);
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if constexpr (kMaster) master[i] = p;
  store1<Elem<P>::kBytes>(param, i, narrow<P>(p));
}

// Elements 8 * vi .. 8 * vi + 7 of 16-byte aligned arrays, with 16-byte loads and stores. For an
// fp32 param the param is the fp32 value (master is unused); otherwise the master is, and the
// param is only written.
template <int P, int G>
MP_ADAM_HD void adam_vec8(void* param, const void* grad, float* master, float* exp_avg,
                          float* exp_avg_sq, int64_t vi, const AdamScalars& s) {
  constexpr bool kMaster = P != MP_F32;
  uint32_t gb[8], pb[8], mb[8], vb[8];
  load8<Elem<G>::kBytes>(grad, vi, gb);
  load8<4>(kMaster ? static_cast<const void*>(master) : static_cast<const void*>(param), vi, pb);
  load8<4>(exp_avg, vi, mb);
  load8<4>(exp_avg_sq, vi, vb);
  uint32_t out[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float m = f32_from_bits(mb[j]);
    float v = f32_from_bits(vb[j]);
    const float p = adam_element(widen<G>(gb[j]), f32_from_bits(pb[j]), m, v, s);
    mb[j] = bits_from_f32(m);
    vb[j] = bits_from_f32(v);
    pb[j] = bits_from_f32(p);
    out[j] = narrow<P>(p);
  }
  store8<4>(exp_avg, vi, mb);
  store8<4>(exp_avg_sq, vi, vb);
  if constexpr (kMaster) store8<4>(master, vi, pb);
  store8<Elem<P>::kBytes>(param, vi, out);
}

// Elements to skip before ptr (an array of `bytes`-sized elements) is 16-byte aligned.
MP_ADAM_HD int64_t peel(const void* ptr, int bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  return static_cast<int64_t>((16u - (a & 15u)) & 15u) / bytes;
}

MP_ADAM_HD bool aligned_after(const void* ptr, int bytes, int64_t h) {
  return ((reinterpret_cast<uintptr_t>(ptr) + static_cast<uintptr_t>(bytes * h)) & 15u) == 0u;
}

// The number of leading elements (0 .. 7) after which every array is 16-byte aligned, or -1 if
// there is none (the arrays' offsets modulo 16 bytes disagree). A 16-bit array fixes the count
// modulo 8, an fp32 array modulo 4, so the candidate comes from a 16-bit array when there is one.
template <int P, int G>
MP_ADAM_HD int64_t vector_head(const void* param, const void* grad, const float* master,
                               const float* exp_avg, const float* exp_avg_sq) {
  constexpr int kP = Elem<P>::kBytes, kG = Elem<G>::kBytes;
  const int64_t h = kP == 2 ? peel(param, 2) : (kG == 2 ? peel(grad, 2) : peel(exp_avg, 4));
  bool ok = aligned_after(param, kP, h) && aligned_after(grad, kG, h) &&
            aligned_after(exp_avg, 4, h) && aligned_after(exp_avg_sq, 4, h);
  if constexpr (P != MP_F32) ok = ok && aligned_after(master, 4, h);
  return ok ? h : -1;
}

// Updates elements [0, n) of one param's arrays, this thread taking its share of a loop whose
// threads are numbered 0 .. nthreads - 1: the head before the common 16-byte boundary and the
// tail after the last full vector go one element at a time, the body 8 elements per step (or,
// when no common boundary exists, everything goes one element at a time).
template <int P, int G>
MP_ADAM_HD void adam_range(void* param, const void* grad, float* master, float* exp_avg,
                           float* exp_avg_sq, int64_t n, const AdamScalars& s, int64_t tid,
                           int64_t nthreads) {
  constexpr int kP = Elem<P>::kBytes, kG = Elem<G>::kBytes;
  int64_t head = vector_head<P, G>(param, grad, master, exp_avg, exp_avg_sq);
  if (head < 0 || head > n) head = n;
  for (int64_t i = tid; i < head; i += nthreads) {
    adam_one<P, G>(param, grad, master, exp_avg, exp_avg_sq, i, s);
  }
  const int64_t nvec = (n - head) / kVec;
  if (nvec > 0) {
    void* bp = static_cast<char*>(param) + head * kP;
    const void* bg = static_cast<const char*>(grad) + head * kG;
    float* bw = P != MP_F32 ? master + head : master;
    float* bm = exp_avg + head;
    float* bv = exp_avg_sq + head;
    for (int64_t v = tid; v < nvec; v += nthreads) adam_vec8<P, G>(bp, bg, bw, bm, bv, v, s);
  }
  for (int64_t i = head + nvec * kVec + tid; i < n; i += nthreads) {
    adam_one<P, G>(param, grad, master, exp_avg, exp_avg_sq, i, s);
  }
}

// The argument of one main launch (passed by value, under the 4 KB parameter limit). Piece k is
// elements [0, n[k]) of a param (all of it, or a part of one) with its arrays at param[k],
// grad[k], ..., covered by blocks first_block[k] .. first_block[k + 1] - 1 (the last piece's
// blocks run to the grid's end), one chunk of kChunk elements each. first_block is strictly
// increasing and starts at 0.
struct AdamArgs {
  const float* lr;         // device, or nullptr: lr_value
  const float* inv_scale;  // device, or nullptr: 1
  const float* found_inf;  // device, or nullptr: never skip
  double beta1, beta2, weight_decay;
  float lr_value;
  float weight_decay_f, lerp_weight, beta2_f, one_minus_beta2, eps;
  int32_t decoupled, maximize;
  int32_t npieces;
  void* param[kMaxPieces];
  const void* grad[kMaxPieces];
  float* master[kMaxPieces];
  float* exp_avg[kMaxPieces];
  float* exp_avg_sq[kMaxPieces];
  const float* step[kMaxPieces];
  int64_t n[kMaxPieces];
  uint32_t first_block[kMaxPieces];
  uint8_t param_dtype[kMaxPieces];
  uint8_t grad_dtype[kMaxPieces];
};

static_assert(sizeof(AdamArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

// The argument of one step launch: step[0 .. nsteps - 1] are advanced unless *found_inf != 0.
struct StepArgs {
  const float* found_inf;
  float* step[kMaxSteps];
  int32_t nsteps;
};

static_assert(sizeof(StepArgs) <= 4096, "the step argument must fit the 4 KB limit");

// The piece of block `block` (see mp_cuda::piece_of_block).
MP_ADAM_HD int find_piece(const AdamArgs& a, uint32_t block) {
  return mp_cuda::piece_of_block(a.first_block, a.npieces, block);
}

// The scalars of piece k's blocks (what thread 0 of each block computes): reads *found_inf and,
// unless it is non-zero, *inv_scale, *lr and piece k's step count s; t = s + 1 in fp32, then in
// double step_size = lr / (1 - beta1^t), sqrt(1 - beta2^t) and decay = 1 - lr * weight_decay,
// each rounded to fp32.
MP_ADAM_HD AdamScalars block_scalars(const AdamArgs& a, int k) {
  AdamScalars s{};
  s.skip = (a.found_inf != nullptr && *a.found_inf != 0.0f) ? 1 : 0;
  if (s.skip) return s;
  const double lr = static_cast<double>(a.lr != nullptr ? *a.lr : a.lr_value);
  const double t = static_cast<double>(fadd(*a.step[k], 1.0f));
  const double bc1 = dsub(1.0, pow(a.beta1, t));
  const double bc2 = dsub(1.0, pow(a.beta2, t));
  s.inv_scale = a.inv_scale != nullptr ? *a.inv_scale : 1.0f;
  s.weight_decay = a.weight_decay_f;
  s.decay = a.decoupled ? static_cast<float>(dsub(1.0, dmul(lr, a.weight_decay))) : 1.0f;
  s.lerp_weight = a.lerp_weight;
  s.lerp_rest = fsub(1.0f, a.lerp_weight);
  s.beta2 = a.beta2_f;
  s.one_minus_beta2 = a.one_minus_beta2;
  s.eps = a.eps;
  s.neg_step_size = -static_cast<float>(ddiv(lr, bc1));
  s.bc2_sqrt = static_cast<float>(sqrt(bc2));
  s.decoupled = a.decoupled;
  s.maximize = a.maximize;
  s.lerp_from_start = a.lerp_weight < 0.5f ? 1 : 0;
  return s;
}

template <int P, int G>
MP_ADAM_HD void adam_chunk(const AdamArgs& a, int k, int64_t start, int64_t count,
                           const AdamScalars& s, int64_t tid, int64_t nthreads) {
  void* param = static_cast<char*>(a.param[k]) + start * Elem<P>::kBytes;
  const void* grad = static_cast<const char*>(a.grad[k]) + start * Elem<G>::kBytes;
  float* master = P != MP_F32 ? a.master[k] + start : nullptr;
  adam_range<P, G>(param, grad, master, a.exp_avg[k] + start, a.exp_avg_sq[k] + start, count, s,
                   tid, nthreads);
}

// The element work of block `block` (of piece k, with scalars s, not skipped) for thread tid of
// nthreads.
MP_ADAM_HD void adam_block(const AdamArgs& a, uint32_t block, int k, const AdamScalars& s,
                           int64_t tid, int64_t nthreads) {
  const int64_t start = static_cast<int64_t>(block - a.first_block[k]) * kChunk;
  const int64_t rest = a.n[k] - start;
  const int64_t count = rest < kChunk ? rest : kChunk;
  const int pd = a.param_dtype[k], gd = a.grad_dtype[k];
  if (pd == MP_F32) {
    adam_chunk<MP_F32, MP_F32>(a, k, start, count, s, tid, nthreads);
  } else if (pd == MP_BF16) {
    if (gd == MP_BF16) {
      adam_chunk<MP_BF16, MP_BF16>(a, k, start, count, s, tid, nthreads);
    } else {
      adam_chunk<MP_BF16, MP_F32>(a, k, start, count, s, tid, nthreads);
    }
  } else {
    if (gd == MP_F16) {
      adam_chunk<MP_F16, MP_F16>(a, k, start, count, s, tid, nthreads);
    } else {
      adam_chunk<MP_F16, MP_F32>(a, k, start, count, s, tid, nthreads);
    }
  }
}

// What thread i of a step launch does.
MP_ADAM_HD void step_thread(const StepArgs& a, int64_t i) {
  if (i >= a.nsteps) return;
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  *a.step[i] = fadd(*a.step[i], 1.0f);
}

__global__ void __launch_bounds__(kThreads) adam_multi_kernel(const __grid_constant__ AdamArgs a) {
  __shared__ AdamScalars shared;
  const int k = find_piece(a, blockIdx.x);
  if (threadIdx.x == 0) shared = block_scalars(a, k);
  __syncthreads();
  const AdamScalars s = shared;
  if (s.skip) return;  // the same for every thread of the block
  adam_block(a, blockIdx.x, k, s, threadIdx.x, blockDim.x);
}

__global__ void __launch_bounds__(kStepThreads) adam_step_kernel(const __grid_constant__ StepArgs a) {
  step_thread(a, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
}

// A launch failed iff the runtime has a pending error; it is left for the caller to read.
mp_status launch_status() { return cudaPeekAtLastError() == cudaSuccess ? MP_OK : MP_ERR_CUDA; }

bool valid_dtype(int32_t d) { return d == MP_F32 || d == MP_BF16 || d == MP_F16; }

bool finite(double x) { return x - x == 0.0; }

mp_status check_call(const mp_adam_tensor_cuda* ts, int64_t nt, const mp_adam_options_cuda* opt) {
  if (nt < 0 || (nt > 0 && (ts == nullptr || opt == nullptr))) return MP_ERR_INVALID_ARGUMENT;
  if (nt == 0) return MP_OK;
  if (!(opt->beta1 >= 0.0 && opt->beta1 < 1.0) || !(opt->beta2 >= 0.0 && opt->beta2 < 1.0) ||
      !(opt->eps >= 0.0) || !finite(opt->eps) || !(opt->weight_decay >= 0.0) ||
      !finite(opt->weight_decay)) {
    return MP_ERR_INVALID_ARGUMENT;
  }
  for (int64_t k = 0; k < nt; ++k) {
    const mp_adam_tensor_cuda& t = ts[k];
    if (!valid_dtype(t.param_dtype) || !valid_dtype(t.grad_dtype)) return MP_ERR_INVALID_ARGUMENT;
    if (t.grad_dtype != t.param_dtype && t.grad_dtype != MP_F32) return MP_ERR_INVALID_ARGUMENT;
    if (t.n < 0 || t.step == nullptr || !element_aligned(t.step, 4)) {
      return MP_ERR_INVALID_ARGUMENT;
    }
    if (t.n == 0) continue;
    if (t.param == nullptr || t.grad == nullptr || t.exp_avg == nullptr ||
        t.exp_avg_sq == nullptr) {
      return MP_ERR_INVALID_ARGUMENT;
    }
    if ((t.master != nullptr) != (t.param_dtype != MP_F32)) return MP_ERR_INVALID_ARGUMENT;
    if (!element_aligned(t.param, dtype_bytes(t.param_dtype)) ||
        !element_aligned(t.grad, dtype_bytes(t.grad_dtype)) || !element_aligned(t.exp_avg, 4) ||
        !element_aligned(t.exp_avg_sq, 4) ||
        (t.master != nullptr && !element_aligned(t.master, 4))) {
      return MP_ERR_INVALID_ARGUMENT;
    }
  }
  return MP_OK;
}

// The call-wide part of a main launch's argument.
void fill_header(const mp_adam_options_cuda& o, AdamArgs& a) {
  a.lr = o.lr;
  a.inv_scale = o.inv_scale;
  a.found_inf = o.found_inf;
  a.beta1 = o.beta1;
  a.beta2 = o.beta2;
  a.weight_decay = o.weight_decay;
  a.lr_value = o.lr_value;
  a.weight_decay_f = static_cast<float>(o.weight_decay);
  a.lerp_weight = static_cast<float>(1.0 - o.beta1);
  a.beta2_f = static_cast<float>(o.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  a.eps = static_cast<float>(o.eps);
  a.decoupled = o.decoupled ? 1 : 0;
  a.maximize = o.maximize ? 1 : 0;
}

// Runs a (checked) call: packs the params into AdamArgs, one chunk per block, and calls
// launch_main(args, blocks) whenever max_pieces pieces (at most kMaxPieces) or max_blocks blocks
// are packed, and once at the end if anything is left; a param that does not fit the blocks left
// is split across launches at a chunk boundary (which keeps its alignment modulo 16 bytes). Then
// calls launch_step(args, count) for the step counters, max_steps (at most kMaxSteps) at a time.
// Every main launch is made before the first step launch.
template <class Main, class Step>
mp_status run_adam(const mp_adam_tensor_cuda* ts, int64_t nt, const mp_adam_options_cuda& opt,
                   int64_t max_blocks, int max_pieces, int max_steps, Main&& launch_main,
                   Step&& launch_step) {
  if (max_pieces > kMaxPieces || max_pieces < 1) max_pieces = kMaxPieces;
  if (max_steps > kMaxSteps || max_steps < 1) max_steps = kMaxSteps;
  if (max_blocks > kMaxBlocks || max_blocks < 1) max_blocks = kMaxBlocks;
  AdamArgs a{};
  fill_header(opt, a);
  a.npieces = 0;
  int64_t blocks = 0;
  for (int64_t k = 0; k < nt; ++k) {
    const mp_adam_tensor_cuda& t = ts[k];
    int64_t done = 0;
    while (done < t.n) {
      const int64_t chunks = (t.n - done + kChunk - 1) / kChunk;
      const int64_t take = chunks < max_blocks - blocks ? chunks : max_blocks - blocks;
      const int64_t count = t.n - done < take * kChunk ? t.n - done : take * kChunk;
      const int i = a.npieces++;
      a.param[i] = static_cast<char*>(t.param) + done * dtype_bytes(t.param_dtype);
      a.grad[i] = static_cast<const char*>(t.grad) + done * dtype_bytes(t.grad_dtype);
      a.master[i] = t.master != nullptr ? t.master + done : nullptr;
      a.exp_avg[i] = t.exp_avg + done;
      a.exp_avg_sq[i] = t.exp_avg_sq + done;
      a.step[i] = t.step;
      a.n[i] = count;
      a.first_block[i] = static_cast<uint32_t>(blocks);
      a.param_dtype[i] = static_cast<uint8_t>(t.param_dtype);
      a.grad_dtype[i] = static_cast<uint8_t>(t.grad_dtype);
      blocks += take;
      done += count;
      if (a.npieces == max_pieces || blocks == max_blocks) {
        const mp_status st = launch_main(static_cast<const AdamArgs&>(a), blocks);
        if (st != MP_OK) return st;
        a.npieces = 0;
        blocks = 0;
      }
    }
  }
  if (a.npieces > 0) {
    const mp_status st = launch_main(static_cast<const AdamArgs&>(a), blocks);
    if (st != MP_OK) return st;
  }
  StepArgs sa{};
  sa.found_inf = opt.found_inf;
  sa.nsteps = 0;
  for (int64_t k = 0; k < nt; ++k) {
    sa.step[sa.nsteps++] = ts[k].step;
    if (sa.nsteps == max_steps || k == nt - 1) {
      const mp_status st = launch_step(static_cast<const StepArgs&>(sa), sa.nsteps);
      if (st != MP_OK) return st;
      sa.nsteps = 0;
    }
  }
  return MP_OK;
}

}  // namespace

extern "C" {

mp_status mp_adam_step_multi_cuda(const mp_adam_tensor_cuda* tensors, int64_t ntensors,
                                  const mp_adam_options_cuda* opt, cudaStream_t stream) {
  const mp_status checked = check_call(tensors, ntensors, opt);
  if (checked != MP_OK || ntensors == 0) return checked;
  return run_adam(
      tensors, ntensors, *opt, mp_cuda::cap_blocks(kMaxBlocks), mp_cuda::cap_pieces(kMaxPieces),
      mp_cuda::cap_pieces(kMaxSteps),
      [&](const AdamArgs& a, int64_t blocks) -> mp_status {
        mp_cuda::launch(adam_multi_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, a);
        return launch_status();
      },
      [&](const StepArgs& a, int count) -> mp_status {
        const unsigned grid = static_cast<unsigned>((count + kStepThreads - 1) / kStepThreads);
        mp_cuda::launch(adam_step_kernel, grid, kStepThreads, 0, stream, a);
        return launch_status();
      });
}

}  // extern "C"
