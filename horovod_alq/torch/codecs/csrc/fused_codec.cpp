// Fused CPU kernels for the horovod-alq wire format (docs/design/design.md).
//
// encode: bucket norms, unbiased stochastic rounding and b-bit packing, bucket by bucket;
// encode_parts: the same for a fused stream of tensors, read where they lie (no stream copy);
// encode_feedback: the encode of x plus an error buffer, the buffer updated in the same pass;
// decode_sum: unpack every rank's payload (or a window of it), scale by its norms and sum, in one
// pass, straight into the output.
// Preconditioned quantization (docs/design/design.md): the encodes take an optional float32 scale w
// and quantize x * w, formed bucket by bucket in cache (never written to memory); decode_sum an
// optional divisor, applied in the same pass.
// Randomness is counter-based (a hash of a seed-derived key and the element index), so results
// do not depend on the number of threads. The kernels (codec_kernels.h) are compiled twice, for
// the default instruction set and for AVX2, and the CPU picks one at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#define HOROVOD_ALQ_X86 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kHeaderBytes = 32;

namespace generic {
#include "codec_kernels.h"
}  // namespace generic

#ifdef HOROVOD_ALQ_X86
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
#define HOROVOD_ALQ_AVX2 1
#include "codec_kernels.h"
#undef HOROVOD_ALQ_AVX2
}  // namespace avx2
#pragma GCC pop_options

bool cpu_has_avx2() { return __builtin_cpu_supports("avx2"); }
#else
namespace avx2 = generic;  // other architectures: the generic kernels only
bool cpu_has_avx2() { return false; }
#endif

// AVX2 when the CPU has it and HOROVOD_ALQ_SIMD is not 0 (set_simd overrides, for tests).
bool use_avx2 = cpu_has_avx2() && !(std::getenv("HOROVOD_ALQ_SIMD") &&
                                    std::strcmp(std::getenv("HOROVOD_ALQ_SIMD"), "0") == 0);

}  // namespace

namespace {

// A payload of n coordinates with its header copied in; returns (payload, its norms, its codes).
std::tuple<torch::Tensor, float*, uint8_t*> new_payload(int64_t n, int64_t bits, int64_t bucket_size,
                                                        const torch::Tensor& header) {
  TORCH_CHECK(header.numel() == kHeaderBytes && header.scalar_type() == torch::kUInt8, "encode: header must be 32 uint8");
  const int64_t nb = (n + bucket_size - 1) / bucket_size;
  const int64_t code_bytes = (n * bits + 7) / 8;
  auto out = torch::empty({kHeaderBytes + 4 * nb + code_bytes}, torch::kUInt8);
  uint8_t* base = out.data_ptr<uint8_t>();
  std::memcpy(base, header.contiguous().data_ptr<uint8_t>(), kHeaderBytes);
  return {out, reinterpret_cast<float*>(base + kHeaderBytes), base + kHeaderBytes + 4 * nb};
}

// The levels as the decoder's float32 table: encode against the same values.
torch::Tensor level_table(const torch::Tensor& levels, int64_t bits) {
  auto lv = levels.to(torch::kFloat32).contiguous();
  TORCH_CHECK(lv.numel() >= 2 && lv.numel() <= (1 << bits), "encode: bad number of levels");
  return lv;
}

// A preconditioning scale (float32, contiguous, 1-D, n values on the CPU): its data, or nullptr if none.
const float* scale_data(const c10::optional<torch::Tensor>& w, int64_t n, const char* what) {
  if (!w.has_value() || !w->defined()) return nullptr;
  TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == torch::kFloat32 && w->dim() == 1 && w->is_contiguous() &&
                  w->numel() == n,
              what, ": the scale must be a contiguous 1-D float32 CPU tensor of ", n, " values");
  return w->data_ptr<float>();
}

void check_encode(int64_t bits, int64_t bucket_size, int64_t first = 0) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "encode: bits must be 2..8");
  TORCH_CHECK(bucket_size > 0, "encode: bucket_size must be positive");
  TORCH_CHECK(first >= 0 && first % 8 == 0, "encode: first must be a non-negative multiple of 8, got ", first);
}

}  // namespace

