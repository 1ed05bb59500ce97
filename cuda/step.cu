// The fused optimizer step on CUDA devices (every rule of mpext/rules/rules.h: the options'
// rule): the kernels and the launcher behind mpext/step_cuda.h. One chunk kernel for every rule,
// a template over the rule's functor (RuleOf_<name> below, generated from the rows: the
// per-element update of its rule header over fp32 values); the storage paths are the rule's only
// through how many moments it keeps. A rule that always keeps two moments also takes the 16-byte
// vectorized path for fp32 state.
//
// Work layout: the multi-tensor engine (multi_tensor.cuh) packs the params into launches, one
// chunk per block. Thread 0 of a block computes its param's scalars (mpext/step_storage.h and the rule's: the
// skip decision from *found_inf, *inv_scale, *lr, and the bias corrections from the param's step
// count) into shared memory; then every thread runs vec_range (or the element-wise path) over the block's chunk. It peels
// the elements before the point where all five arrays (param, grad, master, exp_avg, exp_avg_sq)
// are 16-byte aligned, moves 8 elements per step with 16-byte loads and stores, and finishes the
// tail one element at a time; when the arrays' offsets modulo 16 bytes differ no peel aligns them
// all, and the whole chunk goes one element at a time.
//
// Step counts: every block of a param computes t = step + 1 from the stored (old) step, so all of
// them use the same t wherever and whenever they run. The stored steps are advanced by a second,
// one-thread-per-param kernel enqueued after every launch of the first on the same stream, so no
// block can still be reading a step when it changes. Both kernels skip on *found_inf != 0;
// nothing writes found_inf, so they agree.
//
// Numerics: the rule header's and step_storage.h's, the CPU's code: per element each fp32 operation rounded once (the
// rule's _rn intrinsics, which fast-math flags do not change), bf16/fp16 values widened exactly
// and the new master rounded back to nearest even; with unscale_grads the unscaled gradient is
// rounded back into the gradient the same way.
//
// 8-bit moments (q8_chunk): the block's 256 threads take 2048 elements per pass, 8
// consecutive ones each, so a block of moments (at most 2048 elements, a divisor of the chunk)
// is the elements of 1 to 256 consecutive threads. Each thread decodes, updates and writes its
// elements, keeping the new fp32 moments in registers; the block's absmax (a max of fp32 bits,
// exact and order-free) is taken across its threads with warp shuffles, and across warps through
// shared memory; then each thread encodes its elements. The same bits as the CPU's two sweeps.
//
// Telemetry (mp_step_multi_stats_cuda): the same kernel with its template argument's kCount set,
// so that the uncounted kernel is compiled exactly as without it. Each thread tallies the columns
// of mpext/telemetry.h over its elements (from the values it has in registers, reading back what
// it stored), the block sums its threads' tallies in shared memory, and thread 0 adds the
// non-zero ones to the param's float64 row with atomics. The counts are whole numbers, exact in
// any order; the sums of errors are added in the order the blocks finish (not the C core's
// order: equal to within the rounding of a sum of non-negative terms).
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/step_cuda.h"
#include "mpext/step_storage.h" /* and, through mpext/step.h, the rules */
#include "mpext/telemetry.h"    /* the step's counter columns */
#include "multi_tensor.cuh"

namespace {

using namespace mp_cuda;  // the shared memory access and engine of access.cuh, multi_tensor.cuh

constexpr int kThreads = 256;      // threads per block of the main kernel
constexpr int kStepThreads = 128;  // threads per block of the step kernel
constexpr int64_t kVec = 8;        // elements per vectorized step (16-byte accesses)
constexpr int kMaxPieces = 36;     // params (or pieces of one) per main launch
constexpr int kWarps = kThreads / 32;
constexpr int kQ8Group = 8;                        // elements per thread and pass (8-bit moments)
constexpr int64_t kQ8Pass = kThreads * kQ8Group;  // elements per pass of a block
constexpr int kMaxSteps = 500;     // step counters per step launch
constexpr int kCountPieces = 34;   // params (or pieces of one) per counted launch: its rows too

static_assert(mp_cuda::kChunk % kVec == 0, "a chunk must keep its piece's alignment modulo 16");
static_assert(kQ8Pass == MP_Q8_BLOCK_MAX && mp_cuda::kChunk % kQ8Pass == 0,
              "a block of 8-bit moments must lie within one pass of one chunk");

// The rules, one functor each, generated from the rows of mpext/rules/rules.h: the update of one
// element (g, p and moments m, v in fp32; v unused by a rule with one moment, m too by one with
// none) with the rule's scalars r beside the storage's s. A rule that always keeps two moments
// may take the 16-byte vectorized path of fp32 state.
#define MP_RULE_FUNCTOR_(ID, name, MIN, MAX)                                                   \
  struct RuleOf_##name {                                                                       \
    static constexpr bool kVectorPath = (MIN) == 2;                                            \
    mp_##name##_scalars r;                                                                     \
    MP_CUDA_HD float operator()(float g, float p, float* m, float* v,                          \
                                const mp_step_scalars&) const {                                \
      return mp_##name##_element(g, p, m, v, &r);                                              \
    }                                                                                          \
  };
MP_RULES(MP_RULE_FUNCTOR_)
#undef MP_RULE_FUNCTOR_

// ---- telemetry: a thread's tallies of the step's counter columns (mpext/telemetry.h) ----

// The whole-number columns (32-bit per thread: a thread sees at most a chunk's elements) and
// the sums, with the row's column of each.
enum { kElems, kChanged, kUnmoved, kSubhalf, kFlushed, kSatBlocks, kBlocks, kNCounts };
enum { kMErr, kMAbs, kVErr, kVAbs, kEmaLag, kEmaAbs, kNSums };
__device__ constexpr int kCountCol[kNCounts] = {MP_STS_ELEMS,      MP_STS_CHANGED,
                                                MP_STS_UNMOVED,    MP_STS_SUBHALF,
                                                MP_STS_Q8_FLUSHED, MP_STS_Q8_SATBLOCKS,
                                                MP_STS_Q8_BLOCKS};
