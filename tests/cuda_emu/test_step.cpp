// The optimizer step on CUDA (cuda/step.cu: adam_step_, lion_step_, sgd_step_) against the C core
// (csrc/core/step.c).
#include <math.h>

#include <functional>

#include "harness.h"
#include "mpext/step.h"
#include "mpext/step_cuda.h"
#include "mpext/step_storage.h"
#include "mpext/telemetry.h"  // the step's counters (the telemetry cases at the end)

namespace {

using namespace emu_test;

constexpr int64_t kChunk = 65536;  // the kernel's elements per block

struct ParamSpec {
  int pdtype, gdtype;
  int64_t n;
  unsigned mis_param, mis_grad, mis_state;  // address offsets modulo 16 (of the moments)
  float step;                               // the step count before the call
  int mis_master = -1;                      // the master's offset; -1: the moments'
  unsigned master_offset() const {
    return mis_master < 0 ? mis_state : static_cast<unsigned>(mis_master);
  }
};

// One param's arrays on the "device" and the CPU reference's copies.
struct Param {
  ParamSpec spec;
  Buf param, grad, master, exp_avg, exp_avg_sq, step;
  std::vector<uint8_t> r_param, r_grad;
  std::vector<float> r_master, r_m, r_v;
  float r_step;
};

template <class T>
void to_buf(Buf& b, const std::vector<T>& v) {
  b.fill(v.data());
}

Param make_param(Rng& r, const ParamSpec& s, bool mmapped) {
  Param p;
  p.spec = s;
  const int64_t n = s.n;
  const bool has_master = s.pdtype != MP_F32;
  p.r_param.resize(static_cast<size_t>(n) * elem_bytes(s.pdtype));
  p.r_grad.resize(static_cast<size_t>(n) * elem_bytes(s.gdtype));
  p.r_m.resize(n);
  p.r_v.resize(n);
  if (has_master) p.r_master.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    // Params around 1, moments of a plausible size, grads of mixed magnitudes (scaled by up to
    // 2^16 as under a loss scale), no NaN/Inf: a step with those is skipped by design.
    const float pv = r.uniform(-2.0f, 2.0f);
    if (s.pdtype == MP_F32) {
      memcpy(&p.r_param[4 * i], &pv, 4);
    } else {
      // The master holds the value; the param's bits do not matter (it is only written).
      p.r_master[i] = pv;
      const uint16_t h = static_cast<uint16_t>(bits_of(pv) >> 16);
      memcpy(&p.r_param[2 * i], &h, 2);
    }
    const float g = r.uniform(-1.0f, 1.0f) * ldexpf(1.0f, static_cast<int>(r.below(30)) - 14);
    if (s.gdtype == MP_F32) {
      memcpy(&p.r_grad[4 * i], &g, 4);
    } else if (s.gdtype == MP_BF16) {
      const uint16_t h = static_cast<uint16_t>(bits_of(g) >> 16);
      memcpy(&p.r_grad[2 * i], &h, 2);
    } else {
      const uint16_t h = random_16_bits(r, MP_F16, 0);  // any finite fp16
      memcpy(&p.r_grad[2 * i], &h, 2);
    }
    p.r_m[i] = r.uniform(-0.1f, 0.1f);
    p.r_v[i] = r.uniform(0.0f, 0.01f);
  }
  p.r_step = s.step;
  p.param = Buf(p.r_param.size(), s.mis_param, mmapped);
  p.grad = Buf(p.r_grad.size(), s.mis_grad, mmapped);
  p.exp_avg = Buf(4 * static_cast<size_t>(n), s.mis_state, mmapped);
  p.exp_avg_sq = Buf(4 * static_cast<size_t>(n), s.mis_state, mmapped);
  if (has_master) p.master = Buf(4 * static_cast<size_t>(n), s.master_offset(), mmapped);
  p.step = Buf(4, 0, mmapped);
  to_buf(p.param, p.r_param);
  to_buf(p.grad, p.r_grad);
  to_buf(p.exp_avg, p.r_m);
  to_buf(p.exp_avg_sq, p.r_v);
  if (has_master) to_buf(p.master, p.r_master);
  *p.step.f32() = s.step;
  return p;
}

mp_step_tensor tensor_of(Param& p) {
  mp_step_tensor t{};
  t.param = p.param.data();
  t.param_dtype = p.spec.pdtype;
  t.grad = p.grad.data();
  t.grad_dtype = p.spec.gdtype;
  t.master = p.spec.pdtype != MP_F32 ? p.master.f32() : nullptr;
  t.exp_avg = p.exp_avg.f32();
  t.exp_avg_sq = p.exp_avg_sq.f32();
  t.step = p.step.f32();
  t.n = p.spec.n;
  return t;
}

struct Hyper {
  double beta1, beta2, eps, weight_decay;
  bool decoupled, maximize;
  float lr;
  bool lr_on_device;  // else lr_value
  float inv_scale;    // NaN: no inv_scale pointer
  float found_inf;    // NaN: no found_inf pointer
  bool unscale_grads;  // write the unscaled gradient back
};

// h's settings as options, with these pointers (null: none); the lr is the host value where lr
// is null, else a wrong one, so that a kernel that ignores the pointer shows.
mp_step_options options_of(const Hyper& h, const float* lr, const float* inv, const float* found) {
  mp_step_options o{};
  o.beta1 = h.beta1;
  o.beta2 = h.beta2;
  o.eps = h.eps;
  o.weight_decay = h.weight_decay;
  o.decoupled = h.decoupled;
  o.maximize = h.maximize;
  o.lr = lr;
  o.lr_value = lr ? -1.0f : h.lr;
  o.inv_scale = inv;
  o.found_inf = found;
  o.unscale_grads = h.unscale_grads;
  return o;
}

// The core's step of one param (mp_step on the reference copies, then
// mp_step_advance_steps), with the same settings, the lr as a host value.
void cpu_step(Param& p, const Hyper& h) {
  const float inv = h.inv_scale;
  const mp_step_options o = options_of(h, nullptr, isnan(h.inv_scale) ? nullptr : &inv, nullptr);
  const mp_step_tensor t = {p.r_param.data(), p.spec.pdtype, p.r_grad.data(), p.spec.gdtype,
                            p.spec.pdtype != MP_F32 ? p.r_master.data() : nullptr, p.r_m.data(),
                            p.r_v.data(), &p.r_step, p.spec.n};
  const mp_status st = mp_step(&t, 0, p.spec.n, &o);
  CHECK(st == MP_OK, "core adam status %d", st);
  CHECK(mp_step_advance_steps(&t, 1, &o) == MP_OK, "core advance_steps");
}

// Compares every array of p with the reference.
void compare(Param& p, size_t k) {
  char what[160];
  const ParamSpec& s = p.spec;
  auto name = [&](const char* arr) {
    snprintf(what, sizeof what, "param %zu (%s/%s, n %lld, offsets %u/%u/%u/%u) %s", k,
             dtype_name(s.pdtype), dtype_name(s.gdtype), static_cast<long long>(s.n), s.mis_param,
             s.mis_grad, s.mis_state, s.master_offset(), arr);
    return what;
  };
  same_bits(p.param.data(), p.r_param.data(), s.n, elem_bytes(s.pdtype), s.pdtype, true,
            name("param"));
  same_bits(p.grad.data(), p.r_grad.data(), s.n, elem_bytes(s.gdtype), s.gdtype, true,
            name("grad"));
  same_bits(p.exp_avg.data(), p.r_m.data(), s.n, 4, MP_F32, true, name("exp_avg"));
  same_bits(p.exp_avg_sq.data(), p.r_v.data(), s.n, 4, MP_F32, true, name("exp_avg_sq"));
  if (s.pdtype != MP_F32) {
    same_bits(p.master.data(), p.r_master.data(), s.n, 4, MP_F32, true, name("master"));
  }
  CHECK(bits_of(*p.step.f32()) == bits_of(p.r_step), "%s: %g, want %g", name("step"),
        static_cast<double>(*p.step.f32()), static_cast<double>(p.r_step));
  CHECK(p.param.canaries_ok() && p.grad.canaries_ok() && p.exp_avg.canaries_ok() &&
            p.exp_avg_sq.canaries_ok() && (s.pdtype == MP_F32 || p.master.canaries_ok()),
        "%s", name("a store outside the arrays"));
}

// Makes every array of p read-only (a store into it faults), or writable again.
void protect(Param& p, bool read_only) {
  for (Buf* b : {&p.param, &p.grad, &p.exp_avg, &p.exp_avg_sq, &p.step}) b->protect(read_only);
  if (p.spec.pdtype != MP_F32) p.master.protect(read_only);
}

// Runs `steps` steps of one call on "CUDA" and on the CPU and compares after each. A skipped
// step (found_inf != 0) runs on write-protected arrays: it must store nothing. Returns the
// number of launches.
int64_t adam_case(const std::vector<ParamSpec>& specs, const Hyper& h, uint64_t seed,
                  int steps = 1) {
  Rng r(seed);
  const bool skip = !isnan(h.found_inf) && h.found_inf != 0.0f;
  std::vector<Param> ps;
  for (const ParamSpec& s : specs) ps.push_back(make_param(r, s, skip));
  Buf lr(4, 0), inv(4, 0), found(4, 0);
  *lr.f32() = h.lr;
  *inv.f32() = h.inv_scale;
  *found.f32() = h.found_inf;
  const mp_step_options opt =
      options_of(h, h.lr_on_device ? lr.f32() : nullptr, isnan(h.inv_scale) ? nullptr : inv.f32(),
                 isnan(h.found_inf) ? nullptr : found.f32());
  const int64_t l0 = mp_emu::launch_count();
  for (int s = 0; s < steps; ++s) {
    std::vector<mp_step_tensor> ts;
    for (Param& p : ps) {
      ts.push_back(tensor_of(p));
      if (!skip) cpu_step(p, h);
      if (skip) protect(p, true);
    }
    const mp_status st = mp_step_multi_cuda(ts.data(), static_cast<int64_t>(ts.size()), &opt,
                                                 nullptr);
    CHECK(st == MP_OK, "status %d", st);
    for (size_t k = 0; k < ps.size(); ++k) {
      Param& p = ps[k];
      if (skip) protect(p, false);
      compare(p, k);
    }
  }
  CHECK(bits_of(*lr.f32()) == bits_of(h.lr) && bits_of(*inv.f32()) == bits_of(h.inv_scale) &&
            bits_of(*found.f32()) == bits_of(h.found_inf),
        "lr, inv_scale or found_inf was written");
  return mp_emu::launch_count() - l0;
}

