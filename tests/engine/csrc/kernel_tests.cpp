// Every vector kernel table this CPU (or qemu) runs, against the scalar table:
// same inputs, results within float tolerance. Built natively and with the
// aarch64 / s390x cross toolchains (see `make test-kernels-cross`).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <omp.h>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_table.hpp"
#include "kernels/prefetch.hpp"
#include "kernels/shares.hpp"
#include "kernels/quant_format.hpp"

using namespace cpuserve;

namespace {

std::vector<const KernelTable*> vector_tables() {
  std::vector<const KernelTable*> out;
  for (const char* n : kIsaNames)
    if (std::strcmp(n, "scalar") != 0)
      if (const KernelTable* t = table_by_name(n)) out.push_back(t);
  return out;
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <typename T> std::vector<T> convert(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same<T, float>::value) out[i] = v[i];
    else if constexpr (std::is_same<T, bf16>::value) {
      uint32_t u; std::memcpy(&u, &v[i], 4); u += 0x7fffu + ((u >> 16) & 1u); out[i] = bf16{uint16_t(u >> 16)};
    } else if constexpr (!std::is_same<T, f16>::value) {  // float8
      out[i] = from_float<T>(v[i]);
    } else {  // f16 through float32 -> half via the table-independent reference below
      float f = v[i]; uint32_t u; std::memcpy(&u, &f, 4);
      uint32_t sign = (u >> 16) & 0x8000u, e = (u >> 23) & 0xff, m = u & 0x7fffffu;
      int ne = int(e) - 127 + 15;
      uint16_t h = (ne <= 0) ? uint16_t(sign) : (ne >= 31 ? uint16_t(sign | 0x7c00u) : uint16_t(sign | (ne << 10) | (m >> 13)));
      out[i] = f16{h};
    }
  }
  return out;
}

// Elements of tab's packed panels for an [n, k] weight of type T (bfloat16: K padded to bf16_k_align).
template <typename T>
size_t packed_size(const KernelTable* tab, int64_t n, int64_t k) {
  const int64_t align = std::is_same_v<T, bf16> ? tab->bf16_k_align : 2;
  return ((n + tab->gemm_nr - 1) / tab->gemm_nr) * tab->gemm_nr * ((k + align - 1) / align * align);
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, float tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_NEAR(a[i], b[i], tol * (1.f + std::fabs(b[i]))) << "at " << i;
}

class VectorVsScalar : public ::testing::TestWithParam<const KernelTable*> {};

TEST(Dispatch, ScalarAlwaysPresent) {
  ASSERT_NE(table_scalar(), nullptr);
  ASSERT_NE(best_table(), nullptr);
  std::printf("best ISA here: %s (vector tables: %zu)\n", best_table()->isa, vector_tables().size());
}

TEST_P(VectorVsScalar, RmsNormAndFusedAdd) {
  const KernelTable* v = GetParam();
  const KernelTable* s = table_scalar();
  const int64_t rows = 5, dim = 77;
  auto x = randn(rows * dim, 1), w = randn(dim, 2), r = randn(rows * dim, 3);
  std::vector<float> o1(x.size()), o2(x.size());
  v->rms_norm(o1.data(), x.data(), w.data(), rows, dim, dim, dim, 1e-5f);
  s->rms_norm(o2.data(), x.data(), w.data(), rows, dim, dim, dim, 1e-5f);
  expect_close(o1, o2, 1e-5f);
  auto x1 = x, x2 = x, r1 = r, r2 = r;
  v->fused_add_rms_norm(x1.data(), r1.data(), w.data(), rows, dim, dim, dim, 1e-6f);
  s->fused_add_rms_norm(x2.data(), r2.data(), w.data(), rows, dim, dim, dim, 1e-6f);
  expect_close(r1, r2, 0.f);
  expect_close(x1, x2, 1e-5f);
}

TEST_P(VectorVsScalar, RotaryBothStyles) {
  const int64_t t = 7, hq = 4, hk = 2, d = 72, rot = 72, max_pos = 50;
  auto cs = randn(max_pos * rot, 4);
  std::vector<int64_t> pos = {0, 3, 9, 17, 49, 1, 2};
  for (bool neox : {true, false}) {
    auto q1 = randn(t * hq * d, 5), k1 = randn(t * hk * d, 6);
    auto q2 = q1, k2 = k1;
    GetParam()->rotary(q1.data(), k1.data(), pos.data(), cs.data(), t, hq, hk, d, rot, hq * d, hk * d, neox);
    table_scalar()->rotary(q2.data(), k2.data(), pos.data(), cs.data(), t, hq, hk, d, rot, hq * d, hk * d, neox);
    expect_close(q1, q2, 1e-5f);
    expect_close(k1, k2, 1e-5f);
  }
}

TEST_P(VectorVsScalar, GatedActivations) {
  const int64_t t = 3, d = 45;
  auto x = randn(t * 2 * d, 7, 3.f);
  std::vector<float> o1(t * d), o2(t * d);
  GetParam()->silu_and_mul(o1.data(), x.data(), t, d, 2 * d, d);
  table_scalar()->silu_and_mul(o2.data(), x.data(), t, d, 2 * d, d);
  expect_close(o1, o2, 1e-5f);
  GetParam()->gelu_and_mul(o1.data(), x.data(), t, d, 2 * d, d, true);
  table_scalar()->gelu_and_mul(o2.data(), x.data(), t, d, 2 * d, d, true);
  expect_close(o1, o2, 1e-5f);
}

// torch.argmax's rule written out: the first index of the largest value, the first NaN if any.
int64_t argmax_reference(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

TEST_P(VectorVsScalar, Argmax) {
  const float inf = INFINITY, nan = NAN, big = 3.4e38f;
  for (int64_t n : {3, 17, 300, 1000, 4099}) {
    const int64_t rows = 9;
    auto x = randn(rows * n, 11 + n, 5.f);
    auto row = [&](int64_t r) { return x.data() + r * n; };
    row(1)[n / 3] = row(1)[n - 1] = 100.f;                   // a tie across blocks
    std::fill(row(2), row(2) + n / 2, -inf);                 // masked
    std::fill(row(3), row(3) + n, -inf);                     // all masked: index 0
    row(4)[n / 4] = 100.f, row(4)[n / 2] = nan;              // the NaN wins
    row(5)[n / 2] = inf;
    std::fill(row(6), row(6) + n, big);                      // sums overflow
    std::fill(row(7), row(7) + n, 0.f), row(7)[0] = -0.f;    // signed zeros tie
    for (int64_t i = 0; i < n; ++i) row(8)[i] = float(i);    // every block better than the last
    std::vector<int64_t> got(rows), scalar(rows);
    GetParam()->argmax(got.data(), x.data(), rows, n, n);
    table_scalar()->argmax(scalar.data(), x.data(), rows, n, n);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(got[r], argmax_reference(row(r), n)) << "n " << n << " row " << r;
      EXPECT_EQ(scalar[r], argmax_reference(row(r), n)) << "scalar, n " << n << " row " << r;
    }
  }
}