__device__ constexpr int kSumCol[kNSums] = {MP_STS_M_ERR, MP_STS_M_ABS,   MP_STS_V_ERR,
                                            MP_STS_V_ABS, MP_STS_EMA_LAG, MP_STS_EMA_ABS};

struct Sts {
  uint32_t n[kNCounts];
  double d[kNSums];
};

// |a - b| and |b| in double, added to sums j and j + 1 (the C core's terms: each difference one
// correctly rounded double subtraction).
MP_CUDA_HD void sts_err(Sts* c, int j, float a, float b) {
  c->d[j] += fabs(MP_DSUB(static_cast<double>(a), static_cast<double>(b)));
  c->d[j + 1] += fabs(static_cast<double>(b));
}

// A 16-bit param's element: x its new fp32 value (the master as stored, or the rule's result
// master-free), old the value before, q / qold the stored bits after and before; free: no
// master or remainder (the half-ulp test).
template <int P>
MP_CUDA_HD void sts_param(Sts* c, float x, float old, uint32_t q, uint32_t qold, bool free) {
  const uint32_t ch = x != old ? 1u : 0u;  // NaN counts as changed
  c->n[kChanged] += ch;
  c->n[kUnmoved] += ch & ((q & 0xFFFFu) == (qold & 0xFFFFu) ? 1u : 0u);
  if (free) {
    c->n[kSubhalf] += ch & (fabsf(MP_FSUB(x, old)) < mp_sts_half_ulp(qold & 0xFFFFu, P) ? 1u : 0u);
  }
}

// Element i, on its own (with its tallies in *c when kCount).
template <int P, int G, bool kCount = false, class Rule>
MP_CUDA_HD void vec_one(void* param, void* grad, float* master, float* exp_avg,
                        float* exp_avg_sq, int64_t i, const mp_step_scalars& s, const Rule& rule,
                        Sts* c = nullptr) {
  constexpr bool kMaster = P != MP_F32;
  const float g = mp_step_unscaled(widen<G>(load1<MP_DTYPE_BYTES(G)>(grad, i)), &s);
  if (s.write_grad) store1<MP_DTYPE_BYTES(G)>(grad, i, narrow<G>(g));
  float p = kMaster ? master[i] : widen<MP_F32>(load1<4>(param, i));
  [[maybe_unused]] const float old = p;
  [[maybe_unused]] uint32_t qold = 0u;
  if constexpr (kCount && kMaster) qold = load1<MP_DTYPE_BYTES(P)>(param, i);
  float m = exp_avg[i];
  float v = exp_avg_sq[i];
  p = rule(g, p, &m, &v, s);
  if constexpr (P == MP_BF16) p = f32_from_bits(mp_bf16_master_bits(bits_from_f32(p)));
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if constexpr (kMaster) master[i] = p;
  store1<MP_DTYPE_BYTES(P)>(param, i, narrow<P>(p));
  if constexpr (kCount) {
    c->n[kElems] += 1u;
    if constexpr (kMaster) sts_param<P>(c, p, old, narrow<P>(p), qold, false);
  }
}

// Where a piece's fp32 param value lives (see mpext/step.h).
enum Storage : uint8_t { kF32Param = 0, kMaster = 1, kRemainder = 2, kNoMaster = 3 };

// Element i of a param in any storage (step.h: remainders, bf16 moments, no master), one element
// at a time; pos is its position in the param (its stochastic-rounding draw).
template <int P, int G, bool kCount = false, class Rule>
MP_CUDA_HD void lean_one(void* param, void* grad, float* master, int16_t* remainder,
                              void* exp_avg, int md, void* exp_avg_sq, int vd, float* ema,
                              int storage, int64_t i, uint64_t pos, const mp_step_scalars& s,
                              const Rule& rule, int nmom, Sts* c = nullptr) {
  const float g = mp_step_unscaled(widen<G>(load1<MP_DTYPE_BYTES(G)>(grad, i)), &s);
  if (s.write_grad) store1<MP_DTYPE_BYTES(G)>(grad, i, narrow<G>(g));
  float p;
  if (storage == kMaster) {
    p = master[i];
  } else if (storage == kRemainder) {
    p = f32_from_bits(mp_bf16_join(static_cast<uint16_t>(load1<2>(param, i)),
                                   static_cast<uint16_t>(remainder[i])));
  } else {
    p = widen<P>(load1<MP_DTYPE_BYTES(P)>(param, i));
  }
  [[maybe_unused]] const float old = p;
  [[maybe_unused]] uint32_t qold = 0u;
  if constexpr (kCount) {
    if (storage != kF32Param) qold = load1<2>(param, i);
  }
  float m = 0.0f, v = 0.0f;
  if (nmom >= 1) {
    m = md == MP_F32 ? widen<MP_F32>(load1<4>(exp_avg, i)) : widen<MP_BF16>(load1<2>(exp_avg, i));
  }
  if (nmom >= 2) {
    v = vd == MP_F32 ? widen<MP_F32>(load1<4>(exp_avg_sq, i))
                     : widen<MP_BF16>(load1<2>(exp_avg_sq, i));
  }
  p = rule(g, p, &m, &v, s);
  const bool bf16 = (nmom >= 1 && md == MP_BF16) || (nmom >= 2 && vd == MP_BF16);
  const uint32_t r_mv = bf16 ? mp_sr_bits(s.key_moments, pos) : 0u;
  if (nmom >= 1) {
    if (md == MP_F32) {
      store1<4>(exp_avg, i, bits_from_f32(m));
    } else {
      store1<2>(exp_avg, i, mp_step_bf16_moment(m, r_mv, &s));
    }
  }
  if (nmom >= 2) {
    if (vd == MP_F32) {
      store1<4>(exp_avg_sq, i, bits_from_f32(v));
    } else {
      store1<2>(exp_avg_sq, i, mp_step_bf16_moment(v, r_mv >> 16, &s));
    }
  }
  if (ema != nullptr && storage != kMaster && storage != kRemainder) {
    ema[i] = mp_step_ema(ema[i], p, &s);
  }
  if (storage == kF32Param) {
    store1<4>(param, i, bits_from_f32(p));
  } else if (storage == kMaster || storage == kRemainder) {
    const uint32_t x = P == MP_BF16 ? mp_bf16_master_bits(bits_from_f32(p)) : bits_from_f32(p);
    if (ema != nullptr) ema[i] = mp_step_ema(ema[i], f32_from_bits(x), &s);
    const uint32_t q = P == MP_BF16 ? mp_bf16_rne_bits(x) : mp_fp16_rne_bits(x);
    store1<2>(param, i, q);
    if (storage == kMaster) {
      master[i] = f32_from_bits(x);
    } else {
      remainder[i] = static_cast<int16_t>(mp_bf16_remainder(x, static_cast<uint16_t>(q)));
    }
  } else if (s.sr_params) {
    const uint32_t r = mp_sr_bits(s.key_param, pos);
    store1<2>(param, i, P == MP_BF16 ? mp_bf16_sr_bits(bits_from_f32(p), r)
                                     : mp_fp16_sr_bits(bits_from_f32(p), r));
  } else {
    store1<2>(param, i, narrow<P>(p));
  }
  if constexpr (kCount) {
    // what this thread just stored, read back
    c->n[kElems] += 1u;
    const bool stored_master = storage == kMaster || storage == kRemainder;
    const float x = stored_master && P == MP_BF16
                        ? f32_from_bits(mp_bf16_master_bits(bits_from_f32(p)))
                        : p;
    if (storage != kF32Param) {
      sts_param<P>(c, x, old, load1<2>(param, i), qold, !stored_master);
    }
    if (nmom >= 1 && md == MP_BF16) sts_err(c, kMErr, widen<MP_BF16>(load1<2>(exp_avg, i)), m);
    if (nmom >= 2 && vd == MP_BF16) {
      sts_err(c, kVErr, widen<MP_BF16>(load1<2>(exp_avg_sq, i)), v);
    }
    if (ema != nullptr) sts_err(c, kEmaLag, ema[i], x);
  }
}

