// The kernels of the compiled CPU codec, included twice by fused_codec.cpp: once in namespace
// `generic` (the compiler's default instruction set) and once in namespace `avx2` under
// `#pragma GCC target("avx2")` with HOROVOD_ALQ_AVX2 defined, picked at run time by the CPU.
// No header guard and no #include here (fused_codec.cpp includes what this needs first).
//
// Both variants compute bit-identical values: the same float32 operations in the same order, no
// fused multiply-add (the target adds AVX2, not FMA), so ranks on different CPUs decode a payload
// to the same floats, and encode a tensor to the same bytes (the same draw for the same coordinate).

constexpr int64_t kGrain = 1 << 12;  // groups of 8 coordinates per parallel task

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// A 32-bit hash with full avalanche (C. Wellons' "lowbias32"): 32-bit multiplies only, which
// vectorize on every x86-64 with AVX2 (64-bit ones need AVX-512).
inline uint32_t lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352DU;
  h ^= h >> 15;
  h *= 0x846CA68BU;
  h ^= h >> 16;
  return h;
}

// The key of one encode: two 32-bit words of splitmix64(seed).
struct Key {
  uint32_t a, b;
  explicit Key(uint64_t seed) {
    const uint64_t k = splitmix64(seed);
    a = static_cast<uint32_t>(k);
    b = static_cast<uint32_t>(k >> 32);
  }
};

// Uniform for coordinate i: (2k + 1) / 2^24 with k the top 23 bits of a hash of (key, i), exact in
// float, so P(u < p) is p rounded to the nearest 2^-23: no bias. Depends only on the key and i.
inline float uniform_at(const Key& key, int64_t i) {
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32);
  const uint32_t h = lowbias32(lowbias32(static_cast<uint32_t>(i) ^ key.a) + (key.b ^ (hi * 0x9E3779B9U)));
  return static_cast<float>(static_cast<int32_t>(2 * (h >> 9) + 1)) * 0x1.0p-24f;  // signed: converts in one instruction
}

// Norm of the m values at v: float32, NaN where a value is not finite.
template <typename scalar_t>
float bucket_norm_loops(const scalar_t* v, int64_t m, bool linf) {
  // max-abs is exact in the input's own precision widened to float; sums of squares need double
  using max_t = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;
  float norm;
  bool nan_seen = false;
  if (linf) {
    // eight lanes, branch-free: the maximum of |x| (NaN compares false and never wins) and a
    // sum of v - v (0 for finite values, NaN for NaN and infinities): both vectorize
    max_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, bad[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
      for (int k = 0; k < 8; ++k) {
        const max_t a = std::fabs(static_cast<max_t>(v[i + k]));
        acc[k] = acc[k] < a ? a : acc[k];
        bad[k] += a - a;
      }
    for (; i < m; ++i) {
      const max_t a = std::fabs(static_cast<max_t>(v[i]));
      acc[0] = acc[0] < a ? a : acc[0];
      bad[0] += a - a;
    }
    max_t top = acc[0], b = bad[0];
    for (int k = 1; k < 8; ++k) {
      top = acc[k] > top ? acc[k] : top;
      b += bad[k];
    }
    nan_seen = b != 0;  // NaN != 0
    norm = static_cast<float>(top);
  } else {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};  // four chains: no serial dependency per element
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
      for (int k = 0; k < 4; ++k) {
        const double a = static_cast<double>(v[i + k]);
        acc[k] += a * a;
      }
    for (; i < m; ++i) {
      const double a = static_cast<double>(v[i]);
      acc[0] += a * a;
    }
    norm = static_cast<float>(std::sqrt((acc[0] + acc[1]) + (acc[2] + acc[3])));
  }
  return (nan_seen || !std::isfinite(norm)) ? std::numeric_limits<float>::quiet_NaN() : norm;
}

template <typename scalar_t>
float bucket_norm(const scalar_t* v, int64_t m, bool linf) { return bucket_norm_loops(v, m, linf); }

#ifdef HOROVOD_ALQ_AVX2
// bucket_norm's max-abs of float32 values, as integers: the bit patterns of non-negative floats
// order as the floats do, and NaN's lie above infinity's, so one integer maximum per lane finds
// the norm and any value that is not finite. The same float as the loops above.
template <>
inline float bucket_norm<float>(const float* v, int64_t m, bool linf) {
  if (!linf || m < 32) {  // sums of squares, and short tails: the generic loops
    return bucket_norm_loops(v, m, linf);
  }
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  int64_t i = 0;
  for (; i + 32 <= m; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i + 8 * k));
      acc[k] = _mm256_max_epi32(acc[k], _mm256_and_si256(bits, magnitude));
    }
  __m256i top = _mm256_max_epi32(_mm256_max_epi32(acc[0], acc[1]), _mm256_max_epi32(acc[2], acc[3]));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
  int32_t best = 0;
  for (int k = 0; k < 8; ++k) best = lanes[k] > best ? lanes[k] : best;
  for (; i < m; ++i) {
    int32_t b;
    std::memcpy(&b, v + i, 4);
    b &= 0x7FFFFFFF;
    best = b > best ? b : best;
  }
  if (best >= 0x7F800000) return std::numeric_limits<float>::quiet_NaN();  // an infinity or a NaN
  float norm;
  std::memcpy(&norm, &best, 4);
  return norm;
}
#endif

// Norms of buckets [b0, b1) of x (n values, buckets of d).
template <typename scalar_t>
void norms_of_buckets(const scalar_t* x, int64_t n, int64_t d, bool linf, float* norms, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) norms[b] = bucket_norm(x + b * d, std::min(n, b * d + d) - b * d, linf);
}

