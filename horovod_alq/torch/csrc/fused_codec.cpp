// Fused CPU kernels for the horovod-alq wire format (docs/design.md).
//
// encode: bucket norms, unbiased stochastic rounding and b-bit packing in two passes over the
// input; decode_sum: unpack every rank's payload, scale by its norms and sum, in one pass.
// Randomness is counter-based (SplitMix64 of a seed-derived key plus the element index), so results do not depend
// on the number of threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kHeaderBytes = 32;
constexpr int64_t kGrain = 1 << 12;  // groups of 8 coordinates per parallel task

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

template <typename scalar_t>
void bucket_norms(const scalar_t* x, int64_t n, int64_t d, bool linf, float* norms) {
  const int64_t nb = (n + d - 1) / d;
  at::parallel_for(0, nb, std::max<int64_t>(1, kGrain * 8 / d), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t s = b * d, e = std::min(n, s + d);
      double acc[4] = {0.0, 0.0, 0.0, 0.0};  // four chains: no serial dependency per element
      bool nan_seen = false;
      int64_t i = s;
      if (linf) {
        for (; i < e; ++i) {
          const double v = std::fabs(static_cast<double>(x[i]));
          nan_seen |= (v != v);
          acc[0] = v > acc[0] ? v : acc[0];
        }
      } else {
        for (; i + 4 <= e; i += 4)
          for (int k = 0; k < 4; ++k) {
            const double v = static_cast<double>(x[i + k]);
            acc[k] += v * v;
          }
        for (; i < e; ++i) {
          const double v = static_cast<double>(x[i]);
          acc[0] += v * v;
        }
        acc[0] = std::sqrt((acc[0] + acc[1]) + (acc[2] + acc[3]));
      }
      const float norm = static_cast<float>(acc[0]);
      norms[b] = (nan_seen || !std::isfinite(norm)) ? std::numeric_limits<float>::quiet_NaN() : norm;
    }
  });
}