// Elements 8 * vi .. 8 * vi + 7 of 16-byte aligned arrays, with 16-byte loads and stores. For an
// fp32 param the param is the fp32 value (master is unused); otherwise the master is, and the
// param is only written.
template <int P, int G, bool kCount = false, class Rule>
MP_CUDA_HD void vec8(void* param, void* grad, float* master, float* exp_avg, float* exp_avg_sq,
                     int64_t vi, const mp_step_scalars& s, const Rule& rule, Sts* c = nullptr) {
  constexpr bool kMaster = P != MP_F32;
  uint32_t gb[8], pb[8], mb[8], vb[8];
  load8<MP_DTYPE_BYTES(G)>(grad, vi, gb);
  load8<4>(kMaster ? static_cast<const void*>(master) : static_cast<const void*>(param), vi, pb);
  load8<4>(exp_avg, vi, mb);
  load8<4>(exp_avg_sq, vi, vb);
  [[maybe_unused]] uint32_t qold[8];
  if constexpr (kCount && kMaster) load8<MP_DTYPE_BYTES(P)>(param, vi, qold);
  uint32_t out[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float m = f32_from_bits(mb[j]);
    float v = f32_from_bits(vb[j]);
    const float g = mp_step_unscaled(widen<G>(gb[j]), &s);
    gb[j] = narrow<G>(g);
    [[maybe_unused]] const float old = f32_from_bits(pb[j]);
    float p = rule(g, f32_from_bits(pb[j]), &m, &v, s);
    if constexpr (P == MP_BF16) p = f32_from_bits(mp_bf16_master_bits(bits_from_f32(p)));
    mb[j] = bits_from_f32(m);
    vb[j] = bits_from_f32(v);
    pb[j] = bits_from_f32(p);
    out[j] = narrow<P>(p);
    if constexpr (kCount && kMaster) sts_param<P>(c, p, old, out[j], qold[j], false);
  }
  if constexpr (kCount) c->n[kElems] += 8u;
  store8<4>(exp_avg, vi, mb);
  store8<4>(exp_avg_sq, vi, vb);
  if (s.write_grad) store8<MP_DTYPE_BYTES(G)>(grad, vi, gb);
  if constexpr (kMaster) store8<4>(master, vi, pb);
  store8<MP_DTYPE_BYTES(P)>(param, vi, out);
}

// Elements to skip before ptr (an array of `bytes`-sized elements) is 16-byte aligned.
MP_CUDA_HD int64_t peel(const void* ptr, int bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  return static_cast<int64_t>((16u - (a & 15u)) & 15u) / bytes;
}

MP_CUDA_HD bool aligned_after(const void* ptr, int bytes, int64_t h) {
  return ((reinterpret_cast<uintptr_t>(ptr) + static_cast<uintptr_t>(bytes * h)) & 15u) == 0u;
}