// The bf16 pair path written out: A and W as bfloat16, per output one chain over k pairs,
// each pair adding the high product, then the low one (vdpbf16ps' order), then the bias.
std::vector<float> bf16_pair_reference(const std::vector<float>& a, const std::vector<bf16>& w,
                                       const std::vector<float>& bias, int64_t m, int64_t n, int64_t k) {
  std::vector<float> c(m * n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      for (int64_t q = 0; 2 * q < k; ++q) {
        const float hi = 2 * q + 1 < k ? to_float(from_float<bf16>(a[r * k + 2 * q + 1])) *
                                             to_float(w[j * k + 2 * q + 1]) : 0.f;
        acc = acc + hi;
        acc = acc + to_float(from_float<bf16>(a[r * k + 2 * q])) * to_float(w[j * k + 2 * q]);
      }
      c[r * n + j] = acc + bias[j];
    }
  return c;
}

template <typename T>
void check_gemm(const KernelTable* v, DType dt, int64_t m, int64_t n, int64_t k) {
  const KernelTable* s = table_scalar();
  auto a = randn(m * k, 8);
  auto w = convert<T>(randn(n * k, 9));
  auto bias = randn(n, 10);
  std::vector<T> pv(packed_size<T>(v, n, k));
  std::vector<T> ps(((n + s->gemm_nr - 1) / s->gemm_nr) * s->gemm_nr * k);
  v->pack_weight(pv.data(), w.data(), dt, n, k);
  s->pack_weight(ps.data(), w.data(), dt, n, k);
  std::vector<float> c1(m * n), c2(m * n);
  v->gemm(c1.data(), a.data(), pv.data(), dt, bias.data(), m, n, k, k, n);
  s->gemm(c2.data(), a.data(), ps.data(), dt, bias.data(), m, n, k, k, n);
  if constexpr (std::is_same_v<T, bf16>) {
    if (v->bf16_dot) {  // bfloat16 activations: the pair reference's bits (finite, normal data); AMX
      const auto ref = bf16_pair_reference(a, w, bias, m, n, k);  // tiles sum in an undocumented order
      if (std::strcmp(v->isa, "amx") != 0)
        ASSERT_EQ(0, std::memcmp(c1.data(), ref.data(), c1.size() * 4)) << v->isa << " m " << m << " k " << k;
      c2 = ref;
    }
  }
  expect_close(c1, c2, 1e-4f);
  // batch invariance inside the vector path: one row alone == that row in the batch
  std::vector<float> row(n);
  v->gemm(row.data(), a.data() + (m - 1) * k, pv.data(), dt, bias.data(), 1, n, k, k, n);
  for (int64_t j = 0; j < n; ++j) ASSERT_EQ(row[j], c1[(m - 1) * n + j]);
}

TEST_P(VectorVsScalar, GemmAllDtypes) {
  // 1-8 rows: one pass over the weights (gemm.hpp kPassRows); more: row tiles (two of up to 8
  // rows for 9-16, tile_rows)
  const std::vector<std::array<int64_t, 3>> shapes{{1, 96, 64},    {3, 96, 64},    {7, 70, 33},  {8, 200, 576},
                                                   {13, 70, 33},   {16, 96, 576},  {50, 130, 400}, {300, 70, 40}};
  for (auto shape : shapes) {
    check_gemm<float>(GetParam(), DType::F32, shape[0], shape[1], shape[2]);
    check_gemm<bf16>(GetParam(), DType::BF16, shape[0], shape[1], shape[2]);
#if !defined(__s390x__)
    check_gemm<f16>(GetParam(), DType::F16, shape[0], shape[1], shape[2]);
#endif
  }
}

// Every table, the scalar one included: the gate/up GEMM fused with SiLU-and-mul equals gemm()
// then silu_and_mul() bit for bit (F a multiple of the panel width or not, one pass or row
// tiles, K blocks), into a strided output whose other columns stay untouched.
template <typename T>
void check_gemm_silu(const KernelTable* tab, DType dt) {
  for (auto [m, f, k] : std::vector<std::array<int64_t, 3>>{{1, 128, 64}, {2, 64, 33}, {8, 96, 576}, {9, 32, 4200},
                                                            {16, 64, 576}, {50, 160, 40}, {300, 64, 70}, {3, 40, 17}}) {
    auto a = randn(m * k, 21);
    auto w = convert<T>(randn(2 * f * k, 22, 0.1f));
    std::vector<T> packed(packed_size<T>(tab, 2 * f, k));
    tab->pack_weight(packed.data(), w.data(), dt, 2 * f, k);
    std::vector<float> proj(m * 2 * f), want(m * f), got(m * (f + 3), -7.f);
    tab->gemm(proj.data(), a.data(), packed.data(), dt, nullptr, m, 2 * f, k, k, 2 * f);
    tab->silu_and_mul(want.data(), proj.data(), m, f, 2 * f, f);
    tab->gemm_silu(got.data(), a.data(), packed.data(), dt, m, f, k, k, f + 3);
    for (int64_t r = 0; r < m; ++r) {
      ASSERT_EQ(0, std::memcmp(&got[r * (f + 3)], &want[r * f], f * 4)) << tab->isa << " m " << m << " f " << f;
      for (int64_t j = f; j < f + 3; ++j) ASSERT_EQ(got[r * (f + 3) + j], -7.f);
    }
  }
}

TEST(GatedGemm, EqualsGemmThenSiluAndMulEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  for (const KernelTable* tab : tables) {
    check_gemm_silu<float>(tab, DType::F32);
    check_gemm_silu<bf16>(tab, DType::BF16);
#if !defined(__s390x__)
    check_gemm_silu<f16>(tab, DType::F16);
#endif
  }
}