template <typename scalar_t>
void bucket_norms(const scalar_t* x, int64_t n, int64_t d, bool linf, float* norms) {
  const int64_t nb = (n + d - 1) / d;
  at::parallel_for(0, nb, std::max<int64_t>(1, kGrain * 8 / d), [&](int64_t b0, int64_t b1) {
    norms_of_buckets(x, n, d, linf, norms, b0, b1);
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

inline float clamp_unit(float r) { return r < -1.0f ? -1.0f : (r > 1.0f ? 1.0f : r); }

// Code of r: its cell, plus one with probability (r - lo) / (hi - lo), drawn as u * (hi - lo) < r - lo.
inline uint64_t stochastic_code(float r, float u, const float* levels, const float* widths, int64_t num_levels) {
  const int64_t lo = find_cell(levels, num_levels, r);
  return static_cast<uint64_t>(lo + (u * widths[lo] < r - levels[lo] ? 1 : 0));
}

constexpr int64_t kChunk = 64;  // coordinates per vectorizable block (8 groups of 8)

constexpr int64_t kMaxVectorLevels = 16;  // encode_chunk serves bits <= 4

// The kChunk codes of a chunk into kChunk / 8 groups of BITS bytes (eight codes per group, LSB first).
template <int BITS>
inline void pack_chunk(const uint32_t* code, uint8_t* codes) {
  for (int64_t q = 0; q < kChunk / 8; ++q) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= static_cast<uint64_t>(code[8 * q + k]) << (k * BITS);
    std::memcpy(codes + q * BITS, &word, BITS);
  }
}

// kChunk coordinates of one live bucket, at xc (i0: the first one's index, for the draws): straight-line loops the compiler vectorizes (the level
// search is a select over 2^BITS levels, at least 8, padded with +inf, instead of a table lookup;
// GCC does not vectorize the 4-level loop of 2 bits).
template <int BITS, typename scalar_t>
void encode_chunk(const scalar_t* xc, int64_t i0, float inv, const float* levels, const float* widths,
                  const Key& key, uint8_t* codes) {
  constexpr int64_t num_levels = BITS < 3 ? 8 : int64_t{1} << BITS;
  static_assert(num_levels <= kMaxVectorLevels, "encode_chunk: bits <= 4 only");
  float lv[num_levels], wd[num_levels];  // local copies: lets the compiler vectorize the search
  std::memcpy(lv, levels, sizeof lv);
  std::memcpy(wd, widths, sizeof wd);
  float r[kChunk], u[kChunk];
  uint32_t code[kChunk];
  for (int64_t k = 0; k < kChunk; ++k) u[k] = uniform_at(key, i0 + k);
  for (int64_t k = 0; k < kChunk; ++k) r[k] = clamp_unit(static_cast<float>(xc[k]) * inv);
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
  pack_chunk<BITS>(code, codes);
}

// kChunk coordinates of one live bucket for bits >= 5 (up to 256 levels): the cell by a branch-free
// binary search over `search` (2^BITS entries: the interior levels at their indices, +inf from the
// top level on), which counts the interior levels <= r as find_cell does; then as stochastic_code.
template <int BITS, typename scalar_t>
void encode_chunk_wide(const scalar_t* xc, int64_t i0, float inv, const float* search, const float* levels,
                       const float* widths, const Key& key, uint8_t* codes) {
  static_assert(BITS > 4 && BITS <= 8, "encode_chunk_wide: bits 5..8 only");
  uint32_t code[kChunk];
  for (int64_t k = 0; k < kChunk; ++k) {
    const float r = clamp_unit(static_cast<float>(xc[k]) * inv);
    uint32_t cell = 0;
    for (uint32_t step = 1u << (BITS - 1); step != 0; step >>= 1) cell += search[cell + step] <= r ? step : 0u;
    code[k] = cell + (uniform_at(key, i0 + k) * widths[cell] < r - levels[cell] ? 1u : 0u);
  }
  pack_chunk<BITS>(code, codes);
}

#ifdef HOROVOD_ALQ_AVX2
// lowbias32 on eight lanes (32-bit multiplies: AVX2 has them).
inline __m256i lowbias32_x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7FEB352D));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x846CA68BU)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// r = clamp_unit(x[k] * inv) on eight lanes (clamp_unit for finite products; NaN stays NaN).
template <typename scalar_t>
inline __m256 clamped_x8(const scalar_t* x, __m256 vinv) {
  __m256 v;
  if constexpr (std::is_same<scalar_t, float>::value) {
    v = _mm256_loadu_ps(x);
  } else {
    alignas(32) float tmp[8];
    for (int k = 0; k < 8; ++k) tmp[k] = static_cast<float>(x[k]);
    v = _mm256_load_ps(tmp);
  }
  return _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, vinv), _mm256_set1_ps(-1.0f)), _mm256_set1_ps(1.0f));
}

// uniform_at(key, i + k) on eight lanes (i a multiple of 8: the lanes share i's high word).
inline __m256 uniforms_x8(const Key& key, int64_t i) {
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32);
  const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i key_b = _mm256_set1_epi32(static_cast<int>(key.b ^ (hi * 0x9E3779B9U)));
  const __m256i h = lowbias32_x8(_mm256_add_epi32(
      lowbias32_x8(_mm256_xor_si256(index, _mm256_set1_epi32(static_cast<int>(key.a)))), key_b));
  const __m256i odd = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(h, 9), 1), _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(odd), _mm256_set1_ps(0x1.0p-24f));
}

