// CPU kernels of LANS / LAMB (training/optim/lans.py, impl "cpu"): one call per phase over all fragments of a
// parameter group. Work is cut into blocks of kBlock elements across all fragments and spread over torch's
// intra-op threads; each block's sums of squares are accumulated in double, then added per fragment in block
// order, so the result does not depend on the number of threads.
//
// Accuracy of the sums of squares: each term is the square of a float (exact in double: 24-bit mantissas
// give 48-bit products) and >= 0, so however -march=native vectorises the double additions (4 lanes with
// AVX2, 8 with AVX-512, several accumulators), n terms carry a relative error of at most
// gamma_n = n u / (1 - n u), u = 2^-53 (Higham 2002, section 4.2): ISA-independent, the bound of
// training/optim/elementwise.py's sum_of_squares. The double accumulators cost nothing measurable (memory-bound).
//
// Per fragment f, sc[f] = [s, 1-b1, b2, 1-b2, eps', wd_r, wd_c] and a[f] = [a_r, a_c] (see elementwise.py):
//   moments_sumsq: gt = s g ; m <- m + (1-b1)(gt - m) ; v <- b2 v + (1-b2) gt^2 ;
//                  returns per fragment [sum r'^2, sum c'^2, sum w^2], r' = m/(sqrt v + eps') + wd_r w,
//                  c' = gt/(sqrt v + eps') + wd_c w
//   update:        w <- w + a_r r' + a_c c'
// LAMB passes s = 1, wd_c = 0, a_c = 0. Gradients may be fp32 or bf16; w, m, v are fp32.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 1 << 15;

struct Item {
  int64_t frag, begin, end;
};

std::vector<Item> make_items(const std::vector<at::Tensor>& xs) {
  std::vector<Item> items;
  for (int64_t f = 0; f < static_cast<int64_t>(xs.size()); ++f) {
    const int64_t n = xs[f].numel();
    for (int64_t b = 0; b < n; b += kBlock) items.push_back({f, b, std::min(n, b + kBlock)});
  }
  return items;
}

void check_fp32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat, what,
              " must be contiguous fp32 CPU tensors");
}

void check_group(const std::vector<at::Tensor>& gs, const std::vector<at::Tensor>& ws,
                 const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs, const at::Tensor& sc) {
  const size_t n = gs.size();
  TORCH_CHECK(ws.size() == n && ms.size() == n && vs.size() == n, "fragment lists differ in length");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 2 && sc.size(1) == 7 &&
                  sc.size(0) == static_cast<int64_t>(n),
              "sc must be a contiguous fp32 [fragments, 7] tensor");
  for (size_t f = 0; f < n; ++f) {
    check_fp32(ws[f], "w");
    check_fp32(ms[f], "m");
    check_fp32(vs[f], "v");
    TORCH_CHECK(gs[f].device().is_cpu() && gs[f].is_contiguous() &&
                    (gs[f].scalar_type() == at::kFloat || gs[f].scalar_type() == at::kBFloat16),
                "g must be contiguous fp32 or bf16 CPU tensors");
    const int64_t k = gs[f].numel();
    TORCH_CHECK(ws[f].numel() == k && ms[f].numel() == k && vs[f].numel() == k, "fragment sizes differ");
  }
}

template <typename G>
void sumsq_block(const G* x, int64_t begin, int64_t end, double* out) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = begin; i < end; ++i) {
    const double xi = static_cast<double>(static_cast<float>(x[i]));
    acc += xi * xi;
  }
  *out = acc;
}

template <typename G>
void moments_block(const G* g, const float* w, float* m, float* v, const float* sc, int64_t begin,
                   int64_t end, double* out) {
  const float s = sc[0], omb1 = sc[1], b2 = sc[2], omb2 = sc[3], eps = sc[4], wdr = sc[5], wdc = sc[6];
  double rr = 0.0, cc = 0.0, ww = 0.0;
#pragma omp simd reduction(+ : rr, cc, ww)
  for (int64_t i = begin; i < end; ++i) {
    const float gt = static_cast<float>(g[i]) * s;
    const float wi = w[i];
    const float mi = m[i] + omb1 * (gt - m[i]);
    const float vi = v[i] * b2 + gt * gt * omb2;
    m[i] = mi;
    v[i] = vi;
    const float b = std::sqrt(vi) + eps;
    const double r = mi / b + wdr * wi;
    const double c = gt / b + wdc * wi;
    const double wd = wi;
    rr += r * r;
    cc += c * c;
    ww += wd * wd;
  }
  out[0] = rr;
  out[1] = cc;
  out[2] = ww;
}