// x: contiguous 1-D float tensor on the CPU. Returns the whole payload (header, norms, codes).
// first: the index of x's first coordinate in the random stream (a multiple of 8; see encode_codes):
// x = v[first:first + n] with first on a bucket boundary of v gives v's payload's norms and codes of it.
// With w (float32, as long as x: preconditioned quantization), the payload of x * w (float32 product;
// float64 for float64 x), formed bucket by bucket in cache: the same bytes as encode(x * w).
torch::Tensor encode(torch::Tensor x, torch::Tensor levels, torch::Tensor header, int64_t bits,
                     int64_t bucket_size, bool linf, int64_t seed, c10::optional<torch::Tensor> w, int64_t first) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), "encode: x must be a contiguous 1-D CPU tensor");
  check_encode(bits, bucket_size, first);
  auto lf = level_table(levels, bits);
  const int64_t n = x.numel();
  const float* pw = scale_data(w, n, "encode");
  auto [out, norms, codes] = new_payload(n, bits, bucket_size, header);
  // norms: aligned to 4 bytes (the header is 32 bytes and torch's storage is aligned)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "encode", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    if (pw != nullptr) {
      auto run = use_avx2 ? avx2::encode_scaled_payload<scalar_t> : generic::encode_scaled_payload<scalar_t>;
      run(px, pw, n, bucket_size, linf, norms, lf.data_ptr<float>(), lf.numel(), bits, static_cast<uint64_t>(seed),
          codes, first);
      return;
    }
    auto run = use_avx2 ? avx2::encode_payload<scalar_t> : generic::encode_payload<scalar_t>;
    run(px, n, bucket_size, linf, norms, lf.data_ptr<float>(), lf.numel(), bits, static_cast<uint64_t>(seed), codes,
        first);
  });
  return out;
}

// The payload of the stream of n coordinates that holds the float32 `parts` at `starts` (increasing,
// not overlapping) and zeros elsewhere, read in place: the same bytes as encode() of that stream.
// With scales (one float32 tensor per part, as long as it), of the stream holding parts[k] * scales[k].
// first: as encode's.
torch::Tensor encode_parts(std::vector<torch::Tensor> parts, std::vector<int64_t> starts, int64_t n,
                           torch::Tensor levels, torch::Tensor header, int64_t bits, int64_t bucket_size,
                           bool linf, int64_t seed, c10::optional<std::vector<torch::Tensor>> scales,
                           int64_t first) {
  check_encode(bits, bucket_size, first);
  TORCH_CHECK(bucket_size % 8 == 0, "encode_parts: bucket_size must be a multiple of 8");
  TORCH_CHECK(parts.size() == starts.size(), "encode_parts: one start per part");
  std::vector<const float*> data;
  std::vector<int64_t> sizes;
  int64_t end = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    const auto& p = parts[k];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == torch::kFloat32 && p.dim() == 1 && p.is_contiguous(),
                "encode_parts: parts must be contiguous 1-D float32 CPU tensors");
    TORCH_CHECK(starts[k] >= end && starts[k] + p.numel() <= n, "encode_parts: parts overlap or leave the stream");
    data.push_back(p.data_ptr<float>());
    sizes.push_back(p.numel());
    end = starts[k] + p.numel();
  }
  std::vector<const float*> ws;
  if (scales.has_value()) {
    TORCH_CHECK(scales->size() == parts.size(), "encode_parts: one scale per part");
    for (size_t k = 0; k < parts.size(); ++k) ws.push_back(scale_data((*scales)[k], parts[k].numel(), "encode_parts"));
  }
  auto lf = level_table(levels, bits);
  auto [out, norms, codes] = new_payload(n, bits, bucket_size, header);
  (use_avx2 ? avx2::encode_parts_payload : generic::encode_parts_payload)(
      data.data(), starts.data(), sizes.data(), static_cast<int64_t>(data.size()), n, bucket_size, linf, norms,
      lf.data_ptr<float>(), lf.numel(), bits, static_cast<uint64_t>(seed), codes,
      scales.has_value() ? ws.data() : nullptr, first);
  return out;
}