// The number of leading elements (0 .. 7) after which every array is 16-byte aligned, or -1 if
// there is none (the arrays' offsets modulo 16 bytes disagree). A 16-bit array fixes the count
// modulo 8, an fp32 array modulo 4, so the candidate comes from a 16-bit array when there is one.
template <int P, int G>
MP_CUDA_HD int64_t vector_head(const void* param, const void* grad, const float* master,
                               const float* exp_avg, const float* exp_avg_sq) {
  constexpr int kP = MP_DTYPE_BYTES(P), kG = MP_DTYPE_BYTES(G);
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
template <int P, int G, bool kCount = false, class Rule>
MP_CUDA_HD void vec_range(void* param, void* grad, float* master, float* exp_avg,
                          float* exp_avg_sq, int64_t n, const mp_step_scalars& s,
                          const Rule& rule, int64_t tid, int64_t nthreads, Sts* c = nullptr) {
  constexpr int kP = MP_DTYPE_BYTES(P), kG = MP_DTYPE_BYTES(G);
  int64_t head = vector_head<P, G>(param, grad, master, exp_avg, exp_avg_sq);
  if (head < 0 || head > n) head = n;
  for (int64_t i = tid; i < head; i += nthreads) {
    vec_one<P, G, kCount>(param, grad, master, exp_avg, exp_avg_sq, i, s, rule, c);
  }
  const int64_t nvec = (n - head) / kVec;
  if (nvec > 0) {
    void* bp = static_cast<char*>(param) + head * kP;
    void* bg = static_cast<char*>(grad) + head * kG;
    float* bw = P != MP_F32 ? master + head : master;
    float* bm = exp_avg + head;
    float* bv = exp_avg_sq + head;
    for (int64_t v = tid; v < nvec; v += nthreads) {
      vec8<P, G, kCount>(bp, bg, bw, bm, bv, v, s, rule, c);
    }
  }
  for (int64_t i = head + nvec * kVec + tid; i < n; i += nthreads) {
    vec_one<P, G, kCount>(param, grad, master, exp_avg, exp_avg_sq, i, s, rule, c);
  }
}

// The argument of one main launch (passed by value, under the 4 KB parameter limit): the call's
// options and, per piece, the param it belongs to (its arrays from the piece's first element).
// The counted kernel's extra fields: each piece's row of the float64 [ntensors, MP_STS_NCOLS]
// array at stats (its param's index in the call). None for the uncounted kernel.
template <int K, bool C>
struct CountFields {};
template <int K>
struct CountFields<K, true> {
  double* stats;
  int32_t row[K];
};

template <int K, bool C>
struct StepArgsOf : CountFields<K, C> {
  static constexpr bool kCount = C;
  mp_step_options opt;
  mp_cuda::PieceTable<K> pieces;
  void* param[K];
  void* grad[K];
  float* master[K];
  int16_t* remainder[K];
  float* ema[K];
  void* exp_avg[K];
  void* exp_avg_sq[K];
  const float* step[K];
  float* exp_avg_scale[K];  // 8-bit moments: the scales from the piece's first block
  float* exp_avg_sq_scale[K];
  uint32_t sr_stream[K];
  int64_t offset[K];  // the piece's first position in its whole param (the tensor's
                               // offset plus the piece's start: stochastic rounding)
  uint8_t param_dtype[K];
  uint8_t grad_dtype[K];
  uint8_t exp_avg_dtype[K];
  uint8_t exp_avg_sq_dtype[K];
  uint8_t storage[K];  // a Storage
};
using StepArgs = StepArgsOf<kMaxPieces, false>;
using CountedArgs = StepArgsOf<kCountPieces, true>;  // fewer pieces: the rows fit

static_assert(sizeof(StepArgs) <= 4096 && sizeof(CountedArgs) <= 4096,
              "the multi-tensor argument must fit the 4 KB limit");

// The argument of one step launch: step[0 .. nsteps - 1] are advanced unless *found_inf != 0.
struct CountArgs {
  const float* found_inf;
  float* step[kMaxSteps];
  int32_t nsteps;
};

static_assert(sizeof(CountArgs) <= 4096, "the step argument must fit the 4 KB limit");

template <int P, int G, class A, class Rule>
MP_CUDA_HD void step_chunk(const A& a, const mp_cuda::BlockRange& r, const mp_step_scalars& s,
                           const Rule& rule, int nmom, int64_t tid, int64_t nthreads, Sts* c) {
  const int k = r.k;
  void* param = static_cast<char*>(a.param[k]) + r.start * MP_DTYPE_BYTES(P);
  void* grad = static_cast<char*>(a.grad[k]) + r.start * MP_DTYPE_BYTES(G);
  const int md = a.exp_avg_dtype[k], vd = a.exp_avg_sq_dtype[k], storage = a.storage[k];
  void* m = nmom >= 1 ? static_cast<char*>(a.exp_avg[k]) + r.start * MP_DTYPE_BYTES(md) : nullptr;
  void* v =
      nmom >= 2 ? static_cast<char*>(a.exp_avg_sq[k]) + r.start * MP_DTYPE_BYTES(vd) : nullptr;
  float* master = storage == kMaster ? a.master[k] + r.start : nullptr;
  float* ema = a.ema[k] != nullptr ? a.ema[k] + r.start : nullptr;
  if (Rule::kVectorPath && (storage == kF32Param || storage == kMaster) && md == MP_F32 &&
      vd == MP_F32 && ema == nullptr) {
    // fp32 state: the 16-byte vectorized path
    vec_range<P, G, A::kCount>(param, grad, master, static_cast<float*>(m),
                               static_cast<float*>(v), r.count, s, rule, tid, nthreads, c);
    return;
  }
  int16_t* remainder = storage == kRemainder ? a.remainder[k] + r.start : nullptr;
  const uint64_t first = static_cast<uint64_t>(a.offset[k] + r.start);
  for (int64_t i = tid; i < r.count; i += nthreads) {
    lean_one<P, G, A::kCount>(param, grad, master, remainder, m, md, v, vd, ema, storage, i,
                              first + static_cast<uint64_t>(i), s, rule, nmom, c);
  }
}

// The element work of a block (range r, scalars s, not skipped) for thread tid of nthreads.
template <class A, class Rule>
MP_CUDA_HD void step_block(const A& a, const mp_cuda::BlockRange& r, const mp_step_scalars& s,
                           const Rule& rule, int nmom, int64_t tid, int64_t nthreads, Sts* c) {
  const int pd = a.param_dtype[r.k], gd = a.grad_dtype[r.k];
  if (pd == MP_F32) {
    step_chunk<MP_F32, MP_F32>(a, r, s, rule, nmom, tid, nthreads, c);
  } else if (pd == MP_BF16) {
    if (gd == MP_BF16) {
      step_chunk<MP_BF16, MP_BF16>(a, r, s, rule, nmom, tid, nthreads, c);
    } else {
      step_chunk<MP_BF16, MP_F32>(a, r, s, rule, nmom, tid, nthreads, c);
    }
  } else {
    if (gd == MP_F16) {
      step_chunk<MP_F16, MP_F16>(a, r, s, rule, nmom, tid, nthreads, c);
    } else {
      step_chunk<MP_F16, MP_F32>(a, r, s, rule, nmom, tid, nthreads, c);
    }
  }
}

// ---- 8-bit moments ----

// x's max over the `lanes` consecutive lanes (a power of two <= 32, aligned) of this thread's
// group: every lane of the warp takes part.
__device__ __forceinline__ uint32_t group_max(uint32_t x, int lanes) {
  for (int off = 1; off < lanes; off <<= 1) {
    const uint32_t y = __shfl_xor_sync(0xFFFFFFFFu, x, off);
    x = y > x ? y : x;
  }
  return x;
}

// Whether a chunk's array at p (elements of `bytes`) allows 8-element accesses: 16-byte aligned
// (8-byte for 1-byte codes); a null array (absent) does not count.
__device__ __forceinline__ bool group_aligned(const void* p, int bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return (a & (bytes == 1 ? 7u : 15u)) == 0u;
}

// Every thread of the block runs the same passes (the shuffles and barriers need them all);
// wmax is the block's shared memory for the absmax of blocks that span warps (and, counting,
// a third row for whether any of their values was flushed).
template <int P, int G, class A, class Rule>
__device__ void q8_chunk(const A& a, const mp_cuda::BlockRange& r, const mp_step_scalars& s,
                         const Rule& rule, bool pair, uint32_t (*wmax)[kWarps], Sts* c) {
  constexpr int kP = MP_DTYPE_BYTES(P), kG = MP_DTYPE_BYTES(G);
  const int k = r.k, tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int storage = a.storage[k];
  void* param = static_cast<char*>(a.param[k]) + r.start * kP;
  void* grad = static_cast<char*>(a.grad[k]) + r.start * kG;
  float* master = storage == kMaster ? a.master[k] + r.start : nullptr;
  int16_t* remainder = storage == kRemainder ? a.remainder[k] + r.start : nullptr;
  float* ema = a.ema[k] != nullptr ? a.ema[k] + r.start : nullptr;
  uint8_t* mc = static_cast<uint8_t*>(a.exp_avg[k]) + r.start;
  uint8_t* vc = pair ? static_cast<uint8_t*>(a.exp_avg_sq[k]) + r.start : nullptr;
  float* ms = a.exp_avg_scale[k];
  float* vs = a.exp_avg_sq_scale[k];
  const int64_t first = a.offset[k] + r.start;  // the chunk's first position in its param
  const int64_t block = s.q8_block;
  const int tpb = static_cast<int>(block / kQ8Group);  // threads per block of moments
  const bool vec = group_aligned(param, kP) && group_aligned(grad, kG) &&
                   (master == nullptr || group_aligned(master, 4)) &&
                   (remainder == nullptr || group_aligned(remainder, 2)) &&
                   (ema == nullptr || group_aligned(ema, 4)) && group_aligned(mc, 1) &&
                   (vc == nullptr || group_aligned(vc, 1));
  for (int64_t base = 0; base < r.count; base += kQ8Pass) {
    const int64_t i0 = base + static_cast<int64_t>(tid) * kQ8Group;
    const int64_t left = r.count - i0;
    const int nv = left <= 0 ? 0 : (left < kQ8Group ? static_cast<int>(left) : kQ8Group);
    const int64_t qb = (r.start + i0) / block;  // this thread's block in the piece's scales
    float mnew[kQ8Group], vnew[kQ8Group];
    uint32_t am = 0u, av = 0u;
    if (nv > 0) {
      const float rm = mp_q8_ref(mp_q8_ref_exp_m(bits_from_f32(ms[qb])));
      const float rv = pair ? mp_q8_ref(mp_q8_ref_exp_v(bits_from_f32(vs[qb]))) : 0.0f;
      uint32_t gb[kQ8Group], pb[kQ8Group], wb[kQ8Group], mb[kQ8Group], vb[kQ8Group];
      uint32_t eb[kQ8Group] = {};
      load_group<kG>(grad, i0, nv, vec, gb);
      load_group<kP>(param, i0, nv, vec, pb);
      if (storage == kMaster) load_group<4>(master, i0, nv, vec, wb);
      if (storage == kRemainder) load_group<2>(remainder, i0, nv, vec, wb);
      load_group<1>(mc, i0, nv, vec, mb);
      if (pair) load_group<1>(vc, i0, nv, vec, vb);
      if (ema != nullptr) load_group<4>(ema, i0, nv, vec, eb);
      uint32_t out[kQ8Group];
#pragma unroll
      for (int j = 0; j < kQ8Group; ++j) {
        const float g = mp_step_unscaled(widen<G>(gb[j]), &s);
        gb[j] = narrow<G>(g);
        float p = storage == kMaster      ? f32_from_bits(wb[j])
                  : storage == kRemainder ? f32_from_bits(mp_bf16_join(
                                                static_cast<uint16_t>(pb[j]),
                                                static_cast<uint16_t>(wb[j])))
                                          : widen<P>(pb[j]);
        float m = mp_q8_decode_m(static_cast<uint8_t>(mb[j]), rm);
        float v =
            pair ? mp_step_q8_floor_v(m, mp_q8_decode_v(static_cast<uint8_t>(vb[j]), rv), &s)
                 : 0.0f;
        [[maybe_unused]] const float old = p;
        p = rule(g, p, &m, &v, s);
        mnew[j] = m;
        vnew[j] = v;
        if (j < nv) {
          const uint32_t ma = bits_from_f32(m) & 0x7FFFFFFFu, va = bits_from_f32(v) & 0x7FFFFFFFu;
          am = ma > am ? ma : am;
          av = va > av ? va : av;
        }
        const uint64_t pos = static_cast<uint64_t>(first + i0 + j);
        if (ema != nullptr && storage != kMaster && storage != kRemainder) {
          eb[j] = bits_from_f32(mp_step_ema(f32_from_bits(eb[j]), p, &s));
        }
        if (storage == kF32Param) {
          out[j] = bits_from_f32(p);
        } else if (storage == kMaster || storage == kRemainder) {
          const uint32_t x =
              P == MP_BF16 ? mp_bf16_master_bits(bits_from_f32(p)) : bits_from_f32(p);
          if (ema != nullptr) {
            eb[j] = bits_from_f32(mp_step_ema(f32_from_bits(eb[j]), f32_from_bits(x), &s));
          }
          out[j] = P == MP_BF16 ? mp_bf16_rne_bits(x) : mp_fp16_rne_bits(x);
          wb[j] = storage == kMaster ? x
                                     : mp_bf16_remainder(x, static_cast<uint16_t>(out[j]));
        } else if (s.sr_params) {
          const uint32_t rr = mp_sr_bits(s.key_param, pos);
          out[j] = P == MP_BF16 ? mp_bf16_sr_bits(bits_from_f32(p), rr)
                                : mp_fp16_sr_bits(bits_from_f32(p), rr);
        } else {
          out[j] = narrow<P>(p);
        }
        if constexpr (A::kCount) {
          if (j < nv) {
            const bool stored_master = storage == kMaster || storage == kRemainder;
            const float x = stored_master && P == MP_BF16
                                ? f32_from_bits(mp_bf16_master_bits(bits_from_f32(p)))
                                : p;
            c->n[kElems] += 1u;
            if (storage != kF32Param) sts_param<P>(c, x, old, out[j], pb[j], !stored_master);
            if (ema != nullptr) sts_err(c, kEmaLag, f32_from_bits(eb[j]), x);
          }
        }
      }
      if (s.write_grad) store_group<kG>(grad, i0, nv, vec, gb);
      store_group<kP>(param, i0, nv, vec, out);
      if (storage == kMaster) store_group<4>(master, i0, nv, vec, wb);
      if (storage == kRemainder) store_group<2>(remainder, i0, nv, vec, wb);
      if (ema != nullptr) store_group<4>(ema, i0, nv, vec, eb);
    }
    // the block's absmax: its threads' lanes, then (a block over several warps) its warps'
    am = group_max(am, tpb < 32 ? tpb : 32);
    av = group_max(av, tpb < 32 ? tpb : 32);
    if (tpb > 32) {
      if (lane == 0) {
        wmax[0][warp] = am;
        wmax[1][warp] = av;
      }
      __syncthreads();
      const int wpb = tpb / 32, w0 = (warp / wpb) * wpb;
      for (int w = w0; w < w0 + wpb; ++w) {
        am = wmax[0][w] > am ? wmax[0][w] : am;
        av = wmax[1][w] > av ? wmax[1][w] : av;
      }
      __syncthreads();  // every warp has read before the next pass writes
    }
    [[maybe_unused]] uint32_t flushed = 0u;  // counting: this thread flushed a value
    if (nv > 0) {
      const uint32_t em = mp_q8_ref_exp_m(am), ev = mp_q8_ref_exp_v(av);
      uint32_t mo[kQ8Group], vo[kQ8Group];
#pragma unroll
      for (int j = 0; j < kQ8Group; ++j) {
        const uint32_t rr = s.moments_nearest
                                ? 0u
                                : mp_sr_bits(s.key_q8, static_cast<uint64_t>(first + i0 + j));
        mo[j] = mp_q8_encode_m(mnew[j], em, rr & 0xFFFFu, s.moments_nearest);
        vo[j] = pair ? mp_q8_encode_v(vnew[j], ev, rr >> 16, s.moments_nearest) : 0u;
      }
      store_group<1>(mc, i0, nv, vec, mo);
      if (pair) store_group<1>(vc, i0, nv, vec, vo);
      if ((r.start + i0) % block == 0) {  // the block's first thread
        ms[qb] = f32_from_bits(am);
        if (pair) vs[qb] = f32_from_bits(av);
      }
      if constexpr (A::kCount) {
        // the codes decoded with the block's new scales, against the values they encode
        const float rm = mp_q8_ref(em), rv = mp_q8_ref(ev);
        for (int j = 0; j < nv; ++j) {
          sts_err(c, kMErr, mp_q8_decode_m(static_cast<uint8_t>(mo[j]), rm), mnew[j]);
          const uint32_t fm = mnew[j] != 0.0f && (mo[j] & 0x7Fu) == 0u ? 1u : 0u;
          c->n[kFlushed] += fm;
          flushed |= fm;
          if (pair) {
            sts_err(c, kVErr, mp_q8_decode_v(static_cast<uint8_t>(vo[j]), rv), vnew[j]);
            const uint32_t fv = vnew[j] != 0.0f && (vo[j] & 0xFFu) == 0u ? 1u : 0u;
            c->n[kFlushed] += fv;
            flushed |= fv;
          }
        }
      }
    }
    if constexpr (A::kCount) {
      // whether the block flushed a value: its threads' flags, reduced as its absmax was
      flushed = group_max(flushed, tpb < 32 ? tpb : 32);
      if (tpb > 32) {
        if (lane == 0) wmax[2][warp] = flushed;
        __syncthreads();
        const int wpb = tpb / 32, w0 = (warp / wpb) * wpb;
        for (int w = w0; w < w0 + wpb; ++w) flushed |= wmax[2][w];
        __syncthreads();
      }
      if (nv > 0 && (r.start + i0) % block == 0) {  // the block's first thread
        const bool bad_scale = am >= 0x7F800000u || (pair && av >= 0x7F800000u);
        c->n[kBlocks] += 1u;
        c->n[kSatBlocks] += flushed != 0u || bad_scale ? 1u : 0u;
      }
    }
  }
}

template <class A, class Rule>
__device__ void q8_block_step(const A& a, const mp_cuda::BlockRange& r, const mp_step_scalars& s,
                              const Rule& rule, bool pair, uint32_t (*wmax)[kWarps], Sts* c) {
  const int pd = a.param_dtype[r.k], gd = a.grad_dtype[r.k];
  if (pd == MP_F32) {
    q8_chunk<MP_F32, MP_F32>(a, r, s, rule, pair, wmax, c);
  } else if (pd == MP_BF16) {
    if (gd == MP_BF16) {
      q8_chunk<MP_BF16, MP_BF16>(a, r, s, rule, pair, wmax, c);
    } else {
      q8_chunk<MP_BF16, MP_F32>(a, r, s, rule, pair, wmax, c);
    }
  } else {
    if (gd == MP_F16) {
      q8_chunk<MP_F16, MP_F16>(a, r, s, rule, pair, wmax, c);
    } else {
      q8_chunk<MP_F16, MP_F32>(a, r, s, rule, pair, wmax, c);
    }
  }
}

// A block's work under one rule: the 8-bit path or the others.
template <class A, class Rule>
__device__ void rule_block(const A& a, const mp_cuda::BlockRange& r, const mp_step_scalars& s,
                           const Rule& rule, int nmom, uint32_t (*wmax)[kWarps], Sts* c) {
  if (nmom >= 1 && a.exp_avg_dtype[r.k] == MP_I8) {
    q8_block_step(a, r, s, rule, nmom >= 2, wmax, c);
  } else {
    step_block(a, r, s, rule, nmom, threadIdx.x, blockDim.x, c);
  }
}

// The float64 add of thread 0 of each counted block. The emulation harness (tests/cuda_emu)
// does not model atomics; there blocks run one at a time, so a plain read-modify-write is what
// the atomic does (as in telemetry.cu).
__device__ __forceinline__ void add_f64(double* p, double v) {
#if defined(MP_CUDA_EMULATION)
  *p += v;
#else
  atomicAdd(p, v);
#endif
}

// The block's tallies summed over its threads in shared memory (a fixed tree), then added to
// its param's row by thread 0, the non-zero ones.
__device__ void sts_flush(const CountedArgs& a, int k, const Sts& c) {
  __shared__ uint32_t cn[kNCounts][kThreads];
  __shared__ double cd[kNSums][kThreads];
  const unsigned t = threadIdx.x;
  for (int j = 0; j < kNCounts; ++j) cn[j][t] = c.n[j];
  for (int j = 0; j < kNSums; ++j) cd[j][t] = c.d[j];
  __syncthreads();
  for (unsigned half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) {
      for (int j = 0; j < kNCounts; ++j) cn[j][t] += cn[j][t + half];
      for (int j = 0; j < kNSums; ++j) cd[j][t] = MP_DADD(cd[j][t], cd[j][t + half]);
    }
    __syncthreads();
  }
  if (t == 0) {
    double* row = a.stats + static_cast<int64_t>(a.row[k]) * MP_STS_NCOLS;
    for (int j = 0; j < kNCounts; ++j) {
      if (cn[j][0] != 0u) add_f64(row + kCountCol[j], static_cast<double>(cn[j][0]));
    }
    for (int j = 0; j < kNSums; ++j) {
      if (cd[j][0] != 0.0) add_f64(row + kSumCol[j], cd[j][0]);
    }
  }
}