template <typename T>
void check_attention(const KernelTable* v, DType dt, int64_t bs, int64_t group, float ks = 1.f, float vs = 1.f,
                     int64_t d = 64, std::vector<int32_t> q_lens = {1, 19, 5}, std::vector<int32_t> ctx = {40, 19, 70}) {
  const KernelTable* s = table_scalar();
  const int64_t hk = 2, hq = hk * group;
  std::vector<int32_t> qsl = {0};
  for (auto l : q_lens) qsl.push_back(qsl.back() + l);
  const int64_t max_blocks = (*std::max_element(ctx.begin(), ctx.end()) + bs - 1) / bs, nblocks = 3 * max_blocks;
  std::vector<int32_t> tables(3 * max_blocks);
  for (int64_t i = 0; i < 3 * max_blocks; ++i) tables[i] = int32_t((i * 7) % nblocks);
  auto kc = convert<T>(randn(nblocks * hk * bs * d, 11));
  auto vc = convert<T>(randn(nblocks * hk * bs * d, 12));
  auto q = randn(qsl.back() * hq * d, 13);
  std::vector<float> o1(q.size()), o2(q.size());
  // A bfloat16 cache on a bf16_dot table: bfloat16 pair dot products, the queries rounded to
  // bfloat16 (given so to the scalar path too) and the probabilities as well (each off by at most
  // 2^-9 of itself, so the output by at most 2^-9 max|v|).
  const bool pairs = std::is_same_v<T, bf16> && v->bf16_dot;
  auto qs = q;
  float prob = 0.f;
  if (pairs) {
    for (auto& x : qs) x = to_float(from_float<bf16>(x));
    for (const auto& x : vc) prob = std::max(prob, std::fabs(to_float(x)));
    prob *= 1.f / 512.f;
  }
  for (int64_t window : {int64_t(0), int64_t(16), int64_t(700)}) {
    v->paged_attention(o1.data(), q.data(), kc.data(), vc.data(), dt, tables.data(), max_blocks, ctx.data(),
                       qsl.data(), 3, hq, hk, group, 0, d, bs, 0.125f, window, 0.f, hq * d, hq * d, ks, vs);
    s->paged_attention(o2.data(), qs.data(), kc.data(), vc.data(), dt, tables.data(), max_blocks, ctx.data(),
                       qsl.data(), 3, hq, hk, group, 0, d, bs, 0.125f, window, 0.f, hq * d, hq * d, ks, vs);
    for (size_t i = 0; i < o1.size(); ++i)
      ASSERT_NEAR(o1[i], o2[i], 2e-5f * (1.f + std::fabs(o2[i])) + prob) << v->isa << " at " << i;
  }
}

TEST_P(VectorVsScalar, PagedAttentionAllDtypesBlockSizesGqa) {
  for (int64_t bs : {16, 32, 128})
    for (int64_t group : {1, 3, 4, 8}) {
      check_attention<float>(GetParam(), DType::F32, bs, group);
      check_attention<bf16>(GetParam(), DType::BF16, bs, group);
      check_attention<f8e5m2>(GetParam(), DType::F8E5M2, bs, group, 0.5f, 2.f);
      check_attention<f8e4m3>(GetParam(), DType::F8E4M3, bs, group, 0.25f, 1.5f);
#if !defined(__s390x__)
      check_attention<f16>(GetParam(), DType::F16, bs, group);
#endif
    }
  // heads of 128: a decode's value rows longer than one AVX2 pass (kDecodeValueV)
  for (int64_t group : {1, 3}) {
    check_attention<float>(GetParam(), DType::F32, 128, group, 1.f, 1.f, 128);
    check_attention<bf16>(GetParam(), DType::BF16, 128, group, 1.f, 1.f, 128);
  }
}

// Rows past one partition of keys (attention.hpp kPartitionKeys: 2,048), merged in order: two
// decodes (split into an item a partition where the call has few items) and the last 40 rows of a
// prompt, windows starting inside a partition.
TEST_P(VectorVsScalar, PagedAttentionRowsOfSeveralPartitions) {
  const std::vector<int32_t> q_lens = {1, 40, 1}, ctx = {4500, 2200, 2060};
  for (int64_t bs : {16, 128}) {
    check_attention<float>(GetParam(), DType::F32, bs, 3, 1.f, 1.f, 64, q_lens, ctx);
    check_attention<bf16>(GetParam(), DType::BF16, bs, 3, 1.f, 1.f, 64, q_lens, ctx);
    check_attention<f8e5m2>(GetParam(), DType::F8E5M2, bs, 3, 0.5f, 2.f, 64, q_lens, ctx);
  }
}

TEST_P(VectorVsScalar, ReshapeAndCache) {
  const int64_t t = 9, hk = 3, d = 40, bs = 16, nblocks = 4;
  auto key = randn(t * hk * d, 14), value = randn(t * hk * d, 15);
  std::vector<int64_t> slots = {0, 5, 17, 63, -1, 33, 34, 2, 50};
  std::vector<bf16> k1(nblocks * hk * bs * d), v1(k1.size()), k2(k1.size()), v2(k1.size());
  GetParam()->reshape_and_cache(key.data(), value.data(), k1.data(), v1.data(), DType::BF16, slots.data(), t, hk, d,
                                bs, hk * d, hk * d, 1.f, 1.f);
  table_scalar()->reshape_and_cache(key.data(), value.data(), k2.data(), v2.data(), DType::BF16, slots.data(), t, hk,
                                    d, bs, hk * d, hk * d, 1.f, 1.f);
  ASSERT_EQ(0, std::memcmp(k1.data(), k2.data(), k1.size() * 2));
  ASSERT_EQ(0, std::memcmp(v1.data(), v2.data(), v1.size() * 2));
  for (DType dt : {DType::F8E5M2, DType::F8E4M3}) {  // scaled float8: same bytes on every path
    std::vector<uint8_t> a1(k1.size()), b1(k1.size()), a2(k1.size()), b2(k1.size());
    GetParam()->reshape_and_cache(key.data(), value.data(), a1.data(), b1.data(), dt, slots.data(), t, hk, d, bs,
                                  hk * d, hk * d, 0.25f, 3.f);
    table_scalar()->reshape_and_cache(key.data(), value.data(), a2.data(), b2.data(), dt, slots.data(), t, hk, d, bs,
                                      hk * d, hk * d, 0.25f, 3.f);
    ASSERT_EQ(a1, a2);
    ASSERT_EQ(b1, b2);
  }
}

// Self-balancing shares (shares.hpp): every item runs exactly once, in chunks of at most `chunk`
// contiguous items; a slow thread's share is finished by the others; a team smaller than planned
// (one thread) takes its own share from the front, then the others' from their backs.
TEST(Shares, EveryItemOnceSlowThreadHelpedMissingThreadsCovered) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(36), int64_t(1000)})
    for (int64_t chunk : {int64_t(1), int64_t(4), int64_t(1) << 40})
      for (int team : {1, 2, 3, 4}) {
        const bool slow0 = n == 1000 && chunk == 1;  // thread 0 slow: the others take its share's back
        std::vector<int> hits(n, 0);
        std::vector<std::vector<std::pair<int64_t, int64_t>>> seen(team);
        Shares shares(n, team);
#pragma omp parallel num_threads(team)
        {
          const int t = omp_get_thread_num();
          shares.run(t, chunk, [&](int64_t lo, int64_t hi) {
            if (slow0 && t == 0) {
              volatile double x = 0;
              for (int i = 0; i < 20000; ++i) x = x + i;
            }
            seen[t].push_back({lo, hi});
            for (int64_t i = lo; i < hi; ++i) {
#pragma omp atomic
              ++hits[i];
            }
          });
        }
        const int64_t per = (n + team - 1) / team;
        int64_t from_0 = 0;
        for (int t = 0; t < team; ++t)
          for (auto [lo, hi] : seen[t]) {
            ASSERT_LT(lo, hi);
            ASSERT_LE(hi - lo, chunk);
            if (t != 0 && lo < per) from_0 += hi - lo;
          }
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "item " << i << " n " << n << " team " << team;
        if (slow0 && team > 1) EXPECT_GT(from_0, 0) << "team " << team;
      }
  // planned for 3 threads, run by one: [0, 4) from the front, then the back of [4, 8) (the most
  // left), then of whichever has more, then [8, 10)
  Shares shares(10, 3);
  std::vector<std::pair<int64_t, int64_t>> got;
  shares.run(0, 2, [&](int64_t lo, int64_t hi) { got.push_back({lo, hi}); });
  EXPECT_EQ(got, (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 4}, {6, 8}, {4, 6}, {8, 10}}));
}