// Error feedback in one pass: the payload of x + err (x float32, err float32 or bfloat16, same length),
// and err overwritten, bucket by bucket, with what that payload drops, except in buckets where that
// is not finite. With w (float32, as long as x), of x * w + err: the error is kept in the scaled space.
torch::Tensor encode_feedback(torch::Tensor x, torch::Tensor err, torch::Tensor levels, torch::Tensor header,
                              int64_t bits, int64_t bucket_size, bool linf, int64_t seed,
                              c10::optional<torch::Tensor> w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 1 && x.is_contiguous(),
              "encode_feedback: x must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(err.device().is_cpu() && (err.scalar_type() == torch::kFloat32 || err.scalar_type() == torch::kBFloat16) &&
                  err.dim() == 1 && err.is_contiguous() && err.numel() == x.numel(),
              "encode_feedback: err must be a contiguous float32 or bfloat16 CPU tensor as long as x");
  check_encode(bits, bucket_size);
  TORCH_CHECK(bucket_size % 8 == 0, "encode_feedback: bucket_size must be a multiple of 8");
  auto lf = level_table(levels, bits);
  const int64_t n = x.numel();
  const float* pw = scale_data(w, n, "encode_feedback");
  auto [out, norms, codes] = new_payload(n, bits, bucket_size, header);
  auto run = [&](auto* e) {
    using err_t = std::remove_pointer_t<decltype(e)>;
    (use_avx2 ? avx2::encode_feedback_payload<err_t> : generic::encode_feedback_payload<err_t>)(
        x.data_ptr<float>(), e, n, bucket_size, linf, norms, lf.data_ptr<float>(), lf.numel(), bits,
        static_cast<uint64_t>(seed), codes, pw);
  };
  if (err.scalar_type() == torch::kFloat32)
    run(err.data_ptr<float>());
  else
    run(err.data_ptr<at::BFloat16>());
  return out;
}

// Sum of the decoded values of coordinates [start, start + out.numel()) of payloads (already
// validated) of `numel` coordinates each (-1: out.numel()) at the given byte offsets of `payloads`,
// times `scale`, written into the float32 tensor `out`. `start`: a multiple of the bucket size
// whose codes start on a byte. With divide (float32, as long as out: preconditioned quantization),
// each output is then divided by its own value, in the same pass.
torch::Tensor decode_sum(torch::Tensor out, torch::Tensor payloads, std::vector<int64_t> offsets,
                         torch::Tensor levels, int64_t bits, int64_t bucket_size, double scale,
                         int64_t start, int64_t numel, c10::optional<torch::Tensor> divide) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kFloat32 && out.is_contiguous(), "decode_sum: out must be contiguous float32 on the CPU");
  TORCH_CHECK(payloads.scalar_type() == torch::kUInt8 && payloads.is_contiguous(), "decode_sum: payloads must be contiguous uint8");
  TORCH_CHECK(bits >= 2 && bits <= 8 && bucket_size > 0, "decode_sum: bad bits or bucket_size");
  const int64_t n = out.numel();
  const int64_t d = bucket_size;
  if (numel < 0) numel = n;
  TORCH_CHECK(start >= 0 && start % d == 0 && (start * bits) % 8 == 0 && start + n <= numel,
              "decode_sum: start must be a multiple of the bucket size, on a byte of codes, inside the payload");
  const int64_t nb = (numel + d - 1) / d;
  const int64_t code_bytes = (numel * bits + 7) / 8;
  for (int64_t off : offsets)
    TORCH_CHECK(off >= 0 && off + kHeaderBytes + 4 * nb + code_bytes <= payloads.numel(), "decode_sum: payload out of range");
  // 2**bits entries: codes past the last level (only a corrupted payload has them) decode to NaN.
  std::vector<float> table(size_t{1} << bits, std::numeric_limits<float>::quiet_NaN());
  auto lv = levels.to(torch::kFloat32).contiguous();
  TORCH_CHECK(lv.numel() <= (int64_t{1} << bits), "decode_sum: more levels than codes");
  std::memcpy(table.data(), lv.data_ptr<float>(), 4 * lv.numel());
  const uint8_t* base = payloads.data_ptr<uint8_t>();
  std::vector<const uint8_t*> norms, codes;  // of coordinate `start` in each payload
  for (int64_t off : offsets) {
    norms.push_back(base + off + kHeaderBytes + 4 * (start / d));
    codes.push_back(base + off + kHeaderBytes + 4 * nb + start * bits / 8);
  }
  float* po = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float* pdiv = scale_data(divide, n, "decode_sum");
  (use_avx2 ? avx2::decode_payloads : generic::decode_payloads)(po, n, d, norms, codes, table.data(), bits, fscale,
                                                                pdiv);
  return out;
}