const float kNoPtr = NAN;

Hyper default_hyper() {
  return Hyper{0.9, 0.999, 1e-8, 0.0, false, false, 1e-3f, true, kNoPtr, kNoPtr, false};
}

// The five (param, grad) dtype pairs, each at a size with head, body and tail.
std::vector<ParamSpec> one_of_each(int64_t n, float step) {
  return {{MP_F32, MP_F32, n, 4, 8, 4, step},
          {MP_BF16, MP_BF16, n + 1, 2, 2, 4, step},
          {MP_BF16, MP_F32, n + 2, 6, 12, 12, step},
          {MP_F16, MP_F16, n + 3, 0, 0, 0, step},
          {MP_F16, MP_F32, n + 4, 10, 4, 4, step}};
}

// Adam and AdamW, maximize, weight decay, lr on the device or from the host, with and without
// inv_scale and found_inf (clear), with and without unscale_grads: every combination, every
// dtype pair.
EMU_TEST(adam_flags_and_dtypes) {
  uint64_t seed = 100;
  for (int mask = 0; mask < 128; ++mask) {
    Hyper h = default_hyper();
    h.decoupled = mask & 1;
    h.maximize = (mask >> 1) & 1;
    h.weight_decay = (mask >> 2) & 1 ? (h.decoupled ? 0.1 : 0.01) : 0.0;
    h.lr_on_device = (mask >> 3) & 1;
    h.inv_scale = (mask >> 4) & 1 ? 0x1p-12f : kNoPtr;
    h.found_inf = (mask >> 5) & 1 ? 0.0f : kNoPtr;
    h.unscale_grads = (mask >> 6) & 1;
    set_context("decoupled %d maximize %d wd %g lr %s inv_scale %g found_inf %g unscale_grads %d",
                h.decoupled, h.maximize, h.weight_decay, h.lr_on_device ? "device" : "host",
                static_cast<double>(h.inv_scale), static_cast<double>(h.found_inf),
                h.unscale_grads);
    adam_case(one_of_each(37, static_cast<float>(mask % 5)), h, ++seed);
  }
}

// Several steps in a row (the step count advancing each time), both lerp forms (beta1 above and
// below 0.5), large step counts, other betas and eps.
EMU_TEST(adam_steps_and_hyperparameters) {
  struct Case {
    double beta1, beta2, eps, wd;
    bool decoupled;
    float step0;
  };
  const Case cases[] = {{0.9, 0.999, 1e-8, 0.01, true, 0},   {0.3, 0.9, 1e-6, 0.0, false, 0},
                        {0.0, 0.0, 0.0, 0.5, false, 3},      {0.5, 0.99, 1e-3, 0.02, true, 7},
                        {0.95, 0.98, 1e-8, 0.0, true, 1e6f}, {0.9, 0.999, 1e-8, 0.1, false, 16777215.0f}};
  uint64_t seed = 200;
  for (const Case& c : cases) {
    Hyper h = default_hyper();
    h.beta1 = c.beta1;
    h.beta2 = c.beta2;
    h.eps = c.eps;
    h.weight_decay = c.wd;
    h.decoupled = c.decoupled;
    h.lr = 3e-4f;
    h.inv_scale = 0.5f;
    h.found_inf = 0.0f;
    set_context("beta1 %g beta2 %g eps %g wd %g decoupled %d step %g", c.beta1, c.beta2, c.eps,
                c.wd, c.decoupled, static_cast<double>(c.step0));
    adam_case(one_of_each(20, c.step0), h, ++seed, 3);
  }
}

// Sizes around the vector width and the chunk, and pointer offsets that allow a common 16-byte
// boundary (head, vectors, tail) or none (one element at a time).
EMU_TEST(adam_sizes_and_alignments) {
  const int64_t sizes[] = {1, 7, 8, 9, 15, 16, 17, 100, kChunk - 3, kChunk + 11};
  const unsigned offsets[][3] = {{0, 0, 0}, {4, 4, 4}, {8, 8, 8}, {12, 12, 12},
                                 {2, 2, 4}, {6, 12, 12}, {0, 4, 0}, {4, 0, 8}};
  Hyper h = default_hyper();
  h.inv_scale = 0.25f;
  h.unscale_grads = true;  // the gradient written back through every path of vec_range
  uint64_t seed = 300;
  for (int pair = 0; pair < 5; ++pair) {
    const int pd = pair == 0 ? MP_F32 : pair <= 2 ? MP_BF16 : MP_F16;
    const int gd = (pair == 2 || pair == 4) ? MP_F32 : pd;
    for (int64_t n : sizes) {
      std::vector<ParamSpec> specs;
      for (const auto& o : offsets) {
        if (pd == MP_F32 && o[0] % 4) continue;
        if (gd == MP_F32 && o[1] % 4) continue;
        if (n > 1000 && (o[0] + o[1] + o[2]) % 8) continue;
        specs.push_back({pd, gd, n, o[0], o[1], o[2], 2.0f});
      }
      set_context("%s/%s n %lld", dtype_name(pd), dtype_name(gd), static_cast<long long>(n));
      adam_case(specs, h, ++seed);
    }
  }
}

// A master whose offset modulo 16 differs from the moments' while param, grad and moments share
// a 16-byte boundary: there is no common boundary, so everything goes one element at a time (a
// vector path taken anyway makes 16-byte accesses to a misaligned master, which UBSan reports).
EMU_TEST(adam_master_misaligned_from_moments) {
  Hyper h = default_hyper();
  h.inv_scale = 0.5f;
  h.unscale_grads = true;
  std::vector<ParamSpec> specs;
  for (int pd : {MP_BF16, MP_F16}) {
    for (int gd : {pd, static_cast<int>(MP_F32)}) {
      for (unsigned mis_param : {0u, 12u}) {
        const unsigned head = ((16u - mis_param) & 15u) / 2;  // elements before the boundary
        const unsigned mis_grad = gd == MP_F32 ? (16u - 4 * head) & 15u : mis_param;
        const unsigned mis_state = (16u - 4 * head) & 15u;
        for (unsigned mis_master = 0; mis_master < 16; mis_master += 4) {
          if (mis_master == mis_state) continue;
          specs.push_back({pd, gd, 45, mis_param, mis_grad, mis_state, 1.0f,
                           static_cast<int>(mis_master)});
        }
      }
    }
  }
  set_context("master and moments at different offsets");
  adam_case(specs, h, 350, 2);
}

// The bf16 master tie rule on every path that stores a bf16 master (adam.h): masters in [1, 2)
// whose low 17 bits are 0x8001, positive grads, zero moments, the first step, no weight decay,
// eps 0 and lr = 2^-23, so that every update subtracts exactly one fp32 ulp (m / sqrt(v) is 1 to
// within an ulp or two) and lands exactly halfway above an even bf16 value: the rule stores the
// master one ulp lower still. Every fourth element is a control whose low 17 bits are 0x18001
// (it lands halfway above an odd value, which is kept), which shows the update is one ulp.
bool tie_element(int64_t i) { return i % 4 != 3; }

uint32_t tie_master_bits(Rng& r, int64_t i) {
  return 0x3F800000u | (static_cast<uint32_t>(r.below(64)) << 17) |
         (tie_element(i) ? 0x08001u : 0x18001u);
}

float tie_grad(Rng& r, int gdtype) {
  const float g = r.uniform(0.25f, 4.0f);
  if (gdtype != MP_BF16) return g;
  return f32_of(static_cast<uint32_t>(mp_bf16_rne_bits(bits_of(g))) << 16);
}

// Whether new master bits x (as stored) are the rule's result for old bits x0: two ulps down for
// a tie element, one for a control. Counts the elements that are not.
int64_t tie_misses(const uint32_t* x0, const uint32_t* x, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += x[i] != x0[i] - (tie_element(i) ? 2u : 1u);
  return bad;
}

mp_step_options tie_options() {
  mp_step_options o{};
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 0.0;
  o.lr_value = 0x1p-23f;
  o.ema_decay = 0.5;
  return o;
}

// The scalar path (no common 16-byte boundary) and the vector path (all aligned, 64 elements in
// vectors and a scalar tail), bf16 and fp32 grads.
EMU_TEST(adam_bf16_master_tie_rule) {
  Hyper h = default_hyper();
  h.eps = 0.0;
  h.lr = 0x1p-23f;
  Rng r(370);
  const ParamSpec specs[] = {{MP_BF16, MP_BF16, 67, 0, 0, 4, 0.0f},  // scalar: moments misaligned
                             {MP_BF16, MP_F32, 67, 0, 0, 0, 0.0f, 8},  // scalar: master
                             {MP_BF16, MP_BF16, 67, 0, 0, 0, 0.0f},  // vector
                             {MP_BF16, MP_F32, 67, 6, 12, 12, 0.0f}};  // vector after a head of 5
  std::vector<Param> ps;
  std::vector<mp_step_tensor> ts;
  for (const ParamSpec& s : specs) {
    Param p = make_param(r, s, false);
    for (int64_t i = 0; i < s.n; ++i) {
      const uint32_t x = tie_master_bits(r, i);
      p.r_master[i] = f32_of(x);
      const uint16_t q = mp_bf16_rne_bits(x);
      memcpy(&p.r_param[2 * i], &q, 2);
      const float g = tie_grad(r, s.gdtype);
      if (s.gdtype == MP_F32) {
        memcpy(&p.r_grad[4 * i], &g, 4);
      } else {
        const uint16_t gb = static_cast<uint16_t>(bits_of(g) >> 16);
        memcpy(&p.r_grad[2 * i], &gb, 2);
      }
      p.r_m[i] = 0.0f;
      p.r_v[i] = 0.0f;
    }
    to_buf(p.param, p.r_param);
    to_buf(p.grad, p.r_grad);
    to_buf(p.master, p.r_master);
    to_buf(p.exp_avg, p.r_m);
    to_buf(p.exp_avg_sq, p.r_v);
    ps.push_back(std::move(p));
  }
  for (Param& p : ps) {
    const std::vector<float> x0 = p.r_master;
    cpu_step(p, h);
    const int64_t missed =
        tie_misses(reinterpret_cast<const uint32_t*>(x0.data()),
                   reinterpret_cast<const uint32_t*>(p.r_master.data()), p.spec.n);
    CHECK(missed == 0, "core: %lld masters are not the lowered ties (or the one-ulp controls)",
          static_cast<long long>(missed));
    ts.push_back(tensor_of(p));
  }
  mp_step_options o = tie_options();
  set_context("masters landing on bf16 ties, scalar and vector paths");
  CHECK(mp_step_multi_cuda(ts.data(), static_cast<int64_t>(ts.size()), &o, nullptr) == MP_OK,
        "status");
  for (size_t k = 0; k < ps.size(); ++k) compare(ps[k], k);
}