// What the block's thread 0 shares with the others: the storage's scalars and the rule's.
struct BlockScalars {
  mp_step_scalars s;
  mp_rule_scalars r;
  int32_t skip;
};

// The step of a launch's blocks; with A = CountedArgs, their tallies too.
template <class A>
__global__ void __launch_bounds__(kThreads) step_multi_kernel(const __grid_constant__ A a) {
  __shared__ BlockScalars shared;
  __shared__ uint32_t wmax[A::kCount ? 3 : 2][kWarps];
  const mp_cuda::BlockRange r = mp_cuda::block_range(a.pieces, blockIdx.x);
  if (threadIdx.x == 0) {
    shared.skip = mp_step_skip(&a.opt);
    if (!shared.skip) {
      shared.s = mp_step_scalars_now(&a.opt, a.step[r.k], a.sr_stream[r.k]);
      shared.r = mp_rule_scalars_now(&a.opt, a.step[r.k]);
    }
  }
  __syncthreads();
  if (shared.skip) return;  // the same for every thread of the block
  const mp_step_scalars s = shared.s;
  Sts c{};
  Sts* const cp = A::kCount ? &c : nullptr;
  switch (a.opt.rule) {
#define MP_RULE_CASE_(ID, name, MIN, MAX)                                          \
  case MP_RULE_##ID:                                                               \
    rule_block(a, r, s, RuleOf_##name{shared.r.u.name}, shared.r.nmom, wmax, cp); \
    break;
    MP_RULES(MP_RULE_CASE_)
#undef MP_RULE_CASE_
    default: break;
  }
  if constexpr (A::kCount) sts_flush(a, r.k, c);
}

__global__ void __launch_bounds__(kStepThreads) count_kernel(const __grid_constant__ CountArgs a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.nsteps) return;
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  *a.step[i] = MP_FADD(*a.step[i], 1.0f);
}