// Index of the cell [levels[j], levels[j+1]] holding r: branch-free count for few levels.
inline int64_t find_cell(const float* levels, int64_t num_levels, float r) {
  if (num_levels <= 16) {
    int64_t cell = 0;
    for (int64_t j = 1; j < num_levels - 1; ++j) cell += (levels[j] <= r);
    return cell;
  }
  int64_t lo = 0, hi = num_levels - 1;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (levels[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

// Uniforms for coordinates i (even) and i + 1: 23 bits each of one splitmix64 draw, as
// (2k + 1) / 2^24 (exact in float), so P(u < p) is p rounded to the nearest 2^-23: no bias.
inline void uniform_pair(uint64_t key, int64_t i, float* u) {
  const uint64_t h = splitmix64(key + static_cast<uint64_t>(i >> 1));
  u[0] = static_cast<float>(2 * ((h >> 41) & 0x7FFFFF) + 1) * 0x1.0p-24f;
  u[1] = static_cast<float>(2 * ((h >> 9) & 0x7FFFFF) + 1) * 0x1.0p-24f;
}

inline float uniform_at(uint64_t key, int64_t i) {
  float u[2];
  uniform_pair(key, i & ~int64_t{1}, u);
  return u[i & 1];
}

inline float clamp_unit(float r) { return r < -1.0f ? -1.0f : (r > 1.0f ? 1.0f : r); }

// Code of r: its cell, plus one with probability (r - lo) / (hi - lo), drawn as u * (hi - lo) < r - lo.
inline uint64_t stochastic_code(float r, float u, const float* levels, const float* widths, int64_t num_levels) {
  const int64_t lo = find_cell(levels, num_levels, r);
  return static_cast<uint64_t>(lo + (u * widths[lo] < r - levels[lo] ? 1 : 0));
}

constexpr int64_t kChunk = 64;  // coordinates per vectorizable block (8 groups of 8)

constexpr int64_t kMaxVectorLevels = 16;  // encode_chunk serves bits <= 4

// kChunk coordinates of one live bucket: straight-line loops the compiler vectorizes (the level
// search is a select over 2^BITS levels, at least 8, padded with +inf, instead of a table lookup;
// GCC does not vectorize the 4-level loop of 2 bits).
template <int BITS, typename scalar_t>
void encode_chunk(const scalar_t* x, int64_t i0, float inv, const float* levels, const float* widths,
                  uint64_t key, uint8_t* codes) {
  constexpr int64_t num_levels = BITS < 3 ? 8 : int64_t{1} << BITS;
  static_assert(num_levels <= kMaxVectorLevels, "encode_chunk: bits <= 4 only");
  float lv[num_levels], wd[num_levels];  // local copies: lets the compiler vectorize the search
  std::memcpy(lv, levels, sizeof lv);
  std::memcpy(wd, widths, sizeof wd);
  float r[kChunk], u[kChunk];
  uint32_t code[kChunk];
  for (int64_t k = 0; k < kChunk; k += 2) uniform_pair(key, i0 + k, u + k);
  for (int64_t k = 0; k < kChunk; ++k) r[k] = clamp_unit(static_cast<float>(x[i0 + k]) * inv);
  for (int64_t k = 0; k < kChunk; ++k) {
    float lo = lv[0], width = wd[0];
    uint32_t cell = 0;
    for (int64_t j = 1; j < num_levels - 1; ++j) {
      const bool ge = lv[j] <= r[k];
      lo = ge ? lv[j] : lo;
      width = ge ? wd[j] : width;
      cell += ge;
    }
    code[k] = cell + (u[k] * width < r[k] - lo ? 1u : 0u);
  }
  for (int64_t q = 0; q < kChunk / 8; ++q) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= static_cast<uint64_t>(code[8 * q + k]) << (k * BITS);
    std::memcpy(codes + q * BITS, &word, BITS);
  }
}

template <int BITS, typename scalar_t>
void encode_codes(const scalar_t* x, int64_t n, int64_t d, const float* norms, const float* levels,
                  int64_t num_levels, uint64_t seed, uint8_t* out) {
  const int64_t groups = (n + 7) / 8;
  const int64_t total_bytes = (n * BITS + 7) / 8;
  const uint64_t key = splitmix64(seed);  // coordinates 2j and 2j + 1 draw from splitmix64(key + j)
  std::vector<float> widths(num_levels - 1);
  for (int64_t j = 0; j + 1 < num_levels; ++j) widths[j] = levels[j + 1] - levels[j];
  const float* w = widths.data();
  // levels for encode_chunk: the top level with width 0, then +inf (never selected)
  float padded_levels[kMaxVectorLevels], padded_widths[kMaxVectorLevels];
  for (int64_t j = 0; j < kMaxVectorLevels; ++j) {
    padded_levels[j] = j < num_levels ? levels[j] : std::numeric_limits<float>::infinity();
    padded_widths[j] = j + 1 < num_levels ? widths[j] : 0.0f;
  }
  const bool vectorizable = num_levels <= kMaxVectorLevels;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    int64_t bucket = g0 * 8 / d, bucket_end = std::min(n, (bucket + 1) * d);
    float inv = 0.0f;
    bool live = false;  // bucket has a positive finite norm
    auto enter = [&]() {
      const float norm = norms[bucket];
      live = norm > 0.0f;  // zero or NaN norm: code 0, decodes to 0 or NaN
      inv = live ? 1.0f / norm : 0.0f;
    };
    enter();
    int64_t g = g0;
    while (g < g1) {
      const int64_t i0 = g * 8;
      while (i0 >= bucket_end) {
        ++bucket;
        bucket_end = std::min(n, bucket_end + d);
        enter();
      }
      if constexpr (BITS <= 4) {
        if (vectorizable && g + kChunk / 8 <= g1 && i0 + kChunk <= bucket_end) {
          if (live) {
            encode_chunk<BITS>(x, i0, inv, padded_levels, padded_widths, key, out + g * BITS);
          } else {
            std::memset(out + g * BITS, 0, kChunk / 8 * BITS);
          }
          g += kChunk / 8;
          continue;
        }
      }
      uint64_t word = 0;  // one group, coordinate by coordinate (bucket edges, many levels, tails)
      const int64_t i1 = std::min(n, i0 + 8);
      for (int64_t i = i0; i < i1; ++i) {
        if (i == bucket_end) {
          ++bucket;
          bucket_end = std::min(n, bucket_end + d);
          enter();
        }
        if (live) {
          const float r = clamp_unit(static_cast<float>(x[i]) * inv);
          word |= stochastic_code(r, uniform_at(key, i), levels, w, num_levels) << ((i - i0) * BITS);
        }
      }
      const int64_t offset = g * BITS;
      std::memcpy(out + offset, &word, std::min<int64_t>(BITS, total_bytes - offset));
      ++g;
    }
  });
}

// Sum over payloads of norm * table[code], times scale, into out (first payload assigns).
template <int BITS>
void decode_sum_codes(float* po, int64_t n, int64_t d, const uint8_t* base, const std::vector<int64_t>& offsets,
                      const float* table, float fscale) {
  constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
  const int64_t nb = (n + d - 1) / d;
  const int64_t code_bytes = (n * BITS + 7) / 8;
  const int64_t groups = (n + 7) / 8;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    const int64_t first = g0 * 8, last = std::min(n, g1 * 8);
    for (size_t p = 0; p < offsets.size(); ++p) {  // payload by payload over this chunk (in cache)
      const uint8_t* norms = base + offsets[p] + kHeaderBytes;
      const uint8_t* codes = norms + 4 * nb;
      int64_t bucket = first / d, bucket_end = std::min(n, (bucket + 1) * d);
      float norm;
      std::memcpy(&norm, norms + 4 * bucket, 4);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t i0 = g * 8, i1 = std::min(n, i0 + 8);
        uint64_t word = 0;
        std::memcpy(&word, codes + g * BITS, std::min<int64_t>(BITS, code_bytes - g * BITS));
        if (i1 - i0 == 8 && i1 <= bucket_end) {  // whole group in one bucket: unrolled
          float* o = po + i0;
          if (p == 0) {
            for (int k = 0; k < 8; ++k) o[k] = norm * table[(word >> (k * BITS)) & mask];
          } else {
            for (int k = 0; k < 8; ++k) o[k] += norm * table[(word >> (k * BITS)) & mask];
          }
          if (i1 == bucket_end && i1 < n) {
            ++bucket;
            bucket_end = std::min(n, bucket_end + d);
            std::memcpy(&norm, norms + 4 * bucket, 4);
          }
          continue;
        }
        for (int64_t i = i0; i < i1; ++i) {
          if (i == bucket_end) {
            ++bucket;
            bucket_end = std::min(n, bucket_end + d);
            std::memcpy(&norm, norms + 4 * bucket, 4);
          }
          const float value = norm * table[(word >> ((i - i0) * BITS)) & mask];
          po[i] = p == 0 ? value : po[i] + value;
        }
      }
    }
    if (offsets.empty()) std::fill(po + first, po + last, 0.0f);
    for (int64_t i = first; i < last; ++i) po[i] *= fscale;
  });
}