// Code = cell + (u * width < r - lo), the masks being -1.
inline __m256i round_up_x8(__m256i cell, __m256 r, __m256 lo, __m256 width, __m256 u) {
  const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, width), _mm256_sub_ps(r, lo), _CMP_LT_OQ);
  return _mm256_sub_epi32(cell, _mm256_castps_si256(up));
}

// encode_chunk with intrinsics: the same float32 operations on the same values as the loops above
// (so the same codes), the cell's lower level and width looked up by in-register permutes, and the
// eight codes of a group packed by variable shifts and a horizontal OR.
template <int BITS, typename scalar_t>
void encode_chunk_avx2(const scalar_t* xc, int64_t i0, float inv, const float* levels, const float* widths,
                       int64_t num_levels, const Key& key, uint8_t* codes) {
  static_assert(BITS <= 4, "encode_chunk_avx2: bits <= 4 only");
  __m256 bounds[kMaxVectorLevels];  // interior levels, compared against r
  const int64_t interior = std::min<int64_t>(num_levels, kMaxVectorLevels) - 1;
  for (int64_t j = 1; j < interior; ++j) bounds[j] = _mm256_set1_ps(levels[j]);
  const __m256 lv_lo = _mm256_loadu_ps(levels), wd_lo = _mm256_loadu_ps(widths);
  const __m256 lv_hi = _mm256_loadu_ps(levels + 8), wd_hi = _mm256_loadu_ps(widths + 8);
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  for (int64_t q = 0; q < kChunk / 8; ++q) {
    const __m256 r = clamped_x8(xc + 8 * q, vinv);
    __m256i cell = _mm256_setzero_si256();
    for (int64_t j = 1; j < interior; ++j)  // cell = #{j : levels[j] <= r}: masks are -1
      cell = _mm256_sub_epi32(cell, _mm256_castps_si256(_mm256_cmp_ps(bounds[j], r, _CMP_LE_OQ)));
    __m256 lo = _mm256_permutevar8x32_ps(lv_lo, cell), width = _mm256_permutevar8x32_ps(wd_lo, cell);
    if (BITS == 4) {
      const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(cell, _mm256_set1_epi32(7)));
      lo = _mm256_blendv_ps(lo, _mm256_permutevar8x32_ps(lv_hi, cell), high);
      width = _mm256_blendv_ps(width, _mm256_permutevar8x32_ps(wd_hi, cell), high);
    }
    const __m256i code = round_up_x8(cell, r, lo, width, uniforms_x8(key, i0 + 8 * q));
    __m256i word = _mm256_sllv_epi32(code, shifts);
    word = _mm256_or_si256(word, _mm256_permute2x128_si256(word, word, 1));
    word = _mm256_or_si256(word, _mm256_shuffle_epi32(word, 0x4E));
    word = _mm256_or_si256(word, _mm256_shuffle_epi32(word, 0xB1));
    const uint32_t packed = static_cast<uint32_t>(_mm256_cvtsi256_si32(word));
    std::memcpy(codes + q * BITS, &packed, BITS);
  }
}

// encode_chunk_wide with intrinsics: the binary search by gathers, BITS of them, then the lower
// level and width by two more; the same float32 operations as the loop (so the same codes). The
// chunk's eight groups advance together, step by step, so that their gathers overlap.
template <int BITS, typename scalar_t>
void encode_chunk_wide_avx2(const scalar_t* xc, int64_t i0, float inv, const float* search, const float* levels,
                            const float* widths, const Key& key, uint8_t* codes) {
  static_assert(BITS > 4 && BITS <= 8, "encode_chunk_wide_avx2: bits 5..8 only");
  constexpr int kGroups = kChunk / 8;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256 r[kGroups];
  __m256i cell[kGroups];
  for (int q = 0; q < kGroups; ++q) {
    r[q] = clamped_x8(xc + 8 * q, vinv);
    cell[q] = _mm256_setzero_si256();
  }
  for (int step = 1 << (BITS - 1); step != 0; step >>= 1) {
    const __m256i vstep = _mm256_set1_epi32(step);
    for (int q = 0; q < kGroups; ++q) {
      const __m256i probe = _mm256_add_epi32(cell[q], vstep);
      const __m256 le = _mm256_cmp_ps(_mm256_i32gather_ps(search, probe, 4), r[q], _CMP_LE_OQ);
      cell[q] = _mm256_blendv_epi8(cell[q], probe, _mm256_castps_si256(le));
    }
  }
  alignas(32) uint32_t code[kChunk];
  for (int q = 0; q < kGroups; ++q) {
    const __m256 lo = _mm256_i32gather_ps(levels, cell[q], 4), width = _mm256_i32gather_ps(widths, cell[q], 4);
    const __m256i c = round_up_x8(cell[q], r[q], lo, width, uniforms_x8(key, i0 + 8 * q));
    _mm256_store_si256(reinterpret_cast<__m256i*>(code + 8 * q), c);
  }
  pack_chunk<BITS>(code, codes);
}
#endif

// Where encode_codes finds the values of coordinates [s, e) (one bucket): `at` returns a pointer
// to them, `peek` the same or nullptr where `at` would have to assemble them (for prefetching).
template <typename scalar_t>
struct Contiguous {
  const scalar_t* x;
  const scalar_t* at(int64_t s, int64_t, scalar_t*) const { return x + s; }
  const scalar_t* peek(int64_t s, int64_t) const { return x + s; }
};