// Refit statistics of the norm-based methods (see grid_histogram): float64, 1 + grid.numel().
torch::Tensor grid_statistics(torch::Tensor x, torch::Tensor grid, int64_t bucket_size, bool linf) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), "grid_statistics: x must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(bucket_size > 0, "grid_statistics: bucket_size must be positive");
  auto g = grid.to(torch::kFloat64).contiguous();
  auto out = torch::zeros({g.numel() + 1}, torch::kFloat64);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "grid_statistics", [&] {
    auto run = use_avx2 ? avx2::grid_histogram<scalar_t> : generic::grid_histogram<scalar_t>;
    run(x.data_ptr<scalar_t>(), x.numel(), bucket_size, linf, g.data_ptr<double>(), g.numel(), out.data_ptr<double>(),
        nullptr);
  });
  return out;
}

// grid_statistics and, in row 1, the same counts weighted by norm**2 (bits="auto"): float64 (2, 1 + grid.numel()).
torch::Tensor grid_histograms(torch::Tensor x, torch::Tensor grid, int64_t bucket_size, bool linf) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), "grid_histograms: x must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(bucket_size > 0, "grid_histograms: bucket_size must be positive");
  auto g = grid.to(torch::kFloat64).contiguous();
  auto out = torch::zeros({2, g.numel() + 1}, torch::kFloat64);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "grid_histograms", [&] {
    auto run = use_avx2 ? avx2::grid_histogram<scalar_t> : generic::grid_histogram<scalar_t>;
    run(x.data_ptr<scalar_t>(), x.numel(), bucket_size, linf, g.data_ptr<double>(), g.numel(), out.data_ptr<double>(),
        out.data_ptr<double>() + g.numel() + 1);
  });
  return out;
}

// ------------------------------------------------------------------------------------------
// The entropy-coded wire's rANS coder (horovod_alq/core/entropy.py is the format and the reference):
// a 32-bit state in [2^23, 2^31), byte-wise renormalization, frequencies summing to 2^14, one
// stream per bucket (its two final states little-endian, then the renormalization bytes in the order
// the decoder reads them; code i of a bucket on state i % 2). Division-free encoding by a reciprocal (the same mapping as x / f, x % f).
namespace {

constexpr uint32_t kRansL = 1u << 23;
constexpr int kProbBits = 14;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr int kLanes = 2;  // interleaved states per bucket: code i of a bucket on state i % 2

// Code i of a packed LSB-first stream of `bits`-bit codes (`size` bytes).
inline uint32_t code_at(const uint8_t* p, int64_t size, int64_t i, int64_t bits) {
  const int64_t k = i * bits, byte = k >> 3;
  uint32_t v = p[byte];
  if (byte + 1 < size) v |= static_cast<uint32_t>(p[byte + 1]) << 8;
  return (v >> (k & 7)) & ((1u << bits) - 1);
}

struct EncSymbol {
  uint32_t x_max, rcp, bias, cmpl;
  int shift;
};

std::vector<EncSymbol> enc_symbols(const int64_t* freq, int64_t count) {
  std::vector<EncSymbol> out(count);
  uint32_t start = 0;
  for (int64_t s = 0; s < count; ++s) {
    const uint32_t f = static_cast<uint32_t>(freq[s]);
    EncSymbol& e = out[s];
    e.x_max = ((kRansL >> kProbBits) << 8) * f;
    e.cmpl = kProbScale - f;
    if (f < 2) {  // f == 1: q = x - 1 (f == 0 never codes)
      e.rcp = ~0u;
      e.shift = 0;
      e.bias = start + kProbScale - 1;
    } else {
      int shift = 0;
      while (f > (1u << shift)) ++shift;
      e.rcp = static_cast<uint32_t>(((uint64_t{1} << (shift + 31)) + f - 1) / f);
      e.shift = shift - 1;
      e.bias = start;
    }
    start += f;
  }
  return out;
}

torch::Tensor int64_table(const torch::Tensor& freq, int64_t bits, const char* what) {
  auto f = freq.to(torch::kInt64).contiguous();
  TORCH_CHECK(f.numel() == (int64_t{1} << bits), what, ": one frequency per code");
  const int64_t* p = f.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t s = 0; s < f.numel(); ++s) {
    TORCH_CHECK(p[s] >= 0 && p[s] <= kProbScale, what, ": frequency out of range");
    total += p[s];
  }
  TORCH_CHECK(total == kProbScale, what, ": frequencies must sum to 2^14");
  return f;
}

}  // namespace