// Items claimed in order by whichever thread is free first (shares.hpp claimed_finish, the model
// paged attention cuts its calls by): a long item last waits for the others, first it overlaps
// them; one thread runs them all; more threads than items finish with the longest.
TEST(Shares, ClaimedFinishListSchedulingInOrder) {
  const auto finish = [](std::vector<double> costs, int64_t threads) {
    return claimed_finish(static_cast<int64_t>(costs.size()), threads, [&](int64_t i) { return costs[i]; });
  };
  EXPECT_EQ(finish({1, 1, 1, 3}, 2), 4);  // the 3 starts at 1, when both threads' first items end
  EXPECT_EQ(finish({3, 1, 1, 1}, 2), 3);  // the 1s run beside it
  EXPECT_EQ(finish({1, 1, 1, 1, 1}, 2), 3);
  EXPECT_EQ(finish({2, 5, 1}, 1), 8);
  EXPECT_EQ(finish({2, 5, 1}, 8), 5);
  EXPECT_EQ(finish({}, 4), 0);
  EXPECT_EQ(finish({4, 1, 1, 1, 1, 1, 1}, 3), 4);
}

// The GEMMs' bits do not depend on the thread count or on which thread takes which panels
// (shares.hpp): 1, 2, 3 and 5 threads give the same output, one pass (decode) or row tiles.
TEST(Gemm, SameBitsAnyThreadCountEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const int before = omp_get_max_threads();
  for (const KernelTable* tab : tables)
    for (auto [m, n, k] : std::vector<std::array<int64_t, 3>>{{1, 960, 576}, {2, 200, 100}, {64, 576, 576},
                                                              {130, 200, 64}}) {
      auto a = randn(m * k, 31);
      auto w = convert<bf16>(randn(n * k, 32, 0.1f));
      std::vector<bf16> packed(packed_size<bf16>(tab, n, k));
      tab->pack_weight(packed.data(), w.data(), DType::BF16, n, k);
      std::vector<float> want, got(m * n), act_want, act(m * (n / 2));
      for (int threads : {1, 2, 3, 5}) {
        omp_set_num_threads(threads);
        tab->gemm(got.data(), a.data(), packed.data(), DType::BF16, nullptr, m, n, k, k, n);
        if (n % (2 * tab->gemm_nr) == 0)
          tab->gemm_silu(act.data(), a.data(), packed.data(), DType::BF16, m, n / 2, k, k, n / 2);
        if (want.empty()) {
          want = got;
          act_want = act;
          continue;
        }
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
            << tab->isa << " m " << m << " threads " << threads;
        ASSERT_EQ(0, std::memcmp(act.data(), act_want.data(), act.size() * 4)) << tab->isa << " m " << m;
      }
    }
  omp_set_num_threads(before);
}

// How decode GEMVs fetch their weights (DecodeFetch, kernels/prefetch.hpp): chosen by vendor, and
// either way the same bits on every table: one and two rows (the 4- and 2-panel decode kernels
// that fetch ahead, a K longer and one shorter than kL2AheadSteps, a last narrow panel), the gated
// GEMM, and the bandwidth probe's sum.
template <typename T>
void check_fetch_same_bits(const KernelTable* tab, DType dt) {
  for (auto [m, n, k] : std::vector<std::array<int64_t, 3>>{{1, 960, 576}, {2, 200, 100}, {1, 130, 5}, {2, 256, 7}}) {
    auto a = randn(m * k, 41);
    auto w = convert<T>(randn(n * k, 42, 0.1f));
    std::vector<T> packed(packed_size<T>(tab, n, k));
    tab->pack_weight(packed.data(), w.data(), dt, n, k);
    std::vector<float> got[2], act[2];
    for (int f = 0; f < 2; ++f) {
      set_decode_fetch(f == 0 ? DecodeFetch::kNonTemporal : DecodeFetch::kL2Ahead);
      got[f].resize(m * n);
      act[f].resize(m * (n / 2));
      tab->gemm(got[f].data(), a.data(), packed.data(), dt, nullptr, m, n, k, k, n);
      tab->gemm_silu(act[f].data(), a.data(), packed.data(), dt, m, n / 2, k, k, n / 2);
    }
    ASSERT_EQ(0, std::memcmp(got[0].data(), got[1].data(), got[0].size() * 4)) << tab->isa << " m " << m << " k " << k;
    ASSERT_EQ(0, std::memcmp(act[0].data(), act[1].data(), act[0].size() * 4)) << tab->isa << " m " << m << " k " << k;
  }
}

TEST(DecodeFetch, VendorChoiceAndSameBitsEveryTable) {
  EXPECT_EQ(decode_fetch_for("GenuineIntel"), DecodeFetch::kL2Ahead);
  EXPECT_EQ(decode_fetch_for("AuthenticAMD"), DecodeFetch::kNonTemporal);
  EXPECT_EQ(decode_fetch_for(""), DecodeFetch::kNonTemporal);
  const DecodeFetch before = decode_fetch();
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const auto x = randn(100003, 43);
  for (const KernelTable* tab : tables) {
    check_fetch_same_bits<float>(tab, DType::F32);
    check_fetch_same_bits<bf16>(tab, DType::BF16);
#if !defined(__s390x__)
    check_fetch_same_bits<f16>(tab, DType::F16);
#endif
    set_decode_fetch(DecodeFetch::kNonTemporal);
    const float nta = tab->read_sum(x.data(), static_cast<int64_t>(x.size()));
    set_decode_fetch(DecodeFetch::kL2Ahead);
    EXPECT_EQ(nta, tab->read_sum(x.data(), static_cast<int64_t>(x.size()))) << tab->isa;
  }
  set_decode_fetch(before);
}

