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
inline int64_t find_cell(const double* levels, int64_t num_levels, double r) {
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

template <typename scalar_t>
void encode_codes(const scalar_t* x, int64_t n, int64_t d, const float* norms, const double* levels,
                  int64_t num_levels, int64_t bits, uint64_t seed, uint8_t* out) {
  const int64_t groups = (n + 7) / 8;
  const int64_t total_bytes = (n * bits + 7) / 8;
  const uint64_t key = splitmix64(seed);  // element i draws splitmix64(key + i)
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    int64_t bucket = g0 * 8 / d, bucket_end = std::min(n, (bucket + 1) * d);
    double inv = 0.0;
    bool live = false;  // bucket has a positive finite norm
    auto enter = [&]() {
      const float norm = norms[bucket];
      live = norm > 0.0f;  // zero or NaN norm: code 0, decodes to 0 or NaN
      inv = live ? 1.0 / static_cast<double>(norm) : 0.0;
    };
    enter();
    for (int64_t g = g0; g < g1; ++g) {
      uint64_t word = 0;
      const int64_t i0 = g * 8, i1 = std::min(n, i0 + 8);
      for (int64_t i = i0; i < i1; ++i) {
        if (i == bucket_end) {
          ++bucket;
          bucket_end = std::min(n, bucket_end + d);
          enter();
        }
        if (!live) continue;
        double r = static_cast<double>(x[i]) * inv;
        r = r < -1.0 ? -1.0 : (r > 1.0 ? 1.0 : r);
        const int64_t lo = find_cell(levels, num_levels, r);
        const double p = (r - levels[lo]) / (levels[lo + 1] - levels[lo]);
        const double u = static_cast<double>(splitmix64(key + static_cast<uint64_t>(i)) >> 11) * 0x1.0p-53;
        word |= static_cast<uint64_t>(lo + (u < p ? 1 : 0)) << ((i - i0) * bits);
      }
      const int64_t offset = g * bits;
      std::memcpy(out + offset, &word, std::min<int64_t>(bits, total_bytes - offset));
    }
  });
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "encode", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    bucket_norms<scalar_t>(px, n, bucket_size, linf, norms.data());
    encode_codes<scalar_t>(px, n, bucket_size, norms.data(), lv.data_ptr<double>(), lv.numel(), bits,
                           static_cast<uint64_t>(seed), base + kHeaderBytes + 4 * nb);
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
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  const float fscale = static_cast<float>(scale);
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
        std::memcpy(&word, codes + g * bits, std::min<int64_t>(bits, code_bytes - g * bits));
        for (int64_t i = i0; i < i1; ++i) {
          if (i == bucket_end) {
            ++bucket;
            bucket_end = std::min(n, bucket_end + d);
            std::memcpy(&norm, norms + 4 * bucket, 4);
          }
          const float value = norm * table[(word >> ((i - i0) * bits)) & mask];
          po[i] = p == 0 ? value : po[i] + value;
        }
      }
    }
    if (offsets.empty()) std::fill(po + first, po + last, 0.0f);
    for (int64_t i = first; i < last; ++i) po[i] *= fscale;
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "Encode a 1-D float CPU tensor into a horovod-alq payload");
  m.def("decode_sum", &decode_sum, "Decode payloads, sum them and scale, into a float32 tensor");
}