// Tensors at increasing, non-overlapping starts of a stream, zeros between them: what the engine's
// fused stream holds, read in place. A bucket inside one tensor is read where it lies; one that
// holds padding (a tensor's last bucket) is assembled in `scratch`. With `scales` (one float32
// vector per tensor: preconditioned quantization) every bucket is assembled, as x[i] * w[i].
template <typename scalar_t>
struct Parts {
  const scalar_t* const* data;
  const int64_t* starts;
  const int64_t* sizes;
  int64_t count;
  const float* const* scales = nullptr;

  int64_t last_at_or_before(int64_t s) const {
    return static_cast<int64_t>(std::upper_bound(starts, starts + count, s) - starts) - 1;
  }
  const scalar_t* peek(int64_t s, int64_t e) const {
    if (scales != nullptr) return nullptr;
    const int64_t k = last_at_or_before(s);
    return k >= 0 && starts[k] + sizes[k] >= e ? data[k] + (s - starts[k]) : nullptr;
  }
  const scalar_t* at(int64_t s, int64_t e, scalar_t* scratch) const {
    if (const scalar_t* direct = peek(s, e)) return direct;
    const int64_t k0 = std::max<int64_t>(0, last_at_or_before(s));
    if (scales == nullptr || k0 >= count || starts[k0] > s || starts[k0] + sizes[k0] < e)
      std::fill(scratch, scratch + (e - s), scalar_t(0));  // not one tensor throughout: padding
    for (int64_t k = k0; k < count && starts[k] < e; ++k) {
      const int64_t a = std::max(s, starts[k]), b = std::min(e, starts[k] + sizes[k]);
      if (a >= b) continue;
      if (scales == nullptr) {
        std::copy(data[k] + (a - starts[k]), data[k] + (b - starts[k]), scratch + (a - s));
      } else {
        const scalar_t* x = data[k] + (a - starts[k]);
        const float* w = scales[k] + (a - starts[k]);
        scalar_t* o = scratch + (a - s);
        for (int64_t i = 0; i < b - a; ++i) o[i] = x[i] * w[i];
      }
    }
    return scratch;
  }
};

// Preconditioned quantization's input: coordinate i is x[i] * w[i] (w float32), as torch computes
// it (float32 for float32, float16 and bfloat16 x; float64 for float64 x), assembled bucket by
// bucket in the scratch: the product is never written to memory.
template <typename in_t>
struct Scaled {
  using out_t = typename std::conditional<std::is_same<in_t, double>::value, double, float>::type;
  const in_t* x;
  const float* w;
  const out_t* peek(int64_t, int64_t) const { return nullptr; }
  const out_t* at(int64_t s, int64_t e, out_t* scratch) const {
    for (int64_t i = s; i < e; ++i) scratch[i - s] = static_cast<out_t>(x[i]) * static_cast<out_t>(w[i]);
    return scratch;
  }
};

// Error feedback's input: coordinate i is x[i] + err[i], assembled bucket by bucket in the scratch
// (err float32 or bfloat16, added as float32).
// With `w` (preconditioned quantization), x[i] * w[i] + err[i]: the error lives in the scaled space.
template <typename err_t>
struct WithError {
  const float* x;
  const err_t* err;
  const float* w = nullptr;
  const float* peek(int64_t, int64_t) const { return nullptr; }
  const float* at(int64_t s, int64_t e, float* scratch) const {
    if (w == nullptr)
      for (int64_t i = s; i < e; ++i) scratch[i - s] = x[i] + static_cast<float>(err[i]);
    else
      for (int64_t i = s; i < e; ++i) scratch[i - s] = x[i] * w[i] + static_cast<float>(err[i]);
    return scratch;
  }
};

// What encode_codes does after a bucket's codes (bucket-by-bucket path only): nothing, or NewError.
struct NoAfter {
  template <typename scalar_t>
  void operator()(int64_t, int64_t, const scalar_t*, float) const {}
};