// The greedy LM head (kernels/greedy_head.hpp) answers what the same table's float32 GEMM and
// argmax answer, on every table: rows far apart, near ties (columns whose logits differ by less
// than the bfloat16 copy can tell), exact ties (the first index), a zero row (all logits 0), rows
// with a NaN or an infinity (left undecided: -1), a vocabulary that is not a whole number of
// vectors, and several thread counts.
TEST(GreedyHead, SameTokenAsFloat32GemmArgmaxEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const int before = omp_get_max_threads();
  for (const KernelTable* tab : tables)
    for (int64_t n : {1000, 4099}) {
      const int64_t k = 96, m = 8;
      auto w = randn(n * k, 41, 0.2f);
      for (int64_t i = 0; i < k; ++i) {  // near ties: column 7 ~ column 900 + tiny, 300 == 301
        w[900 * k + i] = w[7 * k + i] * (1.f + 1e-6f * float(i % 3));
        w[301 * k + i] = w[300 * k + i];
      }
      auto a = randn(m * k, 42);
      for (int64_t i = 0; i < k; ++i) a[1 * k + i] = w[7 * k + i];      // row 1: 7 vs 900, closer than bf16
      for (int64_t i = 0; i < k; ++i) a[2 * k + i] = 3 * w[300 * k + i];  // row 2: the tie 300 / 301
      std::fill(a.begin() + 3 * k, a.begin() + 4 * k, 0.f);               // row 3: every logit 0
      a[4 * k + 5] = NAN;
      a[5 * k + 9] = INFINITY;
      std::vector<float> packed(packed_size<float>(tab, n, k));
      tab->pack_weight(packed.data(), w.data(), DType::F32, n, k);
      auto wb = convert<bf16>(w);
      std::vector<bf16> packed_b(packed_size<bf16>(tab, n, k));
      tab->pack_weight(packed_b.data(), wb.data(), DType::BF16, n, k);
      std::vector<float> logits(m * n), approx(m * n), norms(n);
      tab->gemm(logits.data(), a.data(), packed.data(), DType::F32, nullptr, m, n, k, k, n);
      tab->gemm(approx.data(), a.data(), packed_b.data(), DType::BF16, nullptr, m, n, k, k, n);
      float norm_max = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        double s = 0;
        for (int64_t i = 0; i < k; ++i) s += double(w[t * k + i]) * w[t * k + i];
        norms[t] = float(std::sqrt(s) * (1 + 1e-6));
        norm_max = std::max(norm_max, norms[t]);
      }
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        std::vector<int64_t> got(m);
        const int64_t undecided = tab->greedy_head(got.data(), approx.data(), n, a.data(), k, packed.data(),
                                                   norms.data(), norm_max, 0, m, n, k);
        EXPECT_EQ(undecided, 2) << tab->isa;
        for (int64_t r = 0; r < m; ++r) {
          if (r == 4 || r == 5) {
            EXPECT_EQ(got[r], -1) << tab->isa << " row " << r;
            continue;
          }
          EXPECT_EQ(got[r], argmax_reference(logits.data() + r * n, n)) << tab->isa << " n " << n << " row " << r;
        }
        EXPECT_EQ(got[2], 300) << tab->isa;
        EXPECT_EQ(got[3], 0) << tab->isa;
      }
      // bound 1: any copy (here W on a grid of 2^-7, its float32 GEMM) with norms[t] >= |W'_t - W_t|
      // + g' (|W'_t| + |W_t|), g' = n u / (1 - n u) for n = 2k + 64 (greedy_head.hpp)
      std::vector<float> wq(w.size()), approx_q(m * n), errors(n);
      for (size_t i = 0; i < w.size(); ++i) wq[i] = std::ldexp(std::nearbyint(std::ldexp(w[i], 7)), -7);
      std::vector<float> packed_q(packed.size());
      tab->pack_weight(packed_q.data(), wq.data(), DType::F32, n, k);
      tab->gemm(approx_q.data(), a.data(), packed_q.data(), DType::F32, nullptr, m, n, k, k, n);
      const double u = std::ldexp(1.0, -24), gq = (2 * k + 64) * u / (1 - (2 * k + 64) * u);
      float error_max = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        double diff = 0, nq = 0, nw = 0;
        for (int64_t i = 0; i < k; ++i) {
          const double x = w[t * k + i], y = wq[t * k + i];
          diff += (x - y) * (x - y), nq += y * y, nw += x * x;
        }
        errors[t] = float((std::sqrt(diff) + gq * (std::sqrt(nq) + std::sqrt(nw))) * (1 + 1e-6));
        error_max = std::max(error_max, errors[t]);
      }
      std::vector<int64_t> got(m);
      const int64_t undecided = tab->greedy_head(got.data(), approx_q.data(), n, a.data(), k, packed.data(),
                                                 errors.data(), error_max, 1, m, n, k);
      EXPECT_EQ(undecided, 2) << tab->isa;
      for (int64_t r : {0, 1, 2, 3, 6, 7})
        EXPECT_EQ(got[r], argmax_reference(logits.data() + r * n, n)) << tab->isa << " n " << n << " row " << r;
    }
  omp_set_num_threads(before);
}

// The arithmetic peak probe (kernels/peak.hpp) counts every thread's chains: its FLOPs double
// with its steps and grow with the threads, and only the tables with bf16 pair dot products
// (avx512_bf16, amx) run pairs, counted as two multiply-adds a lane; amx's bfloat16 probe runs on
// tiles, four 16 x 16 x 32 tile dot products a step. NEON and VXE run it under qemu in the cross
// builds.
TEST(Peak, FlopsCountEveryThreadsChainsEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const int before = omp_get_max_threads();
  for (const KernelTable* tab : tables) {
    omp_set_num_threads(1);
    const double one = tab->peak_flops(false, 1000);
    EXPECT_GT(one, 0) << tab->isa;
    EXPECT_EQ(2 * one, tab->peak_flops(false, 2000)) << tab->isa;
    omp_set_num_threads(3);
    EXPECT_EQ(3 * one, tab->peak_flops(false, 1000)) << tab->isa;
    omp_set_num_threads(1);
    const bool amx = std::strcmp(tab->isa, "amx") == 0;
    const bool pairs = std::strcmp(tab->isa, "avx512_bf16") == 0 || amx;
    EXPECT_EQ(amx ? 1000.0 * 4 * 16 * 16 * 32 * 2 : pairs ? 2 * one : -1.0, tab->peak_flops(true, 1000)) << tab->isa;
    if (amx) {
      omp_set_num_threads(2);
      EXPECT_EQ(2 * 1000.0 * 4 * 16 * 16 * 32 * 2, tab->peak_flops(true, 1000));
      omp_set_num_threads(1);
    }
  }
  omp_set_num_threads(before);
}