// found_inf set: nothing is written (the arrays and step counts are write-protected), in every
// dtype, with forced splits; then a clean step on the same data still matches.
EMU_TEST(adam_skip_writes_nothing) {
  Caps caps(2, 3);
  for (float fi : {1.0f, INFINITY, -2.0f}) {
    Hyper h = default_hyper();
    h.found_inf = fi;
    h.inv_scale = 0.5f;
    h.weight_decay = 0.01;
    h.decoupled = true;
    h.unscale_grads = true;
    set_context("found_inf %g", static_cast<double>(fi));
    std::vector<ParamSpec> specs = one_of_each(kChunk + 3, 4.0f);
    specs.push_back({MP_BF16, MP_F32, 0, 0, 0, 0, 9.0f});
    adam_case(specs, h, 400);
  }
}

// NaN/Inf grads without a found_inf pointer: no skip, the non-finite values go through the
// update as on the CPU (NaN where the CPU has NaN).
EMU_TEST(adam_nonfinite_grads_without_skip) {
  Hyper h = default_hyper();
  h.inv_scale = 0.5f;
  Rng r(450);
  std::vector<ParamSpec> specs = one_of_each(kChunk + 30, 2.0f);
  std::vector<Param> ps;
  for (const ParamSpec& s : specs) ps.push_back(make_param(r, s, false));
  std::vector<mp_step_tensor> ts;
  for (Param& p : ps) {
    const int gb = elem_bytes(p.spec.gdtype);
    const int64_t where[] = {0, 9, kChunk - 1, kChunk, p.spec.n - 1};
    for (int j = 0; j < 5; ++j) {
      const uint32_t bits32[] = {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFA00001u, 0x7F800000u};
      const uint16_t bits16[] = {0x7F80u, 0xFF80u, 0x7FC1u, 0xFFC0u, 0x7F80u};
      const uint16_t fp16[] = {0x7C00u, 0xFC00u, 0x7E01u, 0xFE00u, 0x7C00u};
      const void* v = gb == 4 ? static_cast<const void*>(&bits32[j])
                              : p.spec.gdtype == MP_BF16 ? static_cast<const void*>(&bits16[j])
                                                         : static_cast<const void*>(&fp16[j]);
      memcpy(&p.r_grad[gb * where[j]], v, gb);
      memcpy(static_cast<char*>(p.grad.data()) + gb * where[j], v, gb);
    }
    ts.push_back(tensor_of(p));
    cpu_step(p, h);
  }
  Buf inv(4, 0);
  *inv.f32() = 0.5f;
  const mp_step_options opt = options_of(h, nullptr, inv.f32(), nullptr);
  set_context("Inf and NaN grads, no found_inf");
  CHECK(mp_step_multi_cuda(ts.data(), static_cast<int64_t>(ts.size()), &opt, nullptr) ==
            MP_OK, "status");
  for (size_t k = 0; k < ps.size(); ++k) compare(ps[k], k);
}

// Zero-size params: no elements, but their steps still advance; the other arrays may be null.
EMU_TEST(adam_zero_size_params) {
  Rng r(500);
  Buf steps(4 * 3, 0);
  float* st = steps.f32();
  st[0] = 0.0f;
  st[1] = 5.0f;
  st[2] = 16777216.0f;  // t = 2^24 + 1 rounds back to 2^24 in fp32, as torch's float step
  Param p = make_param(r, {MP_BF16, MP_F32, 10, 0, 0, 0, 1.0f}, false);
  std::vector<mp_step_tensor> ts(4);
  for (int k = 0; k < 3; ++k) {
    ts[k] = mp_step_tensor{nullptr, k == 1 ? MP_BF16 : MP_F32, nullptr, MP_F32, nullptr,
                                nullptr, nullptr, st + k, 0};
  }
  ts[3] = tensor_of(p);
  Hyper h = default_hyper();
  cpu_step(p, h);
  const mp_step_options opt = options_of(h, nullptr, nullptr, nullptr);
  set_context("three zero-size params and one of 10");
  CHECK(mp_step_multi_cuda(ts.data(), 4, &opt, nullptr) == MP_OK, "status");
  CHECK(st[0] == 1.0f && st[1] == 6.0f && st[2] == 16777216.0f, "steps %g %g %g",
        static_cast<double>(st[0]), static_cast<double>(st[1]), static_cast<double>(st[2]));
  compare(p, 3);
  set_context("only zero-size params");
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_step_multi_cuda(ts.data(), 3, &opt, nullptr) == MP_OK, "status");
  CHECK(st[0] == 2.0f && st[1] == 7.0f, "steps");
  CHECK(mp_emu::launch_count() - l0 == 1, "%lld launches: want only the step launch",
        static_cast<long long>(mp_emu::launch_count() - l0));
  set_context("no params");
  const int64_t l1 = mp_emu::launch_count();
  CHECK(mp_step_multi_cuda(nullptr, 0, nullptr, nullptr) == MP_OK, "status");
  CHECK(mp_emu::launch_count() == l1, "launched");
}

// Params split across chunks and launches (caps of 3 blocks and 2 pieces per launch, which also
// split the step launches), then the real limits with more params and step counters than one
// launch's argument holds.
EMU_TEST(adam_split_across_chunks_and_launches) {
  Hyper h = default_hyper();
  h.inv_scale = 0x1p-10f;
  h.found_inf = 0.0f;
  h.weight_decay = 0.01;
  {
    Caps caps(3, 2);
    std::vector<ParamSpec> specs = one_of_each(2 * kChunk + 5, 1.0f);
    specs.push_back({MP_F32, MP_F32, 4 * kChunk, 4, 4, 4, 2.0f});
    specs.push_back({MP_BF16, MP_BF16, 3, 0, 0, 0, 3.0f});
    set_context("caps 3 blocks / 2 pieces");
    const int64_t launches = adam_case(specs, h, 600, 2);
    CHECK(launches >= 2 * 8, "%lld launches for two steps: the caps did not split the work",
          static_cast<long long>(launches));
  }
  std::vector<ParamSpec> specs;
  for (int k = 0; k < 130; ++k) {
    specs.push_back({k % 3 == 0 ? MP_F32 : k % 3 == 1 ? MP_BF16 : MP_F16,
                     k % 2 ? MP_F32 : (k % 3 == 0 ? MP_F32 : k % 3 == 1 ? MP_BF16 : MP_F16),
                     1 + k % 5, static_cast<unsigned>(k % 4) * 4, 0, 0, static_cast<float>(k % 7)});
  }
  for (int k = 0; k < 1010; ++k) specs.push_back({MP_F32, MP_F32, 0, 0, 0, 0, static_cast<float>(k)});
  set_context("130 params and 1010 zero-size ones");
  const int64_t launches = adam_case(specs, h, 601);
  CHECK(launches >= 5, "%lld launches: want several main and step launches",
        static_cast<long long>(launches));
}