// The codes of the n values of `src` into out, the bucket norms into norms; coordinate i draws the
// uniform of index first + i (first: a multiple of 8, 0 for a whole payload), so a range of a
// vector that starts on a bucket boundary encodes to the codes the whole vector's encode gives it
// (the pipelined round's chunks: docs/design/design.md). With d a multiple of 8
// the work goes bucket by bucket: each bucket's norm right before its codes (its values come from
// memory once, the second read hits the cache), and the next bucket prefetched meanwhile. Otherwise
// (Contiguous sources only) the norms come first, in a pass of their own (groups of 8 may straddle
// buckets).
template <int BITS, typename scalar_t, typename Source, typename After = NoAfter>
void encode_codes(const Source& src, int64_t n, int64_t d, bool linf, float* norms, const float* levels,
                  int64_t num_levels, uint64_t seed, uint8_t* out, int64_t first = 0,
                  const After& after = After{}) {
  const int64_t groups = (n + 7) / 8;
  const int64_t total_bytes = (n * BITS + 7) / 8;
  const Key key(seed);
  std::vector<float> widths(num_levels - 1);
  for (int64_t j = 0; j + 1 < num_levels; ++j) widths[j] = levels[j + 1] - levels[j];
  const float* w = widths.data();
  // levels for encode_chunk: the top level with width 0, then +inf (never selected)
  float padded_levels[kMaxVectorLevels], padded_widths[kMaxVectorLevels];
  for (int64_t j = 0; j < kMaxVectorLevels; ++j) {
    padded_levels[j] = j < num_levels ? levels[j] : std::numeric_limits<float>::infinity();
    padded_widths[j] = j + 1 < num_levels ? widths[j] : 0.0f;
  }
  // levels for the wide chunks (bits >= 5): interior levels at their indices, +inf from the top one on
  std::vector<float> search;
  if (BITS > 4) {
    search.assign(size_t{1} << BITS, std::numeric_limits<float>::infinity());
    for (int64_t j = 1; j + 1 < num_levels; ++j) search[j] = levels[j];
  }
  const bool vectorizable = BITS > 4 ? num_levels <= (int64_t{1} << BITS) : num_levels <= kMaxVectorLevels;
  // groups [g0, g1), whose values x0[i - base] cover every coordinate i they hold
  auto encode_groups = [&](const scalar_t* x0, int64_t base, int64_t g0, int64_t g1, const scalar_t* ahead) {
    int64_t bucket = g0 * 8 / d, bucket_end = std::min(n, (bucket + 1) * d);
    float inv = 0.0f, pre = 1.0f;
    bool live = false;  // bucket has a positive finite norm
    bool tiny = false;  // ... below 2^-64: 1 / norm could overflow, so r = (x 2^64) / (norm 2^64)
    auto enter = [&]() {
      const float norm = norms[bucket];
      live = norm > 0.0f;  // zero or NaN norm: code 0, decodes to 0 or NaN
      tiny = live && norm < 0x1p-64f;
      pre = tiny ? 0x1p64f : 1.0f;
      inv = live ? 1.0f / (norm * pre) : 0.0f;
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
      if (vectorizable && !tiny && g + kChunk / 8 <= g1 && i0 + kChunk <= bucket_end) {
        if (ahead != nullptr)  // the same span of the next bucket: 4 cache lines of float32
          for (int64_t k = 0; k < kChunk * static_cast<int64_t>(sizeof(scalar_t)); k += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(ahead + (i0 - base)) + k);
        uint8_t* chunk_out = out + g * BITS;
        const scalar_t* xc = x0 + (i0 - base);
        if (!live) {
          std::memset(chunk_out, 0, kChunk / 8 * BITS);
        } else if constexpr (BITS <= 4) {
#ifdef HOROVOD_ALQ_AVX2
          encode_chunk_avx2<BITS>(xc, first + i0, inv, padded_levels, padded_widths, num_levels, key, chunk_out);
#else
          encode_chunk<BITS>(xc, first + i0, inv, padded_levels, padded_widths, key, chunk_out);
#endif
        } else {
#ifdef HOROVOD_ALQ_AVX2
          encode_chunk_wide_avx2<BITS>(xc, first + i0, inv, search.data(), levels, w, key, chunk_out);
#else
          encode_chunk_wide<BITS>(xc, first + i0, inv, search.data(), levels, w, key, chunk_out);
#endif
        }
        g += kChunk / 8;
        continue;
      }
      uint64_t word = 0;  // one group, coordinate by coordinate (bucket edges, tiny norms, tails)
      const int64_t i1 = std::min(n, i0 + 8);
      for (int64_t i = i0; i < i1; ++i) {
        if (i == bucket_end) {
          ++bucket;
          bucket_end = std::min(n, bucket_end + d);
          enter();
        }
        if (live) {
          const float r = clamp_unit(static_cast<float>(x0[i - base]) * pre * inv);
          word |= stochastic_code(r, uniform_at(key, first + i), levels, w, num_levels) << ((i - i0) * BITS);
        }
      }
      const int64_t offset = g * BITS;
      std::memcpy(out + offset, &word, std::min<int64_t>(BITS, total_bytes - offset));
      ++g;
    }
  };
  if (d % 8 == 0) {
    const int64_t nb = (n + d - 1) / d, per_bucket = d / 8;
    at::parallel_for(0, nb, std::max<int64_t>(1, kGrain / per_bucket), [&](int64_t b0, int64_t b1) {
      std::unique_ptr<scalar_t[]> scratch;  // for buckets that hold padding: allocated when needed
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t s = b * d, e = std::min(n, s + d);
        const scalar_t* xb = src.peek(s, e);
        if (xb == nullptr) {
          if (!scratch) scratch.reset(new scalar_t[d]);
          xb = src.at(s, e, scratch.get());
        }
        const scalar_t* ahead = b + 1 < b1 && s + 2 * d <= n ? src.peek(s + d, s + 2 * d) : nullptr;
        norms[b] = bucket_norm(xb, e - s, linf);
        encode_groups(xb, s, b * per_bucket, std::min(groups, (b + 1) * per_bucket), ahead);
        after(s, e, xb, norms[b]);
      }
    });
  } else {
    const scalar_t* x = src.at(0, n, nullptr);
    bucket_norms<scalar_t>(x, n, d, linf, norms);
    at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) { encode_groups(x, 0, g0, g1, nullptr); });
  }
}

#ifdef HOROVOD_ALQ_AVX2
// Eight coordinates of one bucket (bits <= 4: the codes fit one 32-bit word): the table lookup by
// in-register permutes. The same float32 multiply and add as the scalar loop below.
template <int BITS>
inline void decode_group8(float* o, uint32_t word, __m256 table_lo, __m256 table_hi, float norm, bool assign) {
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                       _mm256_set1_epi32((1 << BITS) - 1));
  __m256 level = _mm256_permutevar8x32_ps(table_lo, idx);  // uses the low 3 bits of idx
  if (BITS == 4) {
    const __m256 upper = _mm256_permutevar8x32_ps(table_hi, idx);
    const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
    level = _mm256_blendv_ps(level, upper, high);
  }
  __m256 value = _mm256_mul_ps(_mm256_set1_ps(norm), level);
  if (!assign) value = _mm256_add_ps(_mm256_loadu_ps(o), value);
  _mm256_storeu_ps(o, value);
}
#endif