template <typename G>
void update_block(const G* g, float* w, const float* m, const float* v, const float* sc, const float* a,
                  int64_t begin, int64_t end) {
  const float s = sc[0], eps = sc[4], wdr = sc[5], wdc = sc[6], ar = a[0], ac = a[1];
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gt = static_cast<float>(g[i]) * s;
    const float wi = w[i];
    const float b = std::sqrt(v[i]) + eps;
    const float r = m[i] / b + wdr * wi;
    const float c = gt / b + wdc * wi;
    w[i] = wi + (ar * r + ac * c);
  }
}

// Per-fragment sums of `width` block results, in block order.
at::Tensor reduce_items(const std::vector<Item>& items, const std::vector<double>& partial, int64_t frags,
                        int64_t width) {
  at::Tensor out = at::zeros({frags, width}, at::TensorOptions().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (size_t k = 0; k < items.size(); ++k)
    for (int64_t j = 0; j < width; ++j) o[items[k].frag * width + j] += partial[k * width + j];
  return out;
}

}  // namespace

at::Tensor sum_of_squares(const std::vector<at::Tensor>& xs) {
  for (const auto& x : xs)
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "sum_of_squares: contiguous fp32 or bf16 CPU tensors only");
  const auto items = make_items(xs);
  std::vector<double> partial(items.size());
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Item& it = items[k];
      const at::Tensor& x = xs[it.frag];
      if (x.scalar_type() == at::kFloat)
        sumsq_block(x.data_ptr<float>(), it.begin, it.end, &partial[k]);
      else
        sumsq_block(x.data_ptr<at::BFloat16>(), it.begin, it.end, &partial[k]);
    }
  });
  return reduce_items(items, partial, static_cast<int64_t>(xs.size()), 1).view({-1});
}

at::Tensor moments_sumsq(const std::vector<at::Tensor>& gs, const std::vector<at::Tensor>& ws,
                         const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                         const at::Tensor& sc) {
  check_group(gs, ws, ms, vs, sc);
  const auto items = make_items(ws);
  std::vector<double> partial(3 * items.size());
  const float* scp = sc.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Item& it = items[k];
      const int64_t f = it.frag;
      float* w = ws[f].data_ptr<float>();
      float* m = ms[f].data_ptr<float>();
      float* v = vs[f].data_ptr<float>();
      if (gs[f].scalar_type() == at::kFloat)
        moments_block(gs[f].data_ptr<float>(), w, m, v, scp + 7 * f, it.begin, it.end, &partial[3 * k]);
      else
        moments_block(gs[f].data_ptr<at::BFloat16>(), w, m, v, scp + 7 * f, it.begin, it.end,
                      &partial[3 * k]);
    }
  });
  return reduce_items(items, partial, static_cast<int64_t>(ws.size()), 3);
}

void update(const std::vector<at::Tensor>& gs, const std::vector<at::Tensor>& ws,
            const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs, const at::Tensor& sc,
            const at::Tensor& a) {
  check_group(gs, ws, ms, vs, sc);
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 2 && a.size(1) == 2 &&
                  a.size(0) == sc.size(0),
              "a must be a contiguous fp32 [fragments, 2] tensor");
  const auto items = make_items(ws);
  const float* scp = sc.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Item& it = items[k];
      const int64_t f = it.frag;
      float* w = ws[f].data_ptr<float>();
      const float* m = ms[f].data_ptr<float>();
      const float* v = vs[f].data_ptr<float>();
      if (gs[f].scalar_type() == at::kFloat)
        update_block(gs[f].data_ptr<float>(), w, m, v, scp + 7 * f, ap + 2 * f, it.begin, it.end);
      else
        update_block(gs[f].data_ptr<at::BFloat16>(), w, m, v, scp + 7 * f, ap + 2 * f, it.begin, it.end);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("sum_of_squares", &sum_of_squares, "per-tensor sums of squares (float64)");
  mod.def("moments_sumsq", &moments_sumsq, "LANS/LAMB moment update and sums of squares of r', c', w");
  mod.def("update", &update, "LANS/LAMB weight update");
}