// Bad arguments: MP_ERR_INVALID_ARGUMENT, nothing launched, nothing written.
EMU_TEST(adam_bad_arguments) {
  Rng r(700);
  Param p = make_param(r, {MP_BF16, MP_F32, 20, 0, 0, 0, 1.0f}, false);
  Param q = make_param(r, {MP_F32, MP_F32, 20, 0, 0, 0, 1.0f}, false);
  const std::vector<uint8_t> before = p.param.snapshot();
  const mp_step_options good = options_of(default_hyper(), nullptr, nullptr, nullptr);
  struct Case {
    const char* what;
    void (*edit)(mp_step_tensor&, mp_step_options&);
  };
  const Case cases[] = {
      {"beta1 = 1", [](mp_step_tensor&, mp_step_options& o) { o.beta1 = 1.0; }},
      {"beta1 < 0", [](mp_step_tensor&, mp_step_options& o) { o.beta1 = -0.1; }},
      {"beta2 NaN", [](mp_step_tensor&, mp_step_options& o) { o.beta2 = NAN; }},
      {"eps < 0", [](mp_step_tensor&, mp_step_options& o) { o.eps = -1e-8; }},
      {"eps Inf", [](mp_step_tensor&, mp_step_options& o) { o.eps = INFINITY; }},
      {"weight_decay < 0", [](mp_step_tensor&, mp_step_options& o) { o.weight_decay = -1; }},
      {"unknown param dtype", [](mp_step_tensor& t, mp_step_options&) { t.param_dtype = 3; }},
      {"fp16 grad for bf16 param", [](mp_step_tensor& t, mp_step_options&) { t.grad_dtype = MP_F16; }},
      {"n < 0", [](mp_step_tensor& t, mp_step_options&) { t.n = -1; }},
      {"step null", [](mp_step_tensor& t, mp_step_options&) { t.step = nullptr; }},
      {"grad null", [](mp_step_tensor& t, mp_step_options&) { t.grad = nullptr; }},
      {"exp_avg_sq null", [](mp_step_tensor& t, mp_step_options&) { t.exp_avg_sq = nullptr; }},
      {"master and remainder", [](mp_step_tensor& t, mp_step_options&) {
         t.remainder = reinterpret_cast<int16_t*>(t.exp_avg);
       }},
      {"remainder for an fp16 param", [](mp_step_tensor& t, mp_step_options&) {
         t.param_dtype = MP_F16;
         t.grad_dtype = MP_F32;
         t.master = nullptr;
         t.remainder = reinterpret_cast<int16_t*>(t.exp_avg);
       }},
      {"exp_avg format out of range", [](mp_step_tensor& t, mp_step_options&) {
         t.exp_avg_format = MP_FMT_COUNT;
       }},
      {"exp_avg_sq format 7", [](mp_step_tensor& t, mp_step_options&) {
         t.exp_avg_sq_format = 7;
       }},
      {"stream >= 2^32", [](mp_step_tensor& t, mp_step_options&) {
         t.sr_stream = uint64_t{1} << 32;
       }},
      {"param misaligned", [](mp_step_tensor& t, mp_step_options&) {
         t.param = static_cast<char*>(t.param) + 1;
       }},
      {"exp_avg misaligned", [](mp_step_tensor& t, mp_step_options&) {
         t.exp_avg = reinterpret_cast<float*>(reinterpret_cast<char*>(t.exp_avg) + 2);
       }},
  };
  for (const Case& c : cases) {
    mp_step_tensor ts[2] = {tensor_of(q), tensor_of(p)};
    mp_step_options o = good;
    c.edit(ts[1], o);
    set_context("%s", c.what);
    const int64_t l0 = mp_emu::launch_count();
    CHECK(mp_step_multi_cuda(ts, 2, &o, nullptr) == MP_ERR_INVALID_ARGUMENT, "status");
    CHECK(mp_emu::launch_count() == l0, "launched");
  }
  set_context("a master for an fp32 param");
  mp_step_tensor t = tensor_of(q);
  t.master = p.master.f32();
  CHECK(mp_step_multi_cuda(&t, 1, &good, nullptr) == MP_ERR_INVALID_ARGUMENT, "status");
  set_context("null tensors / options");
  CHECK(mp_step_multi_cuda(nullptr, 1, &good, nullptr) == MP_ERR_INVALID_ARGUMENT, "tensors");
  t = tensor_of(q);
  CHECK(mp_step_multi_cuda(&t, 1, nullptr, nullptr) == MP_ERR_INVALID_ARGUMENT, "options");
  CHECK(mp_step_multi_cuda(&t, -1, &good, nullptr) == MP_ERR_INVALID_ARGUMENT, "count");
  CHECK(p.param.snapshot() == before && *p.step.f32() == 1.0f && *q.step.f32() == 1.0f,
        "something was written");
}

// A failed launch, main or step: MP_ERR_CUDA, nothing launched after it, no step count advanced
// by a launch that failed or never ran, the error left pending.
EMU_TEST(adam_launch_failure) {
  const mp_step_options o = options_of(default_hyper(), nullptr, nullptr, nullptr);
  {
    Caps caps(1, 0);  // one block per main launch: two, then the step launch
    Rng r(800);
    Param p = make_param(r, {MP_F32, MP_F32, 2 * kChunk, 0, 0, 0, 3.0f}, false);
    mp_step_tensor t = tensor_of(p);
    for (int64_t fail_at : {int64_t{0}, int64_t{1}, int64_t{2}}) {
      set_context("one param, launch %lld of 3 fails", static_cast<long long>(fail_at));
      mp_emu::fail_launch_in(fail_at);
      const int64_t l0 = mp_emu::launch_count();
      CHECK(mp_step_multi_cuda(&t, 1, &o, nullptr) == MP_ERR_CUDA, "status");
      mp_emu::fail_launch_in(-1);
      CHECK(mp_emu::launch_count() - l0 == fail_at + 1, "launched after the failure");
      CHECK(*p.step.f32() == 3.0f, "the step advanced after a failed launch");
      CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "error not pending");
    }
  }
  // Five params, two pieces per main launch and two step counters per step launch (the cap
  // covers both): main launches 0-2 (params 0-1, 2-3, 4), step launches 3-5 (the same pairs).
  // Every launch fails in turn; the params of a main launch that did not run are untouched.
  Caps caps(0, 2);
  constexpr int kParams = 5;
  const std::vector<ParamSpec> specs = {{MP_F32, MP_F32, 11, 0, 0, 0, 1.0f},
                                        {MP_BF16, MP_BF16, 12, 2, 2, 4, 2.0f},
                                        {MP_BF16, MP_F32, 13, 0, 0, 0, 3.0f},
                                        {MP_F16, MP_F16, 14, 0, 0, 0, 4.0f},
                                        {MP_F16, MP_F32, 15, 4, 4, 4, 5.0f}};
  for (int64_t fail_at = 0; fail_at < 6; ++fail_at) {
    set_context("five params, launch %lld of 6 fails", static_cast<long long>(fail_at));
    Rng r(801);
    std::vector<Param> ps;
    std::vector<mp_step_tensor> ts;
    std::vector<std::vector<uint8_t>> before;
    for (const ParamSpec& s : specs) ps.push_back(make_param(r, s, false));
    for (Param& p : ps) {
      ts.push_back(tensor_of(p));
      before.push_back(p.param.snapshot());
    }
    mp_emu::fail_launch_in(fail_at);
    const int64_t l0 = mp_emu::launch_count();
    CHECK(mp_step_multi_cuda(ts.data(), kParams, &o, nullptr) == MP_ERR_CUDA, "status");
    mp_emu::fail_launch_in(-1);
    CHECK(mp_emu::launch_count() - l0 == fail_at + 1, "%lld launches: launched after the failure",
          static_cast<long long>(mp_emu::launch_count() - l0));
    for (int k = 0; k < kParams; ++k) {
      const bool stepped = 3 + k / 2 < fail_at;
      CHECK(*ps[k].step.f32() == specs[k].step + (stepped ? 1.0f : 0.0f),
            "param %d: step %g, want %g", k, static_cast<double>(*ps[k].step.f32()),
            static_cast<double>(specs[k].step + (stepped ? 1.0f : 0.0f)));
      const bool updated = k / 2 < fail_at;
      CHECK((ps[k].param.snapshot() == before[k]) != updated, "param %d %s", k,
            updated ? "not updated by its main launch" : "updated by a launch that failed");
    }
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "error not pending");
  }
}

}  // namespace