// Calls f with std::integral_constant<int, bits> for bits in 2..8.
template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "bits must be 2..8, got ", bits);
  }
}

}  // namespace

// x: contiguous 1-D float tensor on the CPU. Returns the whole payload (header, norms, codes).
torch::Tensor encode(torch::Tensor x, torch::Tensor levels, torch::Tensor header, int64_t bits,
                     int64_t bucket_size, bool linf, int64_t seed) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), "encode: x must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(bits >= 2 && bits <= 8, "encode: bits must be 2..8");
  TORCH_CHECK(bucket_size > 0, "encode: bucket_size must be positive");
  auto lv = levels.to(torch::kFloat64).contiguous();
  TORCH_CHECK(lv.numel() >= 2 && lv.numel() <= (1 << bits), "encode: bad number of levels");
  TORCH_CHECK(header.numel() == kHeaderBytes && header.scalar_type() == torch::kUInt8, "encode: header must be 32 uint8");
  const int64_t n = x.numel();
  const int64_t nb = (n + bucket_size - 1) / bucket_size;
  const int64_t code_bytes = (n * bits + 7) / 8;
  auto out = torch::empty({kHeaderBytes + 4 * nb + code_bytes}, torch::kUInt8);
  uint8_t* base = out.data_ptr<uint8_t>();
  std::memcpy(base, header.contiguous().data_ptr<uint8_t>(), kHeaderBytes);
  std::vector<float> norms(nb);
  auto lf = lv.to(torch::kFloat32).contiguous();  // the decoder's table: encode against the same values
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "encode", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    bucket_norms<scalar_t>(px, n, bucket_size, linf, norms.data());
    dispatch_bits(bits, [&](auto b) {
      encode_codes<decltype(b)::value, scalar_t>(px, n, bucket_size, norms.data(), lf.data_ptr<float>(), lf.numel(),
                                                 static_cast<uint64_t>(seed), base + kHeaderBytes + 4 * nb);
    });
  });
  if (nb) std::memcpy(base + kHeaderBytes, norms.data(), 4 * nb);
  return out;
}

// Sum of the decoded values of payloads (already validated) at the given byte offsets of
// `payloads`, times `scale`, written into the float32 tensor `out` of n elements.
torch::Tensor decode_sum(torch::Tensor out, torch::Tensor payloads, std::vector<int64_t> offsets,
                         torch::Tensor levels, int64_t bits, int64_t bucket_size, double scale) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kFloat32 && out.is_contiguous(), "decode_sum: out must be contiguous float32 on the CPU");
  TORCH_CHECK(payloads.scalar_type() == torch::kUInt8 && payloads.is_contiguous(), "decode_sum: payloads must be contiguous uint8");
  const int64_t n = out.numel();
  const int64_t d = bucket_size;
  const int64_t nb = (n + d - 1) / d;
  const int64_t code_bytes = (n * bits + 7) / 8;
  for (int64_t off : offsets)
    TORCH_CHECK(off >= 0 && off + kHeaderBytes + 4 * nb + code_bytes <= payloads.numel(), "decode_sum: payload out of range");
  // 2**bits entries: codes past the last level (only a corrupted payload has them) decode to NaN.
  std::vector<float> table(size_t{1} << bits, std::numeric_limits<float>::quiet_NaN());
  auto lv = levels.to(torch::kFloat32).contiguous();
  TORCH_CHECK(lv.numel() <= (int64_t{1} << bits), "decode_sum: more levels than codes");
  std::memcpy(table.data(), lv.data_ptr<float>(), 4 * lv.numel());
  const uint8_t* base = payloads.data_ptr<uint8_t>();
  float* po = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  dispatch_bits(bits, [&](auto b) {
    decode_sum_codes<decltype(b)::value>(po, n, d, base, offsets, table.data(), fscale);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "Encode a 1-D float CPU tensor into a horovod-alq payload");
  m.def("decode_sum", &decode_sum, "Decode payloads, sum them and scale, into a float32 tensor");
}
