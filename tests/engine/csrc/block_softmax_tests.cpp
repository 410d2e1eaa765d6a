// block_softmax.hpp's step (attention's softmax on every AVX-512 table and on AVX2), compiled as
// the avx512_bf16 table is, and again as the avx2 one is, and inlined here: a row's max and sum,
// and so its probabilities, do not depend on how many rows share its step (the transposed
// reduction or the rows one at a time: AVX-512 takes the first for more than 4 rows, AVX2 for more
// than 3 of a half of 8) nor on which rows those are; the step against a float64 softmax, keys far
// below a row's max among them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/block_softmax.hpp"

using namespace cpuserve;

namespace {

#ifdef __AVX512F__
bool have_isa() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"); }
constexpr const char* kNoIsa = "this CPU has no AVX-512 BF16";
#else
bool have_isa() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
constexpr const char* kNoIsa = "this CPU has no AVX2 and FMA";
#endif

// 16 rows of scores, row r with n[r] keys, every block's step of one call.
struct Block {
  std::vector<std::vector<float>> u;
  std::vector<int64_t> n;
  Block(uint32_t seed, int64_t keys) : u(16), n(16) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> score(-8.f, 8.f);
    std::uniform_int_distribution<int64_t> len(1, keys);
    for (int r = 0; r < 16; ++r) {
      n[r] = len(rng);
      u[r].resize(static_cast<size_t>(keys));
      for (float& x : u[r]) x = score(rng);
    }
  }
};

// Rows [r0, r0 + mr) of b through one step from a fresh state; m, l and the probabilities.
struct Out {
  std::vector<float> m, l;
  std::vector<std::vector<float>> p;
};
Out run(Block b, int r0, int mr, float scale) {
  block_softmax::Rows16<float> rows{};
  Out o{std::vector<float>(16, -INFINITY), std::vector<float>(16, 0.f), b.u};
  for (int r = 0; r < mr; ++r) {
    rows.u[r] = b.u[r0 + r].data();
    rows.p[r] = o.p[r0 + r].data();
    rows.n[r] = b.n[r0 + r];
  }
  float alpha[16];
  block_softmax::step(rows, mr, scale, 0.f, o.m.data() + r0, o.l.data() + r0, alpha);
  return o;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

TEST(BlockSoftmax, ARowsBitsDoNotDependOnItsCompany) {
  if (!have_isa()) GTEST_SKIP() << kNoIsa;
  for (uint32_t seed = 0; seed < 200; ++seed) {
    const Block b(seed, 1 + seed % 300);
    const Out all = run(b, 0, 16, 0.125f);
    for (int mr : {1, 2, 3, 4, 5, 7, 9, 11, 12, 16}) {
      for (int r0 = 0; r0 + mr <= 16; r0 += mr) {
        const Out part = run(b, r0, mr, 0.125f);
        for (int r = r0; r < r0 + mr; ++r) {
          ASSERT_TRUE(same_bits(part.m[r], all.m[r])) << "seed " << seed << " rows " << mr << " row " << r;
          ASSERT_TRUE(same_bits(part.l[r], all.l[r])) << "seed " << seed << " rows " << mr << " row " << r;
          for (int64_t j = 0; j < b.n[r]; ++j) ASSERT_TRUE(same_bits(part.p[r][j], all.p[r][j]));
        }
      }
    }
  }
}

TEST(BlockSoftmax, MatchesAFloat64Softmax) {
  if (!have_isa()) GTEST_SKIP() << kNoIsa;
  const float scale = 0.125f;
  for (uint32_t seed = 0; seed < 50; ++seed) {
    const Block b(seed, 200);
    for (int mr : {3, 16}) {
      const Out o = run(b, 0, mr, scale);
      for (int r = 0; r < mr; ++r) {
        double mx = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < b.n[r]; ++j) mx = std::max(mx, static_cast<double>(b.u[r][j]) * scale);
        for (int64_t j = 0; j < b.n[r]; ++j) sum += std::exp(static_cast<double>(b.u[r][j]) * scale - mx);
        // m in base 2: the max scaled by log2(e)
        EXPECT_NEAR(o.m[r], mx * 1.4426950408889634, 1e-5 * std::max(1.0, std::fabs(mx)));
        EXPECT_NEAR(o.l[r], sum, 1e-5 * sum);
        for (int64_t j = 0; j < b.n[r]; ++j) {
          const double want = std::exp(static_cast<double>(b.u[r][j]) * scale - mx);
          ASSERT_NEAR(o.p[r][j], want, 1e-6 + 1e-6 * want) << "seed " << seed << " row " << r << " key " << j;
        }
      }
    }
  }
}

// Keys whose exp underflows: probability 0 or the float nearest it (a subnormal on AVX-512, 0 on
// AVX2 below 2^-126.5), never a NaN or garbage from the exponent's bits; the sum untouched by them.
TEST(BlockSoftmax, KeysFarBelowTheMaxVanish) {
  if (!have_isa()) GTEST_SKIP() << kNoIsa;
  std::vector<float> u = {0.f, -20.f, -60.f, -87.f, -88.5f, -89.f, -95.f, -200.f, -1e6f, -1e30f, -1.f};
  const float ln2 = 0.6931471805599453f;
  for (float s : {-126.4f, -126.6f, -127.f, -127.5f, -149.f, -150.f}) u.push_back(s * ln2);
  const int64_t n = static_cast<int64_t>(u.size());
  std::vector<float> p(u.size());
  block_softmax::Rows16<float> rows{};
  rows.u[0] = u.data();
  rows.p[0] = p.data();
  rows.n[0] = n;
  float m = -INFINITY, l = 0.f, alpha;
  block_softmax::step(rows, 1, 1.f, 0.f, &m, &l, &alpha);
  EXPECT_EQ(m, 0.f);
  EXPECT_NEAR(l, 1.0 + std::exp(-1.0) + std::exp(-20.0), 1e-6);
  for (int64_t j = 0; j < n; ++j) {
    const double want = std::exp(static_cast<double>(u[j]));
    ASSERT_FALSE(std::isnan(p[j])) << "key " << j;
    ASSERT_GE(p[j], 0.f) << "key " << j;
    // (log2(e) and t = u * log2(e) each round in float: an error in t of about |t| 6e-8)
    ASSERT_NEAR(p[j], want, 2e-7 * (1.0 - u[j]) * want + 1e-37) << "key " << j << " score " << u[j];
  }
}

}  // namespace