namespace {

// One step of the same params on the core (tc) and on the "device" (tg), the latter with the
// launch caps (chunks, pieces) that force chunk and launch splits.
void step_core(std::vector<mp_step_tensor>& tc, const mp_step_options& o) {
  for (size_t k = 0; k < tc.size(); ++k) {
    CHECK(mp_step(&tc[k], 0, tc[k].n, &o) == MP_OK, "core status");
  }
  CHECK(mp_step_advance_steps(tc.data(), static_cast<int64_t>(tc.size()), &o) == MP_OK,
        "core steps");
}

void step_core_and_cuda(std::vector<mp_step_tensor>& tc, std::vector<mp_step_tensor>& tg,
                        const mp_step_options& o, int chunks, int pieces) {
  step_core(tc, o);
  Caps caps(chunks, pieces);
  CHECK(mp_step_multi_cuda(tg.data(), static_cast<int64_t>(tg.size()), &o, nullptr) ==
            MP_OK, "cuda status");
}

// Lean storage (adam.h): remainders, bf16 moments (stochastic or nearest), no master (nearest or
// stochastic, bf16 and fp16), each as one param of a list with mixed storage, across chunk and
// launch splits; CUDA against the core on the same inputs, every array bit for bit (the random
// bits of stochastic rounding are a function of seed, step, stream and position only).
struct Lean {
  int pdtype, gdtype, storage;  // storage: 0 an fp32 param, 1 master, 2 remainder, 3 none
  int md, vd;
  int64_t n;
  uint32_t stream;
  std::vector<uint16_t> param, grad, m16, v16;  // an fp32 param or grad: two halves a value
  std::vector<float> master, m32, v32;
  std::vector<int16_t> rem;
  float step;
  std::vector<float> ema;  // empty: none
};

Lean make_lean(Rng& r, int pd, int gd, int storage, int md, int vd, int64_t n, uint32_t stream) {
  Lean l{pd, gd, storage, md, vd, n, stream, {}, {}, {}, {}, {}, {}, {}, {}, 2.0f, {}};
  l.param.resize(static_cast<size_t>(n) * (pd == MP_F32 ? 2 : 1));
  l.ema.resize(stream % 2 == 0 ? n : 0);
  l.grad.resize(static_cast<size_t>(n) * (gd == MP_F32 ? 2 : 1));
  l.master.resize(storage == 1 ? n : 0);
  l.rem.resize(storage == 2 ? n : 0);
  l.m32.resize(md == MP_F32 ? n : 0);
  l.m16.resize(md == MP_BF16 ? n : 0);
  l.v32.resize(vd == MP_F32 ? n : 0);
  l.v16.resize(vd == MP_BF16 ? n : 0);
  for (int64_t i = 0; i < n; ++i) {
    const float x = r.uniform(-2.0f, 2.0f);
    const uint32_t xb = pd == MP_BF16 ? mp_bf16_master_bits(bits_of(x)) : bits_of(x);
    if (pd == MP_F32) {
      memcpy(&l.param[2 * i], &x, 4);
    } else {
      l.param[i] = pd == MP_BF16 ? mp_bf16_rne_bits(xb) : mp_fp16_rne_bits(xb);
    }
    if (!l.ema.empty()) l.ema[i] = r.uniform(-2.0f, 2.0f);
    if (storage == 1) l.master[i] = f32_of(xb);
    if (storage == 2) l.rem[i] = static_cast<int16_t>(mp_bf16_remainder(xb, l.param[i]));
    const float g = r.uniform(-1.0f, 1.0f) * 64.0f;
    if (gd == MP_F32) {
      memcpy(&l.grad[2 * i], &g, 4);
    } else {
      l.grad[i] = gd == MP_BF16 ? mp_bf16_rne_bits(bits_of(g)) : mp_fp16_rne_bits(bits_of(g));
    }
    const float m = r.uniform(-0.1f, 0.1f), v = r.uniform(0.0f, 0.01f);
    if (md == MP_F32) l.m32[i] = m; else l.m16[i] = mp_bf16_rne_bits(bits_of(m));
    if (vd == MP_F32) l.v32[i] = v; else l.v16[i] = mp_bf16_rne_bits(bits_of(v));
  }
  return l;
}

mp_step_tensor lean_tensor(Lean& l) {
  mp_step_tensor t{};
  t.param = l.param.data();
  t.param_dtype = l.pdtype;
  t.grad = l.grad.data();
  t.grad_dtype = l.gdtype;
  t.master = l.storage == 1 ? l.master.data() : nullptr;
  t.remainder = l.storage == 2 ? l.rem.data() : nullptr;
  t.exp_avg = l.md == MP_F32 ? static_cast<void*>(l.m32.data()) : static_cast<void*>(l.m16.data());
  t.exp_avg_sq =
      l.vd == MP_F32 ? static_cast<void*>(l.v32.data()) : static_cast<void*>(l.v16.data());
  t.exp_avg_format = l.md == MP_BF16 ? MP_FMT_BF16 : MP_FMT_F32;  // l's moments: fp32 or bf16
  t.exp_avg_sq_format = l.vd == MP_BF16 ? MP_FMT_BF16 : MP_FMT_F32;
  t.step = &l.step;
  t.n = l.n;
  t.sr_stream = l.stream;
  t.ema = l.ema.empty() ? nullptr : l.ema.data();
  return t;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

bool same_lean(const Lean& a, const Lean& b) {
  return a.param == b.param && a.grad == b.grad && a.m16 == b.m16 && a.v16 == b.v16 &&
         a.rem == b.rem && a.step == b.step && same_floats(a.master, b.master) &&
         same_floats(a.m32, b.m32) && same_floats(a.v32, b.v32) && same_floats(a.ema, b.ema);
}

// The lean tests' AdamW settings (decoupled decay, lr 1e-2 as a host value), gradients
// multiplied by *inv.
mp_step_options lean_adamw(const float* inv) {
  mp_step_options o{};
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = 0.01;
  o.decoupled = 1;
  o.lr_value = 1e-2f;
  o.inv_scale = inv;
  return o;
}

// 8-bit moments (adam.h): int8/uint8 codes with a float32 scale per block. Each param's arrays
// sit `mis` elements into their buffers, so some chunks take the 8-element accesses and others
// one element at a time; sizes span chunks, end inside a block and inside a pass.
struct Q8 {
  int pdtype, gdtype, storage;  // storage: 0 fp32 param, 1 master, 2 remainder, 3 none
  int64_t n, mis;
  uint32_t stream;
  std::vector<uint32_t> param;  // fp32 bits, or 16-bit values
  std::vector<uint32_t> grad;
  std::vector<float> master;
  std::vector<int16_t> rem;
  std::vector<uint8_t> mc, vc;
  std::vector<float> ms, vs;
  float step;
  std::vector<float> ema;  // every other stream: an ema (empty: none)
};

int64_t q8_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

Q8 make_q8(Rng& r, int pd, int gd, int storage, int64_t n, int64_t block, int64_t mis,
           uint32_t stream) {
  Q8 q{pd, gd, storage, n, mis, stream, {}, {}, {}, {}, {}, {}, {}, {}, 4.0f, {}};
  if (stream % 2 == 0) q.ema.assign(static_cast<size_t>(n + mis), 0.0f);
  q.param.assign(static_cast<size_t>(n + mis), 0u);
  q.grad.assign(static_cast<size_t>(n + mis), 0u);
  q.master.assign(storage == 1 ? static_cast<size_t>(n + mis) : 0u, 0.0f);
  q.rem.assign(storage == 2 ? static_cast<size_t>(n + mis) : 0u, 0);
  q.mc.assign(static_cast<size_t>(n + mis), 0u);
  q.vc.assign(static_cast<size_t>(n + mis), 0u);
  q.ms.resize(static_cast<size_t>(q8_blocks(n, block)));
  q.vs.resize(static_cast<size_t>(q8_blocks(n, block)));
  for (int64_t i = 0; i < n; ++i) {
    const float x = r.uniform(-2.0f, 2.0f);
    const uint32_t xb = pd == MP_BF16 ? mp_bf16_master_bits(bits_of(x)) : bits_of(x);
    q.mc[mis + i] = static_cast<uint8_t>(r.below(256));
    q.vc[mis + i] = static_cast<uint8_t>(r.below(256));
    if (!q.ema.empty()) q.ema[mis + i] = r.uniform(-2.0f, 2.0f);
    const float g = r.uniform(-1.0f, 1.0f) * ldexpf(1.0f, static_cast<int>(r.below(16)) - 8);
    q.grad[mis + i] = gd == MP_F32 ? bits_of(g) : gd == MP_BF16 ? mp_bf16_rne_bits(bits_of(g))
                                                                : mp_fp16_rne_bits(bits_of(g));
    if (pd == MP_F32) {
      q.param[mis + i] = bits_of(x);
      continue;
    }
    q.param[mis + i] = pd == MP_BF16 ? mp_bf16_rne_bits(xb) : mp_fp16_rne_bits(xb);
    if (storage == 1) q.master[mis + i] = f32_of(xb);
    if (storage == 2) {
      q.rem[mis + i] = static_cast<int16_t>(
          mp_bf16_remainder(xb, static_cast<uint16_t>(q.param[mis + i])));
    }
  }
  for (size_t b = 0; b < q.ms.size(); ++b) {
    q.ms[b] = b % 7 == 3 ? 0.0f : ldexpf(r.uniform(1.0f, 2.0f), -static_cast<int>(r.below(30)));
    q.vs[b] = b % 7 == 3 ? 0.0f : ldexpf(r.uniform(1.0f, 2.0f), -static_cast<int>(r.below(60)));
  }
  return q;
}

// The param's arrays as the C API takes them; 16-bit params and grads are copied into buffers of
// their own (v), since Q8's vectors hold 32-bit words.
struct Q8View {
  std::vector<uint16_t> p16, g16;
};

mp_step_tensor q8_tensor(Q8& q, Q8View& v) {
  mp_step_tensor t{};
  const size_t m = static_cast<size_t>(q.mis);
  if (q.pdtype != MP_F32) {
    v.p16.assign(q.param.begin(), q.param.end());
    t.param = v.p16.data() + m;
  } else {
    t.param = q.param.data() + m;
  }
  if (q.gdtype != MP_F32) {
    v.g16.assign(q.grad.begin(), q.grad.end());
    t.grad = v.g16.data() + m;
  } else {
    t.grad = q.grad.data() + m;
  }
  t.param_dtype = q.pdtype;
  t.grad_dtype = q.gdtype;
  t.master = q.storage == 1 ? q.master.data() + m : nullptr;
  t.remainder = q.storage == 2 ? q.rem.data() + m : nullptr;
  t.exp_avg = q.mc.data() + m;
  t.exp_avg_sq = q.vc.data() + m;
  t.exp_avg_format = MP_FMT_Q8S;
  t.exp_avg_sq_format = MP_FMT_Q8U;
  t.exp_avg_scale = q.ms.data();
  t.exp_avg_sq_scale = q.vs.data();
  t.step = &q.step;
  t.n = q.n;
  t.sr_stream = q.stream;
  t.ema = q.ema.empty() ? nullptr : q.ema.data() + m;
  return t;
}

// Back from the packed 16-bit buffers into q.
void q8_unpack(Q8& q, const Q8View& v) {
  if (q.pdtype != MP_F32) q.param.assign(v.p16.begin(), v.p16.end());
  if (q.gdtype != MP_F32) q.grad.assign(v.g16.begin(), v.g16.end());
}

bool same_q8(const Q8& a, const Q8& b) {
  return a.param == b.param && a.grad == b.grad && same_floats(a.master, b.master) &&
         a.rem == b.rem && a.mc == b.mc && a.vc == b.vc && same_floats(a.ms, b.ms) &&
         same_floats(a.vs, b.vs) && a.step == b.step && same_floats(a.ema, b.ema);
}

// The 8-bit tests' params for one block size: every param dtype with each storage it takes,
// its grads in its own dtype (and in fp32 too where fp32_grads), the sizes in turn (the first
// first_n where not 0), every third one misaligned.
std::vector<Q8> q8_params(Rng& r, int64_t block, bool fp32_grads,
                          const std::vector<int64_t>& sizes, int64_t first_n = 0) {
  std::vector<Q8> out;
  uint32_t stream = 0;
  for (int pd : {static_cast<int>(MP_F32), static_cast<int>(MP_BF16), static_cast<int>(MP_F16)}) {
    for (int gi = 0; gi < (fp32_grads ? 2 : 1); ++gi) {
      const int gd = gi == 0 ? pd : static_cast<int>(MP_F32);
      for (int storage : {0, 1, 2, 3}) {
        if ((pd == MP_F32) != (storage == 0) || (storage == 2 && pd != MP_BF16)) continue;
        const int64_t n = stream == 0 && first_n ? first_n : sizes[stream % sizes.size()];
        out.push_back(make_q8(r, pd, gd, storage, n, block, stream % 3 == 1 ? 1 : 0, stream));
        ++stream;
      }
    }
  }
  return out;
}

struct RuleCase {
  const char* name;
  int rule;
  double b1, b2, wd, dampening;
  int nesterov, maximize;
};

const RuleCase kRuleCases[] = {
    {"lion", MP_RULE_LION, 0.9, 0.99, 0.1, 0.0, 0, 0},
    {"lion_maximize", MP_RULE_LION, 0.95, 0.98, 0.0, 0.0, 0, 1},
    {"sgd_nesterov", MP_RULE_SGD, 0.9, 0.0, 0.01, 0.0, 1, 0},
    {"sgd_dampening", MP_RULE_SGD, 0.5, 0.0, 0.0, 0.25, 0, 1},
    {"sgd_plain", MP_RULE_SGD, 0.0, 0.0, 0.01, 0.0, 0, 0},
    // muon: phase 1 (beta1 the momentum), phase 3 (beta1 the lr ratio)
    {"muon_momentum", MP_RULE_MUON_MOMENTUM, 0.95, 0.0, 0.0, 0.0, 1, 0},
    {"muon_momentum_plain", MP_RULE_MUON_MOMENTUM, 0.3, 0.0, 0.0, 0.0, 0, 0},
    {"muon_update", MP_RULE_MUON_UPDATE, 1.5, 0.0, 0.1, 0.0, 0, 0},
};

mp_step_options rule_options(const RuleCase& c, int variant, const float* inv) {
  mp_step_options o{};
  o.rule = c.rule;
  o.beta1 = c.b1;
  o.beta2 = c.b2;
  o.weight_decay = c.wd;
  o.dampening = c.dampening;
  o.nesterov = c.nesterov;
  o.maximize = c.maximize;
  o.decoupled = c.rule == MP_RULE_LION;
  o.lr_value = 1e-2f;
  o.inv_scale = inv;
  o.unscale_grads = variant == 1;
  o.sr_params = variant & 1;
  o.moments_nearest = variant == 2;
  o.seed = 0xC0FFEEull * (variant + 1);
  o.ema_decay = variant & 2 ? 0.999 : 0.25;
  return o;
}

// A tensor's offset: 0, an odd one, or one that puts its positions across 2^32 (a multiple of
// `align` for 8-bit moments).
int64_t offset_of(uint32_t stream, int64_t align) {
  const int64_t offs[] = {0, 12345 * align, (int64_t{1} << 32) - 3 * align};
  return offs[stream % 3];
}

// The moments a rule case keeps: Adam two, Lion one, SGD one with momentum, Muon's first phase
// one, its update phase none.
int moments_of(const RuleCase& c) {
  if (c.rule == MP_RULE_ADAM) return 2;
  if (c.rule == MP_RULE_MUON_UPDATE) return 0;
  return c.rule == MP_RULE_LION || c.b1 != 0.0 ? 1 : 0;
}

constexpr int kSumCols[] = {MP_STS_M_ERR, MP_STS_M_ABS,   MP_STS_V_ERR,
                            MP_STS_V_ABS, MP_STS_EMA_LAG, MP_STS_EMA_ABS};

bool is_sum_col(int j) {
  for (int c : kSumCols) {
    if (c == j) return true;
  }
  return false;
}

// Rows that start from non-zero values (so that accumulation is checked too).
std::vector<double> start_rows(size_t n, uint64_t seed) {
  Rng r(seed);
  std::vector<double> rows(n * MP_STS_NCOLS);
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i] = is_sum_col(static_cast<int>(i % MP_STS_NCOLS)) ? r.uniform(0.0f, 1.0f)
                                                            : static_cast<double>(r.below(4));
  }
  return rows;
}