// float8 conversions: every e5m2 / e4m3 value survives a round trip; rounding is to nearest
// even (e4m3 saturating at 448); the vector loads decode as the scalar conversion does.
TEST(Float8, RoundTripRoundingAndVectorLoads) {
  for (int i = 0; i < 256; ++i) {
    const float a = to_float(f8e5m2{uint8_t(i)}), b = to_float(f8e4m3{uint8_t(i)});
    if (a == a) ASSERT_EQ(from_float<f8e5m2>(a).bits, i == 0x80 ? 0x80 : i) << i;
    if (b == b) ASSERT_EQ(from_float<f8e4m3>(b).bits, i) << i;
  }
  ASSERT_EQ(from_float<f8e4m3>(1.0625f).bits, from_float<f8e4m3>(1.f).bits);  // tie to even: 1.0
  ASSERT_EQ(to_float(from_float<f8e4m3>(1.1875f)), 1.25f);                      // tie to even: 1.25
  ASSERT_EQ(to_float(from_float<f8e4m3>(1e6f)), 448.f);
  ASSERT_EQ(to_float(from_float<f8e4m3>(470.f)), 448.f);
  ASSERT_EQ(to_float(from_float<f8e4m3>(464.f)), 448.f);  // the tie rounds to even
  ASSERT_EQ(to_float(from_float<f8e4m3>(-1e6f)), -448.f);
  ASSERT_EQ(to_float(from_float<f8e5m2>(1.125f)), 1.f);                         // tie to even
  ASSERT_EQ(to_float(from_float<f8e5m2>(57344.f)), 57344.f);
}


// Random GGUF blocks of type t for an [n, k] weight: random codes and scale bytes,
// finite f16 scales (d > 0, min / dmin of either sign) where the format keeps them.
std::vector<uint8_t> random_gguf(int t, int64_t n, int64_t k, uint32_t seed) {
  const QFormat f = qformat(t);
  std::mt19937 g(seed);
  std::vector<uint8_t> raw(n * (k / f.block) * f.gguf_bytes);
  for (auto& b : raw) b = static_cast<uint8_t>(g());
  auto half = [&](bool negative) {
    return static_cast<uint16_t>((negative ? 0x8000u : 0u) | ((5u + g() % 8u) << 10) | (g() & 0x3ffu));
  };
  for (size_t off = 0; off < raw.size(); off += f.gguf_bytes) {
    uint16_t d = half(false), m = half(g() & 1u);
    const size_t at = t == int(QType::Q6_K) ? 208 : 0;
    std::memcpy(&raw[off + at], &d, 2);
    if (t == int(QType::Q4_1) || t == int(QType::Q5_1) || t == int(QType::Q4_K) || t == int(QType::Q5_K))
      std::memcpy(&raw[off + 2], &m, 2);
  }
  return raw;
}

// Every table, the scalar one included: qgemm equals the dense gemm on the weight that
// qrows dequantizes, bit for bit, at every M (decode and batch paths); and the tables agree.
TEST(Quantized, GemmEqualsDenseOnDequantizedWeightsEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  for (int t : {2, 3, 6, 7, 8, 12, 13, 14, 100}) {
    const int64_t n = 70, k = qformat(t).block == 256 ? 512 : 96;
    const auto raw = random_gguf(t, n, k, 100 + t);
    std::vector<float> w_ref;
    for (const KernelTable* tab : tables) {
      std::vector<uint8_t> packed(qpacked_bytes(t, n, k, tab->gemm_nr));
      tab->qpack(packed.data(), raw.data(), t, n, k);
      std::vector<int64_t> ids(n);
      for (int64_t i = 0; i < n; ++i) ids[i] = (i * 37) % n;
      std::vector<float> w(n * k), rows(n * k);
      tab->qrows(rows.data(), packed.data(), t, ids.data(), n, k);
      for (int64_t i = 0; i < n; ++i) std::memcpy(&w[ids[i] * k], &rows[i * k], k * sizeof(float));
      if (w_ref.empty()) w_ref = w;
      ASSERT_EQ(0, std::memcmp(w.data(), w_ref.data(), w.size() * 4)) << tab->isa << " type " << t;
      std::vector<float> dense(((n + tab->gemm_nr - 1) / tab->gemm_nr) * tab->gemm_nr * k);
      tab->pack_weight(dense.data(), w.data(), DType::F32, n, k);
      auto bias = randn(n, 7);
      for (int64_t m : {1, 2, 3, 7, 8, 9, 17, 33, 50}) {  // decode path: 8 rows a pass up to 32 (or 8)
        auto a = randn(m * k, 8 + m);
        std::vector<float> c1(m * n), c2(m * n);
        tab->qgemm(c1.data(), a.data(), packed.data(), t, bias.data(), m, n, k, k, n);
        tab->gemm(c2.data(), a.data(), dense.data(), DType::F32, bias.data(), m, n, k, k, n);
        ASSERT_EQ(0, std::memcmp(c1.data(), c2.data(), c1.size() * 4)) << tab->isa << " type " << t << " m " << m;
      }
    }
  }
}

// Every table: the gate/up GEMM on GGUF blocks fused with SiLU-and-mul equals qgemm() then
// silu_and_mul() bit for bit, on the decode path (8 rows a pass) and the batch path.
TEST(Quantized, GatedGemmEqualsQgemmThenSiluAndMulEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  for (int t : {3, 8, 12, 14}) {
    const int64_t f = 64, k = qformat(t).block == 256 ? 512 : 96;
    const auto raw = random_gguf(t, 2 * f, k, 200 + t);
    for (const KernelTable* tab : tables) {
      std::vector<uint8_t> packed(qpacked_bytes(t, 2 * f, k, tab->gemm_nr));
      tab->qpack(packed.data(), raw.data(), t, 2 * f, k);
      for (int64_t m : {1, 2, 3, 9, 33, 50}) {
        auto a = randn(m * k, 30 + m);
        std::vector<float> proj(m * 2 * f), want(m * f), got(m * f);
        tab->qgemm(proj.data(), a.data(), packed.data(), t, nullptr, m, 2 * f, k, k, 2 * f);
        tab->silu_and_mul(want.data(), proj.data(), m, f, 2 * f, f);
        tab->qgemm_silu(got.data(), a.data(), packed.data(), t, m, f, k, k, f);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << tab->isa << " type " << t << " m " << m;
      }
    }
  }
}