// Sum over payloads of norm * table[code], times scale, into out (first payload assigns).
// With `divide` (n float32 values, preconditioned quantization), each output is then divided by its
// own: (fscale * sum) / divide[i], the same float32 operations as a division after the decode.
template <int BITS>
void decode_sum_codes(float* po, int64_t n, int64_t d, const std::vector<const uint8_t*>& norm_bytes,
                      const std::vector<const uint8_t*>& code_bytes_of, const float* table, float fscale,
                      const float* divide) {
  constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
  const int64_t code_bytes = (n * BITS + 7) / 8;
  const int64_t groups = (n + 7) / 8;
#ifdef HOROVOD_ALQ_AVX2
  float padded[16];  // table of 2^BITS entries (NaN past the levels), padded to 16
  for (int k = 0; k < 16; ++k) padded[k] = table[k & static_cast<int>(mask)];
  const __m256 table_lo = _mm256_loadu_ps(padded), table_hi = _mm256_loadu_ps(padded + 8);
#endif
  // groups g with g * BITS + 8 <= code_bytes: their word is one unaligned 8-byte load
  const int64_t loadable = code_bytes >= 8 ? (code_bytes - 8) / BITS + 1 : 0;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    const int64_t first = g0 * 8, last = std::min(n, g1 * 8);
    for (size_t p = 0; p < norm_bytes.size(); ++p) {  // payload by payload over this chunk (in cache)
      const bool assign = p == 0;
      const uint8_t* norms = norm_bytes[p];
      const uint8_t* codes = code_bytes_of[p];
      int64_t bucket = first / d, bucket_end = std::min(n, (bucket + 1) * d);
      float norm;
      std::memcpy(&norm, norms + 4 * bucket, 4);
      int64_t g = g0;
      while (g < g1) {
        while (g * 8 >= bucket_end) {
          ++bucket;
          bucket_end = std::min(n, bucket_end + d);
          std::memcpy(&norm, norms + 4 * bucket, 4);
        }
        // whole groups of this bucket: a tight loop
        const int64_t stop = std::min({g1, bucket_end / 8, loadable});
        for (; g < stop; ++g) {
          uint64_t word;
          std::memcpy(&word, codes + g * BITS, 8);
          float* o = po + g * 8;
#ifdef HOROVOD_ALQ_AVX2
          if constexpr (BITS <= 4) {
            decode_group8<BITS>(o, static_cast<uint32_t>(word), table_lo, table_hi, norm, assign);
            continue;
          }
#endif
          if (assign) {
            for (int k = 0; k < 8; ++k) o[k] = norm * table[(word >> (k * BITS)) & mask];
          } else {
            for (int k = 0; k < 8; ++k) o[k] += norm * table[(word >> (k * BITS)) & mask];
          }
        }
        if (g >= g1 || g * 8 >= bucket_end) continue;
        // one group coordinate by coordinate: it crosses a bucket edge, ends the tensor, or its
        // word is near the end of the payload
        const int64_t i0 = g * 8, i1 = std::min(n, i0 + 8);
        uint64_t word = 0;
        std::memcpy(&word, codes + g * BITS, std::min<int64_t>(BITS, code_bytes - g * BITS));
        for (int64_t i = i0; i < i1; ++i) {
          if (i == bucket_end) {
            ++bucket;
            bucket_end = std::min(n, bucket_end + d);
            std::memcpy(&norm, norms + 4 * bucket, 4);
          }
          const float value = norm * table[(word >> ((i - i0) * BITS)) & mask];
          po[i] = assign ? value : po[i] + value;
        }
        ++g;
      }
    }
    if (norm_bytes.empty()) std::fill(po + first, po + last, 0.0f);
    if (fscale != 1.0f)
      for (int64_t i = first; i < last; ++i) po[i] *= fscale;
    if (divide != nullptr)
      for (int64_t i = first; i < last; ++i) po[i] /= divide[i];
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

// The whole encode of one payload's norms and codes (the entry point of this variant).
template <typename scalar_t>
void encode_payload(const scalar_t* x, int64_t n, int64_t d, bool linf, float* norms, const float* levels,
                    int64_t num_levels, int64_t bits, uint64_t seed, uint8_t* codes, int64_t first = 0) {
  dispatch_bits(bits, [&](auto b) {
    encode_codes<decltype(b)::value, scalar_t>(Contiguous<scalar_t>{x}, n, d, linf, norms, levels, num_levels,
                                               seed, codes, first);
  });
}

// encode_payload of x * w (w float32, n values; see Scaled): the product is formed bucket by bucket in
// cache. Buckets of a size that is not a multiple of 8 take the product whole first.
template <typename scalar_t>
void encode_scaled_payload(const scalar_t* x, const float* w, int64_t n, int64_t d, bool linf, float* norms,
                           const float* levels, int64_t num_levels, int64_t bits, uint64_t seed, uint8_t* codes,
                           int64_t first = 0) {
  using out_t = typename Scaled<scalar_t>::out_t;
  const Scaled<scalar_t> src{x, w};
  if (d % 8 != 0) {
    std::vector<out_t> product(static_cast<size_t>(n));
    src.at(0, n, product.data());
    encode_payload<out_t>(product.data(), n, d, linf, norms, levels, num_levels, bits, seed, codes, first);
    return;
  }
  dispatch_bits(bits, [&](auto b) {
    encode_codes<decltype(b)::value, out_t>(src, n, d, linf, norms, levels, num_levels, seed, codes, first);
  });
}

// The same for the stream of n values that holds `count` float32 parts (see Parts; d a multiple of 8).
inline void encode_parts_payload(const float* const* data, const int64_t* starts, const int64_t* sizes,
                                 int64_t count, int64_t n, int64_t d, bool linf, float* norms, const float* levels,
                                 int64_t num_levels, int64_t bits, uint64_t seed, uint8_t* codes,
                                 const float* const* scales = nullptr, int64_t first = 0) {
  const Parts<float> parts{data, starts, sizes, count, scales};
  dispatch_bits(bits, [&](auto b) {
    encode_codes<decltype(b)::value, float>(parts, n, d, linf, norms, levels, num_levels, seed, codes, first);
  });
}

// Error feedback's new error of bucket [s, e) right after its codes, while its values are in cache:
// err = values - decode(codes), the decoder's float32 product norm * level; a bucket whose error is
// not finite (NaN or Inf in its values, an overflowing norm) keeps its previous error. A bfloat16
// buffer takes it rounded to nearest even.
template <int BITS, typename err_t>
struct NewError {
  err_t* err;
  const uint8_t* codes;
  const float* levels;
  int64_t num_levels;
  int64_t total_bytes;
  void operator()(int64_t s, int64_t e, const float* values, float norm) const {
    constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
    constexpr int entries = 1 << BITS;
    float table[entries < 16 ? 16 : entries];  // codes past the levels do not occur (the encoder's own)
    for (int k = 0; k < (entries < 16 ? 16 : entries); ++k) table[k] = levels[std::min<int64_t>(k & mask, num_levels - 1)];
    const int64_t m = e - s;
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < m + 8) scratch.resize(m + 8);  // whole groups
    float* decoded = scratch.data();
#ifdef HOROVOD_ALQ_AVX2
    const __m256 table_lo = _mm256_loadu_ps(table), table_hi = _mm256_loadu_ps(table + 8);
#endif
    for (int64_t i0 = s; i0 < e; i0 += 8) {
      const int64_t g = i0 / 8;
      uint64_t word = 0;
      if (g * BITS + 8 <= total_bytes)
        std::memcpy(&word, codes + g * BITS, 8);  // one load (the bits past this group are shifted out)
      else
        std::memcpy(&word, codes + g * BITS, std::min<int64_t>(BITS, total_bytes - g * BITS));
      float* o = decoded + (i0 - s);
#ifdef HOROVOD_ALQ_AVX2
      if constexpr (BITS <= 4) {
        decode_group8<BITS>(o, static_cast<uint32_t>(word), table_lo, table_hi, norm, true);
        continue;
      }
#endif
      for (int k = 0; k < 8; ++k) o[k] = norm * table[(word >> (k * BITS)) & mask];
    }
    uint32_t bad = 0;  // an error that is NaN or Inf (exponent all ones): bitwise, so it vectorizes
    for (int64_t i = 0; i < m; ++i) {
      const float v = values[i] - decoded[i];
      decoded[i] = v;
      uint32_t u;
      std::memcpy(&u, &v, 4);
      bad |= static_cast<uint32_t>((u & 0x7F800000U) == 0x7F800000U);
    }
    if (bad) return;
    if constexpr (std::is_same_v<err_t, float>)
      std::memcpy(err + s, decoded, sizeof(float) * m);
    else
      for (int64_t i = 0; i < m; ++i) err[s + i] = static_cast<err_t>(decoded[i]);
  }
};