// The core's counted step of every param over its whole range, then the step counts.
void stats_core(std::vector<mp_step_tensor>& tc, const mp_step_options& o, double* rows) {
  for (size_t k = 0; k < tc.size(); ++k) {
    CHECK(mp_step_stats(&tc[k], 0, tc[k].n, &o, rows + k * MP_STS_NCOLS) == MP_OK,
          "core status");
  }
  CHECK(mp_step_advance_steps(tc.data(), static_cast<int64_t>(tc.size()), &o) == MP_OK,
        "core steps");
}

// The uncounted (tp) and counting (tq) kernels on copies of the same params, with the caps that
// force chunk and launch splits.
void stats_cuda(std::vector<mp_step_tensor>& tp, std::vector<mp_step_tensor>& tq,
                const mp_step_options& o, double* rows, int chunks, int pieces) {
  Caps caps(chunks, pieces);
  const int64_t n = static_cast<int64_t>(tp.size());
  CHECK(mp_step_multi_cuda(tp.data(), n, &o, nullptr) == MP_OK, "cuda status");
  CHECK(mp_step_multi_stats_cuda(tq.data(), n, &o, rows, nullptr) == MP_OK, "counted status");
}

// Column totals over the rows, to show that each column was exercised.
struct Seen {
  double col[MP_STS_NCOLS] = {};
  void add(const std::vector<double>& got, const std::vector<double>& start) {
    for (size_t i = 0; i < got.size(); ++i) col[i % MP_STS_NCOLS] += got[i] - start[i];
  }
};

// Row k of the core (want) and the counting kernel (got).
void compare_row(const double* want, const double* got, size_t k) {
  const double n = want[MP_STS_ELEMS];
  for (int j = 0; j < MP_STS_NCOLS; ++j) {
    if (!is_sum_col(j)) {
      CHECK(got[j] == want[j], "param %zu column %d: %.17g, the core %.17g", k, j, got[j],
            want[j]);
      continue;
    }
    // each order's error is at most (terms) * 2^-53 of the sum: 2 (n + 1) 2^-53 between two
    const double big = fabs(want[j]) > fabs(got[j]) ? fabs(want[j]) : fabs(got[j]);
    const double tol = 2.0 * (n + 1.0) * ldexp(1.0, -53) * big;
    CHECK(fabs(got[j] - want[j]) <= tol, "param %zu column %d: %.17g, the core %.17g (tol %.3g)",
          k, j, got[j], want[j], tol);
  }
}

// One case per rule and moment count (the kernel's counting does not depend on the rule's
// hyperparameters): adam, lion, sgd with and without momentum, muon's two phases.
std::vector<RuleCase> stats_rule_cases(double adam_beta2) {
  std::vector<RuleCase> cases = {{"adamw", MP_RULE_ADAM, 0.9, adam_beta2, 0.01, 0.0, 0, 0}};
  for (const char* name : {"lion", "sgd_nesterov", "sgd_plain", "muon_momentum", "muon_update"}) {
    for (const RuleCase& c : kRuleCases) {
      if (strcmp(c.name, name) == 0) cases.push_back(c);
    }
  }
  return cases;
}

// ---- one driver for the lean, 8-bit and counting cases ----
// A param's arrays as the C API takes them: a Lean's are its own (LeanView is empty), a Q8's
// 16-bit params and grads are copied into a Q8View.
struct LeanView {};
mp_step_tensor tensor_of(Lean& l, LeanView&) { return lean_tensor(l); }
void unpack(Lean&, const LeanView&) {}
bool same(const Lean& a, const Lean& b) { return same_lean(a, b); }
void describe(const Lean& a, char* buf, size_t size) {
  snprintf(buf, size, "dtype %d grad %d storage %d moments %d/%d n %lld", a.pdtype, a.gdtype,
           a.storage, a.md, a.vd, static_cast<long long>(a.n));
}
mp_step_tensor tensor_of(Q8& q, Q8View& v) { return q8_tensor(q, v); }
void unpack(Q8& q, const Q8View& v) { q8_unpack(q, v); }
bool same(const Q8& a, const Q8& b) { return same_q8(a, b); }
void describe(const Q8& a, char* buf, size_t size) {
  snprintf(buf, size, "dtype %d grad %d storage %d n %lld mis %lld", a.pdtype, a.gdtype,
           a.storage, static_cast<long long>(a.n), static_cast<long long>(a.mis));
}

using Edit = std::function<void(mp_step_tensor&, size_t)>;

// The tensors of the rule tests: moments past the rule's count left out, tensor k at
// offset_of(k, align).
Edit rule_edit(int nmom, int64_t align) {
  return [nmom, align](mp_step_tensor& t, size_t k) {
    if (nmom < 2) {
      t.exp_avg_sq = nullptr;
      t.exp_avg_sq_scale = nullptr;
    }
    if (nmom < 1) t.exp_avg = nullptr;
    t.offset = offset_of(static_cast<uint32_t>(k), align);
  };
}

// One step of cpu's params (edited by edit) on the core and on the "device" with the caps that
// force chunk and launch splits: every array bit for bit. With seen, also the counting kernel
// and the core's counted step, from rows that start at start_rows(rows_seed): the arrays of all
// three equal, the rows as compare_row says. cpu becomes the state after the step.
template <class P, class V>
void step_and_compare(std::vector<P>& cpu, const mp_step_options& o, int chunks, int pieces,
                      const Edit& edit, Seen* seen = nullptr, uint64_t rows_seed = 0) {
  const size_t n = cpu.size();
  std::vector<P> plain = cpu, counted = cpu;
  std::vector<V> vc(n), vp(n), vq(n);
  std::vector<mp_step_tensor> tc, tp, tq;
  for (size_t k = 0; k < n; ++k) {
    tc.push_back(tensor_of(cpu[k], vc[k]));
    tp.push_back(tensor_of(plain[k], vp[k]));
    tq.push_back(tensor_of(counted[k], vq[k]));
    if (edit) {
      for (mp_step_tensor* t : {&tc[k], &tp[k], &tq[k]}) edit(*t, k);
    }
  }
  std::vector<double> start, want, got;
  if (seen) {
    start = want = got = start_rows(n, rows_seed);
    stats_core(tc, o, want.data());
    stats_cuda(tp, tq, o, got.data(), chunks, pieces);
  } else {
    step_core_and_cuda(tc, tp, o, chunks, pieces);
  }
  for (size_t k = 0; k < n; ++k) {
    unpack(cpu[k], vc[k]);
    unpack(plain[k], vp[k]);
    unpack(counted[k], vq[k]);
    const bool uncounted_ok = same(cpu[k], plain[k]);
    const bool counted_ok = !seen || same(cpu[k], counted[k]);
    char what[128];
    describe(cpu[k], what, sizeof what);
    CHECK(uncounted_ok && counted_ok, "param %zu (%s) differs: uncounted %d counted %d", k, what,
          !uncounted_ok, !counted_ok);
    if (seen) compare_row(&want[k * MP_STS_NCOLS], &got[k * MP_STS_NCOLS], k);
  }
  if (seen) seen->add(got, start);
  cpu = seen ? counted : plain;
}