mp_status check_call(const mp_step_tensor* ts, int64_t nt, const mp_step_options* opt) {
  if (nt < 0 || (nt > 0 && (ts == nullptr || opt == nullptr))) return MP_ERR_INVALID_ARGUMENT;
  if (nt == 0) return MP_OK;
  if (!mp_step_options_ok(opt)) return MP_ERR_INVALID_ARGUMENT;
  const int nmom = mp_rule_moments(opt);
  for (int64_t k = 0; k < nt; ++k) {
    if (!mp_step_tensor_ok(&ts[k], nmom)) return MP_ERR_INVALID_ARGUMENT;
    if (nmom >= 1 && mp_step_blocks(&ts[k]) &&
        (!mp_q8_block_ok(opt->q8_block) || ts[k].offset % opt->q8_block != 0))
      return MP_ERR_INVALID_ARGUMENT;
  }
  return MP_OK;
}

// Both launchers: A the kernel's argument (StepArgs, or CountedArgs with the rows at stats).
template <class A>
mp_status step_multi(const mp_step_tensor* tensors, int64_t ntensors, const mp_step_options* opt,
                     double* stats, cudaStream_t stream) {
  const mp_status checked = check_call(tensors, ntensors, opt);
  if (checked != MP_OK || ntensors == 0) return checked;
  if constexpr (A::kCount) {
    // rows are int32 in the argument
    if (stats == nullptr || ntensors > INT32_MAX) return MP_ERR_INVALID_ARGUMENT;
  }
  A a{};
  a.opt = *opt;
  if constexpr (A::kCount) a.stats = stats;
  const mp_status st = mp_cuda::pack_launches(
      a.pieces, ntensors, [&](int64_t s) { return tensors[s].n; },
      [&](int i, int64_t s, int64_t done) {
        const mp_step_tensor& t = tensors[s];
        a.param[i] = static_cast<char*>(t.param) + done * MP_DTYPE_BYTES(t.param_dtype);
        a.grad[i] = static_cast<char*>(t.grad) + done * MP_DTYPE_BYTES(t.grad_dtype);
        a.master[i] = t.master != nullptr ? t.master + done : nullptr;
        a.remainder[i] = t.remainder != nullptr ? t.remainder + done : nullptr;
        a.ema[i] = t.ema != nullptr ? t.ema + done : nullptr;
        a.exp_avg[i] = t.exp_avg != nullptr ? static_cast<char*>(t.exp_avg) +
                                                  done * mp_format_bytes(t.exp_avg_format)
                                            : nullptr;
        a.exp_avg_sq[i] = t.exp_avg_sq != nullptr ? static_cast<char*>(t.exp_avg_sq) +
                                                        done * mp_format_bytes(t.exp_avg_sq_format)
                                                  : nullptr;
        a.step[i] = t.step;
        // a piece starts on a chunk boundary, a multiple of every block size
        const int64_t blocks_done = mp_step_blocks(&t) ? done / opt->q8_block : 0;
        a.exp_avg_scale[i] = t.exp_avg_scale != nullptr ? t.exp_avg_scale + blocks_done : nullptr;
        a.exp_avg_sq_scale[i] =
            t.exp_avg_sq_scale != nullptr ? t.exp_avg_sq_scale + blocks_done : nullptr;
        a.sr_stream[i] = static_cast<uint32_t>(t.sr_stream);
        a.offset[i] = t.offset + done;
        a.param_dtype[i] = static_cast<uint8_t>(t.param_dtype);
        a.grad_dtype[i] = static_cast<uint8_t>(t.grad_dtype);
        // the moments' formats as the dtypes the kernel loads and stores (formats/formats.h)
        a.exp_avg_dtype[i] = static_cast<uint8_t>(mp_format_dtype(t.exp_avg_format));
        a.exp_avg_sq_dtype[i] = static_cast<uint8_t>(mp_format_dtype(t.exp_avg_sq_format));
        a.storage[i] = t.param_dtype == MP_F32 ? kF32Param
                       : t.master != nullptr   ? kMaster
                       : t.remainder != nullptr ? kRemainder
                                               : kNoMaster;
        if constexpr (A::kCount) a.row[i] = static_cast<int32_t>(s);
      },
      [&](int64_t blocks) {
        mp_cuda::launch(step_multi_kernel<A>, static_cast<unsigned>(blocks), kThreads, 0, stream,
                        a);
        return mp_cuda::launch_status();
      });
  if (st != MP_OK) return st;
  // Every main launch is enqueued: now the step counts, zero-size params' included.
  const int max_steps = mp_cuda::cap_pieces(kMaxSteps);
  CountArgs sa{};
  sa.found_inf = opt->found_inf;
  for (int64_t k = 0; k < ntensors; ++k) {
    sa.step[sa.nsteps++] = tensors[k].step;
    if (sa.nsteps == max_steps || k == ntensors - 1) {
      const unsigned grid = static_cast<unsigned>((sa.nsteps + kStepThreads - 1) / kStepThreads);
      mp_cuda::launch(count_kernel, grid, kStepThreads, 0, stream, sa);
      const mp_status s = mp_cuda::launch_status();
      if (s != MP_OK) return s;
      sa.nsteps = 0;
    }
  }
  return MP_OK;
}

}  // namespace

extern "C" {

mp_status mp_step_multi_cuda(const mp_step_tensor* tensors, int64_t ntensors,
                             const mp_step_options* opt, cudaStream_t stream) {
  return step_multi<StepArgs>(tensors, ntensors, opt, nullptr, stream);
}

mp_status mp_step_multi_stats_cuda(const mp_step_tensor* tensors, int64_t ntensors,
                                   const mp_step_options* opt, double* stats,
                                   cudaStream_t stream) {
  return step_multi<CountedArgs>(tensors, ntensors, opt, stats, stream);
}

mp_status mp_adam_step_multi_cuda(const mp_adam_tensor* tensors, int64_t ntensors,
                                  const mp_adam_options* opt, cudaStream_t stream) {
  return mp_step_multi_cuda(tensors, ntensors, opt, stream);
}

}  // extern "C"