// Every table: the gate/up GEMM on int8 dot products fused with SiLU-and-mul equals qdgemm() then
// silu_and_mul() bit for bit (decode rows, batch rows, F a multiple of the panel width or not).
TEST(QuantizedInt8Dot, GatedGemmEqualsQdgemmThenSiluAndMulEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  for (int t : {3, 8, 12, 14}) {
    const int64_t k = qformat(t).block == 256 ? 512 : 96;
    for (int64_t f : {64, 40}) {
      const auto raw = random_gguf(t, 2 * f, k, 400 + t);
      for (const KernelTable* tab : tables) {
        std::vector<uint8_t> packed(tab->qdpacked_bytes(t, 2 * f, k));
        tab->qdpack(packed.data(), raw.data(), t, 2 * f, k);
        for (int64_t m : {1, 3, 4, 5, 9, 50}) {
          auto a = randn(m * k, 40 + m);
          if (m > 1) std::fill(a.begin(), a.begin() + k, 0.f);  // a row of zeros: zero sums, signed zeros
          std::vector<float> proj(m * 2 * f), want(m * f), got(m * f);
          tab->qdgemm(proj.data(), a.data(), packed.data(), t, nullptr, m, 2 * f, k, k, 2 * f);
          tab->silu_and_mul(want.data(), proj.data(), m, f, 2 * f, f);
          tab->qdgemm_silu(got.data(), a.data(), packed.data(), t, m, f, k, k, f);
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
              << tab->isa << " type " << t << " f " << f << " m " << m;
        }
      }
    }
  }
}

// The W8A8 product written out: per-token activation codes, exact integer sums, then floats.
std::vector<float> w8a8_reference(const std::vector<float>& a, const std::vector<int8_t>& w,
                                  const std::vector<float>& sw, const std::vector<float>& bias, int64_t m, int64_t n,
                                  int64_t k, bool asym) {
  std::vector<float> c(m * n);
  for (int64_t r = 0; r < m; ++r) {
    const float* x = &a[r * k];
    float lo = *std::min_element(x, x + k), hi = *std::max_element(x, x + k), amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
    float s = asym ? (hi - lo) / 254.f : amax / 127.f;
    if (s == 0.f) s = 1.f;
    const int32_t z = asym ? int32_t(std::nearbyint(-127.f - lo / s)) : 0;
    std::vector<int32_t> q(k);
    for (int64_t i = 0; i < k; ++i)
      q[i] = int32_t(std::clamp(std::nearbyint(x[i] / s) + float(z), -127.f, 127.f));
    for (int64_t j = 0; j < n; ++j) {
      int64_t acc = 0;
      for (int64_t i = 0; i < k; ++i) acc += int64_t(q[i] - z) * w[j * k + i];
      c[r * n + j] = float(int32_t(acc)) * (s * sw[j]) + bias[j];
    }
  }
  return c;
}

// Every table, the scalar one included, against the reference: exact integer sums, so the
// same bits everywhere, for both activation modes, odd K and N, decode and batch shapes, the
// extreme codes (-128 weights, saturated activations) and a row of zeros.
TEST(Int8, W8A8GemmEqualsReferenceEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const int64_t n = 70, k = 97;
  std::mt19937 g(5);
  std::vector<int8_t> w(n * k);
  for (auto& v : w) v = int8_t(int(g() % 256) - 128);
  for (int64_t i = 0; i < k; ++i) w[i] = -128;  // a whole column at the extreme
  auto sw = randn(n, 11, 0.01f), bias = randn(n, 12);
  for (auto& v : sw) v = std::fabs(v) + 1e-4f;
  for (bool asym : {false, true})
    for (int64_t m : {1, 2, 3, 5, 50, 300}) {
      auto a = randn(m * k, 20 + m, 3.f);
      if (m > 2) std::fill(a.begin() + k, a.begin() + 2 * k, 0.f);  // a zero row
      if (asym) for (auto& v : a) v += 0.7f;
      const auto ref = w8a8_reference(a, w, sw, bias, m, n, k, asym);
      for (const KernelTable* tab : tables) {
        std::vector<uint8_t> packed(tab->i8packed_bytes(n, k));
        tab->i8pack(packed.data(), w.data(), sw.data(), n, k);
        std::vector<float> c(m * (n + 3), -1.f);
        tab->i8gemm(c.data(), a.data(), packed.data(), bias.data(), m, n, k, k, n + 3, asym);
        for (int64_t r = 0; r < m; ++r)
          ASSERT_EQ(0, std::memcmp(&c[r * (n + 3)], &ref[r * n], n * 4))
              << tab->isa << " m " << m << " row " << r << " asym " << asym;
      }
    }
}

// The fused W8A8 gate/up (i8gemm_silu) is i8gemm then silu_and_mul, bit for bit, on every table,
// for both activation modes, decode and batch row counts (the one-pass pair and the two-pass
// tiles), F a multiple of the panel width and not (the projection-buffer fallback), a zero row.
TEST(Int8, GatedGemmEqualsI8gemmThenSiluAndMulEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const int64_t k = 97;
  for (int64_t f : {128, 70}) {
    std::mt19937 g(7 + f);
    std::vector<int8_t> w(2 * f * k);
    for (auto& v : w) v = int8_t(int(g() % 256) - 128);
    auto sw = randn(2 * f, 13, 0.01f);
    for (auto& v : sw) v = std::fabs(v) + 1e-4f;
    for (const KernelTable* tab : tables) {
      std::vector<uint8_t> packed(tab->i8packed_bytes(2 * f, k));
      tab->i8pack(packed.data(), w.data(), sw.data(), 2 * f, k);
      for (bool asym : {false, true})
        for (int64_t m : {1, 2, 3, 4, 5, 9, 50, 300}) {
          auto a = randn(m * k, 60 + m);
          if (m > 1) std::fill(a.begin(), a.begin() + k, 0.f);
          std::vector<float> proj(m * 2 * f), want(m * f), got(m * f);
          tab->i8gemm(proj.data(), a.data(), packed.data(), nullptr, m, 2 * f, k, k, 2 * f, asym);
          tab->silu_and_mul(want.data(), proj.data(), m, f, 2 * f, f);
          tab->i8gemm_silu(got.data(), a.data(), packed.data(), m, f, k, k, f, asym);
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
              << tab->isa << " f " << f << " m " << m << " asym " << asym;
        }
    }
  }
}