// The payload of x + err (x float32, d a multiple of 8), err becoming what it dropped (see NewError):
// error feedback in one pass over memory.
template <typename err_t>
void encode_feedback_payload(const float* x, err_t* err, int64_t n, int64_t d, bool linf, float* norms,
                             const float* levels, int64_t num_levels, int64_t bits, uint64_t seed, uint8_t* codes,
                             const float* w = nullptr) {
  dispatch_bits(bits, [&](auto b) {
    constexpr int B = decltype(b)::value;
    encode_codes<B, float>(WithError<err_t>{x, err, w}, n, d, linf, norms, levels, num_levels, seed, codes, 0,
                           NewError<B, err_t>{err, codes, levels, num_levels, (n * B + 7) / 8});
  });
}

// out = fscale * the sum over payloads of the decoded n coordinates whose norms and codes start at
// norms[p] and codes[p].
inline void decode_payloads(float* po, int64_t n, int64_t d, const std::vector<const uint8_t*>& norms,
                            const std::vector<const uint8_t*>& codes, const float* table, int64_t bits, float fscale,
                            const float* divide = nullptr) {
  dispatch_bits(bits, [&](auto b) {
    decode_sum_codes<decltype(b)::value>(po, n, d, norms, codes, table, fscale, divide);
  });
}

// The grid cell of a float32 value in a few independent comparisons: for each of the 2^13 top-bit
// patterns of a float32 (sign, exponent, 4 mantissa bits), the count of grid values below the least
// float with that pattern; a value's count is that plus how many of the next kCellProbes grid
// values are below it, exact when no pattern's floats span more grid values (checked when the
// table is built; otherwise `usable` is false). Cached per thread for the last grid (by value),
// with the grid padded by +inf so the probes need no bounds.
constexpr int kCellKeyShift = 19;
constexpr int kCellProbes = 4;
struct CellTable {
  std::vector<double> grid;    // the grid, then kCellProbes times +inf
  std::vector<uint16_t> base;  // per pattern
  bool usable = false;
};