// Occurrences of each of the 2^bits codes among the n packed codes (int64).
torch::Tensor rans_count(torch::Tensor codes, int64_t n, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && bits >= 2 && bits <= 8, "rans_count: bad codes");
  TORCH_CHECK(codes.numel() == (n * bits + 7) / 8, "rans_count: packed codes of the wrong size");
  auto out = torch::zeros({int64_t{1} << bits}, torch::kInt64);
  int64_t* h = out.data_ptr<int64_t>();
  const uint8_t* p = codes.data_ptr<uint8_t>();
  const int64_t size = codes.numel();
  for (int64_t i = 0; i < n; ++i) ++h[code_at(p, size, i, bits)];
  return out;
}

// Each bucket of d of the n packed codes rANS-coded with `freq`: (lengths int64 (B,), streams uint8).
std::tuple<torch::Tensor, torch::Tensor> rans_encode(torch::Tensor codes, int64_t n, int64_t d, int64_t bits,
                                                      torch::Tensor freq) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && bits >= 2 && bits <= 8 && d > 0,
              "rans_encode: bad arguments");
  TORCH_CHECK(codes.numel() == (n * bits + 7) / 8, "rans_encode: packed codes of the wrong size");
  auto f = int64_table(freq, bits, "rans_encode");
  const auto sym = enc_symbols(f.data_ptr<int64_t>(), f.numel());
  const int64_t nb = (n + d - 1) / d, cap = 2 * d + 4 * kLanes, size = codes.numel();
  const uint8_t* p = codes.data_ptr<uint8_t>();
  std::vector<uint8_t> scratch(static_cast<size_t>(nb * cap));
  auto lengths = torch::empty({nb}, torch::kInt64);
  int64_t* len = lengths.data_ptr<int64_t>();
  std::atomic<bool> absent{false};
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* end = scratch.data() + (b + 1) * cap;
      uint8_t* ptr = end;
      uint32_t x[kLanes] = {kRansL, kRansL};
      const int64_t lo = b * d, hi = std::min(n, lo + d);
      for (int64_t i = hi - 1; i >= lo; --i) {
        const uint32_t s = code_at(p, size, i, bits);
        const EncSymbol& e = sym[s];
        if (e.x_max == 0) { absent = true; break; }
        uint32_t& xl = x[(i - lo) & 1];
        while (xl >= e.x_max) { *--ptr = static_cast<uint8_t>(xl & 0xff); xl >>= 8; }
        const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(xl) * e.rcp) >> 32) >> e.shift;
        xl = xl + e.bias + q * e.cmpl;
      }
      for (int lane = kLanes - 1; lane >= 0; --lane) {  // lane 0's state first, little-endian
        ptr -= 4;
        ptr[0] = x[lane] & 0xff; ptr[1] = (x[lane] >> 8) & 0xff; ptr[2] = (x[lane] >> 16) & 0xff; ptr[3] = x[lane] >> 24;
      }
      len[b] = end - ptr;
    }
  });
  TORCH_CHECK(!absent, "rans_encode: a code of the payload has frequency 0 in its model");
  int64_t total = 0;
  for (int64_t b = 0; b < nb; ++b) total += len[b];
  auto streams = torch::empty({total}, torch::kUInt8);
  uint8_t* out = streams.data_ptr<uint8_t>();
  for (int64_t b = 0; b < nb; ++b) {
    std::memcpy(out, scratch.data() + (b + 1) * cap - len[b], len[b]);
    out += len[b];
  }
  return {lengths, streams};
}