// The int8-dot GGUF GEMM written out in double: activations quantized per group of G, then
// sum_g sa * sum_k qa * W with W the float path's dequantized weight (qrows).
void qdot_reference(const std::vector<float>& a, const std::vector<float>& w, int64_t m, int64_t n, int64_t k, int G,
                    std::vector<double>& c, std::vector<double>& mag) {
  c.assign(m * n, 0.0);
  mag.assign(m * n, 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / G; ++g) {
      const float* x = &a[r * k + g * G];
      float amax = 0.f;
      for (int i = 0; i < G; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      for (int i = 0; i < G; ++i) {
        const double xq = double(s) * std::clamp(std::nearbyint(x[i] / s), -127.f, 127.f);
        for (int64_t j = 0; j < n; ++j) {
          c[r * n + j] += xq * w[j * k + g * G + i];
          mag[r * n + j] += std::fabs(xq * w[j * k + g * G + i]);
        }
      }
    }
}

// Every table, the scalar one included: qdrows gives the float path's weights bit for bit;
// qdgemm gives the same bits on every table and at every M (a row alone equals that row in a
// batch), within float rounding of the written-out reference.
TEST(QuantizedInt8Dot, GemmEqualsReferenceEveryTableAndBatchInvariant) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  for (int t : {2, 3, 6, 7, 8, 12, 13, 14, 100}) {
    const QFormat f = qformat(t);
    const int64_t n = 70, k = f.block == 256 ? 512 : 96;
    const auto raw = random_gguf(t, n, k, 300 + t);
    std::vector<float> w(n * k);
    {
      const KernelTable* s = table_scalar();
      std::vector<uint8_t> packed(qpacked_bytes(t, n, k, s->gemm_nr));
      s->qpack(packed.data(), raw.data(), t, n, k);
      std::vector<int64_t> ids(n);
      for (int64_t i = 0; i < n; ++i) ids[i] = i;
      s->qrows(w.data(), packed.data(), t, ids.data(), n, k);
    }
    auto bias = randn(n, 9);
    std::map<int64_t, std::vector<float>> first;  // per M, the first table's output
    for (const KernelTable* tab : tables) {
      std::vector<uint8_t> packed(tab->qdpacked_bytes(t, n, k));
      tab->qdpack(packed.data(), raw.data(), t, n, k);
      std::vector<int64_t> ids(n);
      for (int64_t i = 0; i < n; ++i) ids[i] = (i * 37) % n;
      std::vector<float> rows(n * k);
      tab->qdrows(rows.data(), packed.data(), t, ids.data(), n, k);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(0, std::memcmp(&rows[i * k], &w[ids[i] * k], k * 4)) << tab->isa << " type " << t << " row " << i;
      for (int64_t m : {1, 2, 3, 4, 5, 50}) {
        auto a = randn(m * k, 40 + m, 2.f);
        if (m > 2) std::fill(a.begin() + k, a.begin() + 2 * k, 0.f);  // a zero row
        std::vector<float> c(m * (n + 3), -1.f);
        tab->qdgemm(c.data(), a.data(), packed.data(), t, bias.data(), m, n, k, k, n + 3);
        std::vector<double> ref, mag;
        qdot_reference(a, w, m, n, k, f.group, ref, mag);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j)
            ASSERT_NEAR(c[r * (n + 3) + j], ref[r * n + j] + bias[j], 1e-5 * (mag[r * n + j] + std::fabs(bias[j])) + 1e-6)
                << tab->isa << " type " << t << " m " << m << " at " << r << ", " << j;
        if (first.count(m) == 0) first[m] = c;
        ASSERT_EQ(0, std::memcmp(c.data(), first[m].data(), c.size() * 4)) << tab->isa << " type " << t << " m " << m;
        if (m == 50)
          for (int64_t r : {0, 7, 49}) {
            std::vector<float> one(n);
            tab->qdgemm(one.data(), &a[r * k], packed.data(), t, bias.data(), 1, n, k, k, n);
            ASSERT_EQ(0, std::memcmp(one.data(), &c[r * (n + 3)], n * 4)) << tab->isa << " type " << t << " row " << r;
          }
      }
    }
    ASSERT_EQ(tables.back()->qdpacked_bytes(t, n, k + 16), -1);  // K not whole blocks
  }
}

// The quantized and int8 GEMMs (plain and gated) hand out panels in self-balancing shares as the
// float GEMMs do: 1, 2, 3 or 5 threads give the same bits, on decode rows (1 and 2; 16 too, in two
// 8-row passes, where the table has 32 vector registers) and batch rows (one row tile, several,
// more than one 256-row int8 block).
TEST(Quantized, SameBitsAnyThreadCountEveryTable) {
  std::vector<const KernelTable*> tables = vector_tables();
  tables.push_back(table_scalar());
  const int before = omp_get_max_threads();
  const int t = 3;  // Q4_1, the default model's type
  const int64_t f = 192, k = 128;
  const auto raw = random_gguf(t, 2 * f, k, 500);
  std::mt19937 g(501);
  std::vector<int8_t> w8(2 * f * k);
  for (auto& v : w8) v = int8_t(int(g() % 256) - 128);
  auto sw = randn(2 * f, 502, 0.01f), bias = randn(2 * f, 503);
  for (auto& v : sw) v = std::fabs(v) + 1e-4f;
  for (const KernelTable* tab : tables) {
    std::vector<uint8_t> q(qpacked_bytes(t, 2 * f, k, tab->gemm_nr)), qd(tab->qdpacked_bytes(t, 2 * f, k)),
        i8(tab->i8packed_bytes(2 * f, k));
    tab->qpack(q.data(), raw.data(), t, 2 * f, k);
    tab->qdpack(qd.data(), raw.data(), t, 2 * f, k);
    tab->i8pack(i8.data(), w8.data(), sw.data(), 2 * f, k);
    for (int64_t m : {1, 2, 16, 64, 300}) {
      auto a = randn(m * k, 510 + m);
      std::vector<std::vector<float>> want;
      for (int threads : {1, 2, 3, 5}) {
        omp_set_num_threads(threads);
        std::vector<std::vector<float>> got(6, std::vector<float>(m * 2 * f));
        tab->qgemm(got[0].data(), a.data(), q.data(), t, bias.data(), m, 2 * f, k, k, 2 * f);
        tab->qgemm_silu(got[1].data(), a.data(), q.data(), t, m, f, k, k, f);
        tab->qdgemm(got[2].data(), a.data(), qd.data(), t, bias.data(), m, 2 * f, k, k, 2 * f);
        tab->qdgemm_silu(got[3].data(), a.data(), qd.data(), t, m, f, k, k, f);
        tab->i8gemm(got[4].data(), a.data(), i8.data(), bias.data(), m, 2 * f, k, k, 2 * f, false);
        tab->i8gemm_silu(got[5].data(), a.data(), i8.data(), m, f, k, k, f, true);
        if (want.empty()) {
          want = got;
          continue;
        }
        for (int i = 0; i < 6; ++i)
          ASSERT_EQ(0, std::memcmp(got[i].data(), want[i].data(), got[i].size() * 4))
              << tab->isa << " kernel " << i << " m " << m << " threads " << threads;
      }
    }
  }
  omp_set_num_threads(before);
}

std::string name_of(const ::testing::TestParamInfo<const KernelTable*>& info) { return info.param->isa; }

}  // namespace

INSTANTIATE_TEST_SUITE_P(Isa, VectorVsScalar, ::testing::ValuesIn(vector_tables()), name_of);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(VectorVsScalar);