// The rule tests' lean params: for each of `combos` moment formats (bit 0: a bf16 exp_avg,
// bit 1: a bf16 exp_avg_sq), an fp32 param and every 16-bit param x grad dtype x storage; every
// big_every-th spans chunks, every fourth takes its first step (the ema copies, SGD's buffer
// takes the gradient).
std::vector<Lean> lean_rule_params(Rng& r, int combos, uint32_t big_every) {
  std::vector<Lean> out;
  uint32_t stream = 0;
  auto add = [&](int pd, int gd, int storage, int md, int vd) {
    const int64_t n = (stream % big_every == 0) ? kChunk + 37 : 61 + stream;
    Lean l = make_lean(r, pd, gd, storage, md, vd, n, stream);
    if (stream % 4 == 1) l.step = 0.0f;
    out.push_back(l);
    ++stream;
  };
  for (int mom = 0; mom < combos; ++mom) {
    const int md = mom & 1 ? MP_BF16 : MP_F32, vd = mom & 2 ? MP_BF16 : MP_F32;
    add(MP_F32, MP_F32, 0, md, vd);
    for (int pd : {MP_BF16, MP_F16}) {
      for (int gd : {pd, static_cast<int>(MP_F32)}) {
        for (int storage : {1, 2, 3}) {
          if (storage == 2 && pd != MP_BF16) continue;
          add(pd, gd, storage, md, vd);
        }
      }
    }
  }
  return out;
}

// Every column the counting exercised (a test that counts nothing shows nothing).
void check_columns_seen(const Seen& seen, std::initializer_list<int> cols) {
  for (int j : cols) CHECK(seen.col[j] > 0.0, "column %d never counted", j);
}

}  // namespace

EMU_TEST(adam_lean_storage_matches_the_core) {
  Rng r(900);
  std::vector<Lean> cpu;
  uint32_t stream = 0;
  auto add_moments = [&](int pd, int gd, int storage) {  // each with every moment format
    for (int mom = 0; mom < 4; ++mom) {
      const int64_t n = (stream % 3 == 0) ? kChunk + 37 : 61 + stream;
      cpu.push_back(make_lean(r, pd, gd, storage, mom & 1 ? MP_BF16 : MP_F32,
                              mom & 2 ? MP_BF16 : MP_F32, n, stream++));
    }
  };
  add_moments(MP_F32, MP_F32, 0);  // fp32 params (with an ema every other one)
  for (int pd : {MP_BF16, MP_F16}) {
    for (int gd : {pd, static_cast<int>(MP_F32)}) {
      for (int storage : {1, 2, 3}) {
        if (storage != 2 || pd == MP_BF16) add_moments(pd, gd, storage);
      }
    }
  }
  for (int variant = 0; variant < 4; ++variant) {  // sr_params x moments_nearest
    const float inv = 0.25f;
    mp_step_options o = lean_adamw(&inv);
    o.unscale_grads = variant == 1;
    o.sr_params = variant & 1;
    o.moments_nearest = variant == 2;
    o.seed = 0xABCDEFull * (variant + 1);
    o.ema_decay = variant & 2 ? 0.999 : 0.25;  // both of lerp's forms
    set_context("sr_params %d moments_nearest %d", o.sr_params, o.moments_nearest);
    // each variant starts from the last one's state (the same on both sides)
    step_and_compare<Lean, LeanView>(cpu, o, 3, 5, nullptr);  // chunk and launch splits
  }
}

// Gradient release steps an optimizer's params in buckets, one launch per bucket in autograd's
// order (the last params first), each tensor keeping its own stream: the buckets' launches on the
// "device" equal the core stepping the whole list in one step, bit for bit. Once a backward found
// an inf/NaN, its later buckets are launched with found_inf set: they change nothing.
EMU_TEST(adam_buckets_match_one_step_of_the_list) {
  Rng r(901);
  std::vector<Lean> cpu;
  uint32_t stream = 0;
  for (int storage : {1, 2, 3}) {
    for (int mom = 0; mom < 4; ++mom) {
      const int64_t n = 61 + 7 * stream;
      cpu.push_back(make_lean(r, MP_BF16, MP_BF16, storage, mom & 1 ? MP_BF16 : MP_F32,
                              mom & 2 ? MP_BF16 : MP_F32, n, stream++));
    }
  }
  const std::vector<Lean> before = cpu;
  std::vector<Lean> gpu = cpu, poisoned = cpu;
  std::vector<mp_step_tensor> tc, tg, tp;
  for (size_t k = 0; k < cpu.size(); ++k) {
    tc.push_back(lean_tensor(cpu[k]));
    tg.push_back(lean_tensor(gpu[k]));
    tp.push_back(lean_tensor(poisoned[k]));
  }
  Buf inv(4, 0), found(4, 0);
  *inv.f32() = 0.5f;
  *found.f32() = 1.0f;
  mp_step_options o = lean_adamw(inv.f32());
  o.sr_params = 1;
  o.seed = 0x5EEDull;
  step_core(tc, o);
  mp_step_options skip = o;
  skip.found_inf = found.f32();
  for (int64_t end = static_cast<int64_t>(tg.size()); end > 0; end -= 5) {  // buckets of 5
    const int64_t start = end >= 5 ? end - 5 : 0;
    CHECK(mp_step_multi_cuda(&tg[start], end - start, &o, nullptr) == MP_OK, "cuda status");
    CHECK(mp_step_multi_cuda(&tp[start], end - start, &skip, nullptr) == MP_OK,
          "cuda status, skipped bucket");
  }
  for (size_t k = 0; k < cpu.size(); ++k) {
    CHECK(same_lean(cpu[k], gpu[k]), "param %zu (storage %d moments %d/%d): its bucket's launch "
          "differs from the whole list's step", k, cpu[k].storage, cpu[k].md, cpu[k].vd);
    CHECK(same_lean(before[k], poisoned[k]), "param %zu: a bucket launched with found_inf set "
          "changed it", k);
  }
}

// The tie rule on the lean path (adam_bf16_master_tie_rule's data): remainders with fp32 or bf16
// moments, and masters with bf16 moments or an ema, bf16 and fp32 grads.
EMU_TEST(adam_lean_bf16_master_tie_rule) {
  struct Case {
    int gd, storage, md, vd;
    uint32_t stream;  // even: with an ema
  };
  const Case cases[] = {{MP_BF16, 2, MP_F32, MP_F32, 1},   {MP_F32, 2, MP_BF16, MP_BF16, 2},
                        {MP_BF16, 2, MP_F32, MP_BF16, 3},  {MP_BF16, 1, MP_BF16, MP_BF16, 5},
                        {MP_F32, 1, MP_F32, MP_BF16, 4},   {MP_BF16, 1, MP_F32, MP_F32, 6}};
  Rng r(960);
  std::vector<Lean> cpu;
  std::vector<std::vector<uint32_t>> x0s;
  for (const Case& c : cases) {
    const int64_t n = 43;
    Lean l = make_lean(r, MP_BF16, c.gd, c.storage, c.md, c.vd, n, c.stream);
    std::vector<uint32_t> x0(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t x = tie_master_bits(r, i);
      x0[i] = x;
      l.param[i] = mp_bf16_rne_bits(x);
      if (c.storage == 1) l.master[i] = f32_of(x);
      if (c.storage == 2) {
        l.rem[i] = static_cast<int16_t>(mp_bf16_remainder(x, l.param[i]));
        CHECK(mp_bf16_join(l.param[i], static_cast<uint16_t>(l.rem[i])) == x, "remainder of %08x",
              x);
      }
      const float g = tie_grad(r, c.gd);
      if (c.gd == MP_F32) {
        memcpy(&l.grad[2 * i], &g, 4);
      } else {
        l.grad[i] = static_cast<uint16_t>(bits_of(g) >> 16);
      }
    }
    for (float& m : l.m32) m = 0.0f;
    for (uint16_t& m : l.m16) m = 0;
    for (float& v : l.v32) v = 0.0f;
    for (uint16_t& v : l.v16) v = 0;
    l.step = 0.0f;
    cpu.push_back(l);
    x0s.push_back(x0);
  }
  std::vector<Lean> gpu = cpu;
  std::vector<mp_step_tensor> tc, tg;
  for (Lean& l : cpu) tc.push_back(lean_tensor(l));
  for (Lean& l : gpu) tg.push_back(lean_tensor(l));
  mp_step_options o = tie_options();
  o.seed = 0x5EEDull;
  set_context("masters landing on bf16 ties, lean path");
  step_core(tc, o);
  for (size_t k = 0; k < cpu.size(); ++k) {
    const Lean& l = cpu[k];
    std::vector<uint32_t> x(l.n);
    for (int64_t i = 0; i < l.n; ++i) {
      x[i] = l.storage == 1 ? bits_of(l.master[i])
                            : mp_bf16_join(l.param[i], static_cast<uint16_t>(l.rem[i]));
    }
    const int64_t missed = tie_misses(x0s[k].data(), x.data(), l.n);
    CHECK(missed == 0, "core, case %zu: %lld masters are not the lowered ties (or the one-ulp "
          "controls)", k, static_cast<long long>(missed));
  }
  CHECK(mp_step_multi_cuda(tg.data(), static_cast<int64_t>(tg.size()), &o, nullptr) ==
            MP_OK, "cuda status");
  for (size_t k = 0; k < cpu.size(); ++k) {
    const Lean& a = cpu[k];
    CHECK(same_lean(a, gpu[k]), "case %zu (grad %d storage %d moments %d/%d) differs", k, a.gdtype,
          a.storage, a.md, a.vd);
  }
}
EMU_TEST(adam_q8_matches_the_core) {
  Rng r(1600);
  for (int64_t block : {int64_t{32}, int64_t{256}, int64_t{512}, int64_t{2048}}) {
    std::vector<Q8> cpu = q8_params(r, block, true, {kChunk + 2048 + 77, 3 * block + 5, 2048, 1});
    for (int variant = 0; variant < 3; ++variant) {
      const float inv = 0.5f;
      mp_step_options o{};
      o.beta1 = 0.9;
      o.beta2 = 0.99;
      o.eps = 1e-8;
      o.weight_decay = 0.01;
      o.decoupled = variant != 1;
      o.lr_value = 1e-2f;
      o.inv_scale = &inv;
      o.unscale_grads = variant == 1;
      o.sr_params = variant != 2;
      o.moments_nearest = variant == 2;
      o.seed = 0x5EEDull + static_cast<uint64_t>(variant);
      o.q8_block = block;
      o.ema_decay = variant == 1 ? 0.25 : 0.999;  // both of lerp's forms
      set_context("block %lld variant %d", static_cast<long long>(block), variant);
      step_and_compare<Q8, Q8View>(cpu, o, 2, 4, nullptr);  // chunk and launch splits
    }
  }
}