// Inverse of rans_encode: the packed codes. Raises naming the first bucket whose stream runs out,
// has bytes left over or does not end in the initial state.
torch::Tensor rans_decode(torch::Tensor streams, torch::Tensor lengths, int64_t n, int64_t d, int64_t bits,
                          torch::Tensor freq) {
  TORCH_CHECK(streams.scalar_type() == torch::kUInt8 && streams.is_contiguous() && bits >= 2 && bits <= 8 && d > 0,
              "rans_decode: bad arguments");
  auto f = int64_table(freq, bits, "rans_decode");
  const int64_t nb = (n + d - 1) / d;
  auto lens = lengths.to(torch::kInt64).contiguous();
  TORCH_CHECK(lens.numel() == nb, "rans_decode: one length per bucket");
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<int64_t> starts(nb + 1, 0);
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK(len[b] >= 4 * kLanes, "bucket ", b, ": coded stream shorter than its states");
    starts[b + 1] = starts[b] + len[b];
  }
  TORCH_CHECK(starts[nb] == streams.numel(), "rans_decode: stream lengths do not add up to the streams");
  const int64_t* pf = f.data_ptr<int64_t>();
  std::vector<uint32_t> fr(f.numel()), cum(f.numel());
  std::vector<uint8_t> slot_sym(kProbScale);
  uint32_t c = 0;
  for (int64_t s = 0; s < f.numel(); ++s) {
    fr[s] = static_cast<uint32_t>(pf[s]);
    cum[s] = c;
    std::memset(slot_sym.data() + c, static_cast<int>(s), fr[s]);
    c += fr[s];
  }
  auto out = torch::zeros({(n * bits + 7) / 8}, torch::kUInt8);
  uint8_t* po = out.data_ptr<uint8_t>();
  const uint8_t* src = streams.data_ptr<uint8_t>();
  std::vector<int64_t> bad(nb, 0);
  // buckets whose codes share no byte may be decoded in parallel
  const int64_t grain = ((d * bits) % 8 == 0) ? 1 : std::max<int64_t>(nb, 1);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> local(d);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* ptr = src + starts[b];
      const uint8_t* end = src + starts[b + 1];
      uint32_t x[kLanes];
      for (int lane = 0; lane < kLanes; ++lane, ptr += 4)
        x[lane] = ptr[0] | (uint32_t{ptr[1]} << 8) | (uint32_t{ptr[2]} << 16) | (uint32_t{ptr[3]} << 24);
      const int64_t lo = b * d, m = std::min(n, lo + d) - lo;
      bool short_stream = false;
      int64_t i = 0;
      for (; i + 1 < m && !short_stream; i += 2) {  // both lanes in step: their arithmetic overlaps
        const uint32_t s0 = x[0] & (kProbScale - 1), s1 = x[1] & (kProbScale - 1);
        const uint8_t c0 = slot_sym[s0], c1 = slot_sym[s1];
        local[i] = c0;
        local[i + 1] = c1;
        x[0] = fr[c0] * (x[0] >> kProbBits) + s0 - cum[c0];
        x[1] = fr[c1] * (x[1] >> kProbBits) + s1 - cum[c1];
        for (int lane = 0; lane < kLanes; ++lane)
          while (x[lane] < kRansL) {
            if (ptr >= end) { short_stream = true; break; }
            x[lane] = (x[lane] << 8) | *ptr++;
          }
      }
      if (!short_stream && i < m) {  // an odd last code, on lane 0
        const uint32_t s0 = x[0] & (kProbScale - 1);
        const uint8_t c0 = slot_sym[s0];
        local[i] = c0;
        x[0] = fr[c0] * (x[0] >> kProbBits) + s0 - cum[c0];
        while (x[0] < kRansL) {
          if (ptr >= end) { short_stream = true; break; }
          x[0] = (x[0] << 8) | *ptr++;
        }
      }
      if (short_stream) bad[b] = 1;
      if (bad[b]) continue;
      if (x[0] != kRansL || x[1] != kRansL || ptr != end) { bad[b] = 2; continue; }
      for (int64_t i = 0; i < m; ++i) {
        const int64_t k = (lo + i) * bits;
        const uint32_t v = uint32_t{local[i]} << (k & 7);
        po[k >> 3] |= static_cast<uint8_t>(v & 0xff);
        if ((k & 7) + bits > 8) po[(k >> 3) + 1] |= static_cast<uint8_t>(v >> 8);
      }
    }
  });
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK(bad[b] != 1, "bucket ", b, ": coded stream truncated");
    TORCH_CHECK(bad[b] != 2, "bucket ", b, ": coded stream corrupted (its decoder does not end in the initial state)");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel touches only its tensors' memory (the arguments are converted before, the result
  // after): it releases the GIL, so other Python threads (Horovod's hooks, the autograd thread,
  // the DDP hook's decode in gloo's callbacks) run meanwhile.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("encode", &encode, "Encode a 1-D float CPU tensor (times w, if given) into a horovod-alq payload",
        py::arg("x"), py::arg("levels"), py::arg("header"), py::arg("bits"), py::arg("bucket_size"), py::arg("linf"),
        py::arg("seed"), py::arg("w") = py::none(), py::arg("first") = 0, nogil());
  m.def("encode_parts", &encode_parts, "Encode the stream that holds float32 tensors at given starts, in place",
        py::arg("parts"), py::arg("starts"), py::arg("n"), py::arg("levels"), py::arg("header"), py::arg("bits"),
        py::arg("bucket_size"), py::arg("linf"), py::arg("seed"), py::arg("scales") = py::none(),
        py::arg("first") = 0, nogil());
  m.def("encode_feedback", &encode_feedback, "Encode x (times w, if given) + err and keep in err what the payload drops",
        py::arg("x"), py::arg("err"), py::arg("levels"), py::arg("header"), py::arg("bits"), py::arg("bucket_size"),
        py::arg("linf"), py::arg("seed"), py::arg("w") = py::none(), nogil());
  m.def("decode_sum", &decode_sum, "Decode payloads, sum them and scale (and divide), into a float32 tensor",
        py::arg("out"), py::arg("payloads"), py::arg("offsets"), py::arg("levels"), py::arg("bits"),
        py::arg("bucket_size"), py::arg("scale"), py::arg("start") = 0, py::arg("numel") = -1,
        py::arg("divide") = py::none(), nogil());
  m.def("grid_statistics", &grid_statistics, "Refit statistics [W, C(grid)] of the norm-based methods", nogil());
  m.def("grid_histograms", &grid_histograms, "grid_statistics and the same counts weighted by norm**2 (bits='auto')",
        nogil());
  m.def("rans_count", &rans_count, "Occurrences of each code among packed codes",
        py::call_guard<py::gil_scoped_release>());
  m.def("rans_encode", &rans_encode, "rANS-code each bucket of packed codes (the entropy wire)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rans_decode", &rans_decode, "Decode rANS streams back to packed codes (the entropy wire)",
        py::call_guard<py::gil_scoped_release>());
  m.def("simd", [] { return std::string(use_avx2 ? "avx2" : "generic"); }, "The kernels in use");
  m.def("set_simd", [](bool avx2) { use_avx2 = avx2 && cpu_has_avx2(); },
        "Use the AVX2 kernels (where the CPU has them) or the generic ones");
}