inline double float_at(uint32_t pattern) {
  float f;
  std::memcpy(&f, &pattern, sizeof f);
  return static_cast<double>(f);
}

inline const CellTable& cell_table(const double* grid, int64_t cells) {
  thread_local CellTable table;
  if (static_cast<int64_t>(table.grid.size()) == cells + kCellProbes &&
      std::equal(grid, grid + cells, table.grid.begin())) {
    return table;
  }
  table.grid.assign(grid, grid + cells);
  table.grid.resize(cells + kCellProbes, std::numeric_limits<double>::infinity());
  table.base.assign(size_t(1) << (32 - kCellKeyShift), 0);
  table.usable = cells < (int64_t(1) << 16);
  const uint32_t low = (uint32_t(1) << kCellKeyShift) - 1;
  for (size_t k = 0; k < table.base.size() && table.usable; ++k) {
    const uint32_t pattern = static_cast<uint32_t>(k) << kCellKeyShift;
    if (((pattern >> 23) & 0xFF) == 0xFF) continue;  // infinities and NaN: base 0 (NaN counts nothing)
    const bool negative = pattern >> 31;
    const double least = float_at(negative ? pattern | low : pattern);  // its least and greatest float
    const double most = float_at(negative ? pattern : pattern | low);
    const int64_t below_least = std::lower_bound(grid, grid + cells, least) - grid;
    const int64_t below_most = std::lower_bound(grid, grid + cells, most) - grid;
    table.base[k] = static_cast<uint16_t>(below_least);
    if (below_most - below_least > kCellProbes) table.usable = false;
  }
  return table;
}

// The count of grid values below the float32 value v (NaN: 0), with a usable cell_table.
inline int64_t cells_below(const CellTable& table, float v) {
  uint32_t pattern;
  std::memcpy(&pattern, &v, sizeof pattern);
  const int64_t base = table.base[pattern >> kCellKeyShift];
  const double* g = table.grid.data() + base;
  const double x = static_cast<double>(v);
  int64_t above = 0;
  for (int i = 0; i < kCellProbes; ++i) above += g[i] < x;
  return base + above;
}

// Statistics of a refit round for the norm-based methods: out[0] = sum of the finite non-zero
// bucket norms; out[1 + j] = sum over those buckets of norm / count * #{i : r_i <= grid[j]}, with
// r_i = clamp(float32(x_i) / norm, -1, 1) (a coordinate at -1 counts in cell 1, as in the core).
// squared (bits="auto", may be null): the same counts weighted by norm**2 instead, squared[0] = sum
// of norm**2 * count. One pass; the cell is found by cells_below for float32 work (a few
// comparisons after a table lookup) and otherwise by a branch-free binary search over the grid.
template <typename scalar_t>
void grid_histogram(const scalar_t* x, int64_t n, int64_t d, bool linf, const double* grid, int64_t cells,
                    double* out, double* squared) {
  using work_t = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;
  const int64_t nb = (n + d - 1) / d;
  std::vector<float> norms(nb);
  bucket_norms<scalar_t>(x, n, d, linf, norms.data());
  std::vector<double> hist(cells + 1, 0.0);
  int64_t steps = 1;  // the smallest power of two >= cells
  while (steps < cells) steps <<= 1;
  const CellTable* table = std::is_same<work_t, float>::value ? &cell_table(grid, cells) : nullptr;
  const bool tabled = table != nullptr && table->usable;
  double total = 0.0, total_sq = 0.0;
  std::vector<double> hist_sq(squared ? cells + 1 : 0, 0.0);
  for (int64_t b = 0; b < nb; ++b) {
    const float norm = norms[b];
    if (!(norm > 0.0f)) continue;  // zero or NaN
    const int64_t s = b * d, e = std::min(n, s + d);
    const double weight = static_cast<double>(norm) / static_cast<double>(e - s);
    const double weight_sq = static_cast<double>(norm) * static_cast<double>(norm);
    const work_t denom = static_cast<work_t>(norm);
    total += norm;
    total_sq += weight_sq * static_cast<double>(e - s);
    for (int64_t i = s; i < e; ++i) {
      work_t r = static_cast<work_t>(x[i]) / denom;
      r = r < work_t(-1) ? work_t(-1) : (r > work_t(1) ? work_t(1) : r);
      const double v = static_cast<double>(r);
      int64_t lo = 0;  // the first j with grid[j] >= v: count of grid values < v
      if (tabled) {
        lo = cells_below(*table, static_cast<float>(r));
      } else {
        for (int64_t step = steps >> 1; step > 0; step >>= 1) {
          const int64_t probe = lo + step;
          lo = (probe <= cells && grid[probe - 1] < v) ? probe : lo;
        }
      }
      const int64_t cell = lo < 1 ? 1 : lo;
      hist[cell] += weight;
      if (squared) hist_sq[cell] += weight_sq;
    }
  }
  out[0] = total;
  double running = 0.0;
  for (int64_t j = 0; j < cells; ++j) {
    running += hist[j];
    out[1 + j] = running;
  }
  if (squared) {
    squared[0] = total_sq;
    running = 0.0;
    for (int64_t j = 0; j < cells; ++j) {
      running += hist_sq[j];
      squared[1 + j] = running;
    }
  }
}