// A skipped step writes no code and no scale; a bad block size launches nothing.
EMU_TEST(adam_q8_skip_and_arguments) {
  Rng r(1700);
  Q8 q = make_q8(r, MP_BF16, MP_BF16, 2, 5000, 256, 0, 3);
  Q8View v;
  mp_step_tensor t = q8_tensor(q, v);
  const Q8 before = q;
  const float one = 1.0f;
  mp_step_options o{};
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.lr_value = 1e-3f;
  o.found_inf = &one;
  o.q8_block = 256;
  CHECK(mp_step_multi_cuda(&t, 1, &o, nullptr) == MP_OK, "status");
  q8_unpack(q, v);
  CHECK(same_q8(q, before), "a skipped step wrote something");
  o.found_inf = nullptr;
  for (int64_t bad : {int64_t{0}, int64_t{16}, int64_t{96}, int64_t{4096}}) {
    o.q8_block = bad;
    const int64_t l0 = mp_emu::launch_count();
    CHECK(mp_step_multi_cuda(&t, 1, &o, nullptr) == MP_ERR_INVALID_ARGUMENT &&
              mp_emu::launch_count() == l0, "block %lld not refused", static_cast<long long>(bad));
  }
  q8_unpack(q, v);
  CHECK(same_q8(q, before), "a refused call wrote something");
}

// ---- Lion and SGD: the rule template of cuda/step.cu ----
// Every storage (fp32 param, master, remainder, none to nearest or stochastic) and moment format
// (fp32, bf16 stochastic or nearest, the signed 8-bit code alone) of the lean and 8-bit paths,
// for each rule (SGD also without momentum: no moment at all), with offsets that put some
// tensors across the 2^32 boundary of the positions, across chunk and launch splits; CUDA
// against the core, every array bit for bit.
EMU_TEST(rules_lean_storage_match_the_core) {
  for (const RuleCase& c : kRuleCases) {
    Rng r(2000 + static_cast<uint64_t>(c.rule) * 10 + static_cast<uint64_t>(c.b1 * 10));
    std::vector<Lean> cpu = lean_rule_params(r, 2, 3);
    for (int variant = 0; variant < 4; ++variant) {
      const float inv = 0.25f;
      const mp_step_options o = rule_options(c, variant, &inv);
      set_context("%s variant %d", c.name, variant);
      step_and_compare<Lean, LeanView>(cpu, o, 3, 5, rule_edit(moments_of(c), 1));
    }
  }
}

EMU_TEST(rules_q8_match_the_core) {
  for (const RuleCase& c : kRuleCases) {
    if (moments_of(c) == 0) continue;  // no moment to code
    Rng r(2600 + static_cast<uint64_t>(c.rule) * 10 + static_cast<uint64_t>(c.b1 * 10));
    for (int64_t block : {int64_t{32}, int64_t{256}, int64_t{2048}}) {
      std::vector<Q8> cpu =
          q8_params(r, block, false, {kChunk + 2048 + 77, 3 * block + 5, 2048, 1});
      for (int variant = 0; variant < 3; ++variant) {
        const float inv = 0.5f;
        mp_step_options o = rule_options(c, variant, &inv);
        o.q8_block = block;
        set_context("%s block %lld variant %d", c.name, static_cast<long long>(block), variant);
        step_and_compare<Q8, Q8View>(cpu, o, 2, 4, rule_edit(1, block));
      }
    }
  }
}

// An offset off the block grid with 8-bit moments is refused, launching nothing.
EMU_TEST(rules_q8_unaligned_offset_refused) {
  Rng r(2700);
  Q8 q = make_q8(r, MP_F32, MP_F32, 0, 1000, 256, 0, 1);
  Q8View v;
  mp_step_tensor t = q8_tensor(q, v);
  t.exp_avg_sq = nullptr;
  t.exp_avg_sq_scale = nullptr;
  t.offset = 100;
  const float inv = 1.0f;
  mp_step_options o = rule_options(kRuleCases[0], 0, &inv);
  o.q8_block = 256;
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_step_multi_cuda(&t, 1, &o, nullptr) == MP_ERR_INVALID_ARGUMENT &&
            mp_emu::launch_count() == l0, "an unaligned offset was not refused");
  CHECK(mp_step(&t, 0, t.n, &o) == MP_ERR_INVALID_ARGUMENT, "the core took it");
}

// ---- telemetry: the counting kernel (mp_step_multi_stats_cuda) ----
// Every rule x storage x moment format of the lean and 8-bit cases above, stepped three ways
// from the same state: the core's counted step (mp_step_stats), the uncounted kernel and the
// counting kernel. The counting kernel's arrays equal both others' bit for bit (counting changes
// nothing), and its rows equal the core's: the whole-number columns exactly, the sums of errors
// to within the rounding of a sum of n non-negative terms added in another order.
EMU_TEST(step_stats_lean_match_the_core) {
  Seen seen;
  for (const RuleCase& c : stats_rule_cases(0.999)) {
    Rng r(4000 + static_cast<uint64_t>(c.rule) * 10 + static_cast<uint64_t>(c.b1 * 10));
    const int nmom = moments_of(c);
    // two params per case span chunks (one fp32, one 16-bit): the splits; the others small
    std::vector<Lean> cpu = lean_rule_params(r, nmom == 2 ? 4 : nmom == 1 ? 2 : 1, 11);
    for (int variant = 0; variant < 3; ++variant) {  // RNE; SR + unscale_grads; nearest moments
      const float inv = 0.25f;
      mp_step_options o = rule_options(c, variant, &inv);
      if (c.rule == MP_RULE_ADAM) o.eps = 1e-8;
      set_context("%s variant %d", c.name, variant);
      step_and_compare<Lean, LeanView>(cpu, o, 3, 5, rule_edit(nmom, 1), &seen, 77 + variant);
    }
  }
  check_columns_seen(seen, {MP_STS_ELEMS, MP_STS_CHANGED, MP_STS_UNMOVED, MP_STS_SUBHALF,
                            MP_STS_M_ERR, MP_STS_M_ABS, MP_STS_V_ERR, MP_STS_V_ABS,
                            MP_STS_EMA_LAG, MP_STS_EMA_ABS});
}

EMU_TEST(step_stats_q8_match_the_core) {
  Seen seen;
  for (const RuleCase& c : stats_rule_cases(0.99)) {
    const int nmom = moments_of(c);
    if (nmom == 0) continue;
    Rng r(4600 + static_cast<uint64_t>(c.rule) * 10 + static_cast<uint64_t>(c.b1 * 10));
    // 32: a block within a warp; 512: a block over two warps (the flag through shared memory)
    for (int64_t block : {int64_t{32}, int64_t{512}}) {
      // adam's first param spans chunks (rows added to by several blocks and launches; the
      // other rules' counting is the same code), the others end inside a block and a pass: the
      // emulated 8-bit path is slow (256 fibers a block, barriers per pass)
      std::vector<Q8> cpu = q8_params(r, block, false, {3 * block + 5, 2048, 1},
                                      nmom == 2 ? kChunk + 2048 + 77 : 0);
      for (int variant = 1; variant < 3; ++variant) {  // SR params and codes; RNE and nearest
        const float inv = 0.5f;
        mp_step_options o = rule_options(c, variant, &inv);
        if (nmom == 2) o.eps = 1e-8;
        o.q8_block = block;
        set_context("%s block %lld variant %d", c.name, static_cast<long long>(block), variant);
        step_and_compare<Q8, Q8View>(cpu, o, 2, 4, rule_edit(nmom, block), &seen, 99 + variant);
      }
    }
  }
  check_columns_seen(seen, {MP_STS_ELEMS, MP_STS_CHANGED, MP_STS_UNMOVED, MP_STS_SUBHALF,
                            MP_STS_M_ERR, MP_STS_M_ABS, MP_STS_V_ERR, MP_STS_V_ABS,
                            MP_STS_Q8_FLUSHED, MP_STS_Q8_SATBLOCKS, MP_STS_Q8_BLOCKS,
                            MP_STS_EMA_LAG, MP_STS_EMA_ABS});
}

// A skipped step counts nothing and writes nothing; a null stats array launches nothing.
EMU_TEST(step_stats_skip_and_arguments) {
  Rng r(4900);
  Lean l = make_lean(r, MP_BF16, MP_BF16, 3, MP_F32, MP_F32, 1000, 1);
  const Lean before = l;
  mp_step_tensor t = lean_tensor(l);
  const float inv = 1.0f, found = 1.0f;
  mp_step_options o = lean_adamw(&inv);
  o.found_inf = &found;
  std::vector<double> rows = start_rows(1, 5), start = rows;
  CHECK(mp_step_multi_stats_cuda(&t, 1, &o, rows.data(), nullptr) == MP_OK, "status");
  CHECK(same_lean(l, before) && rows == start, "a skipped step wrote or counted");
  o.found_inf = nullptr;
  const int64_t l0 = mp_emu::launch_count();
  CHECK(mp_step_multi_stats_cuda(&t, 1, &o, nullptr, nullptr) == MP_ERR_INVALID_ARGUMENT &&
            mp_emu::launch_count() == l0 && same_lean(l, before),
        "a null stats array was not refused");
}
