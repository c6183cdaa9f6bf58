// Paged attention on a CPU: the algorithm of chapter 04b's Triton kernel, in C++.
//
// A work item takes one sequence and query rows of it (decode: all the heads of
// its query, so each token's K and V rows are read whole; prefill: the GQA group
// of one KV head times a chunk of queries). It walks the sequence's keys through
// its block table, a tile of 16 tokens at a time, reading each K/V row where its
// block lies, and keeps per row a running max m, normaliser l and unnormalised
// output acc (online softmax). Math is fp32 whatever the cache stores. A `reg`
// is one SIMD register of floats (16 with AVX-512, 8 with AVX2, 4 with SSE or
// NEON), written with GCC/Clang vector extensions; a `vec` holds a tile's 16
// scores.
// OpenMP runs the work items in parallel. pagedkv_lab/kernels/cpu.py builds it
// with the system's compiler and calls it through ctypes.
//
// The file ends with the layer ops of chapter 05's fused runner (RMSNorm,
// SiLU-gated MLP activation, RoPE with the cache write, the projections'
// matrix products): one library to build.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int W = 16;  // tokens per tile; a `vec` holds one float per token
typedef float vec __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef int32_t ivec __attribute__((vector_size(4 * W), aligned(4), may_alias));
const ivec LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline vec splat(float x) { return vec{} + x; }

// A `reg` is one SIMD register of floats: head_dim is walked L floats at a time.
#if defined(__AVX512F__)
constexpr int L = 16;
#elif defined(__AVX__)
constexpr int L = 8;
#else
constexpr int L = 4;  // SSE, NEON
#endif
typedef float reg __attribute__((vector_size(4 * L), aligned(4), may_alias));
typedef int32_t ireg __attribute__((vector_size(4 * L), aligned(4), may_alias));
typedef uint16_t hreg __attribute__((vector_size(2 * L), aligned(2), may_alias));

// L cache elements as fp32, for each storage type
inline reg load(const float* p) { return *reinterpret_cast<const reg*>(p); }
inline reg load(const uint16_t* p) {  // bfloat16: the top half of an fp32
  const hreg h = *reinterpret_cast<const hreg*>(p);
  return (reg)(__builtin_convertvector(h, ireg) << 16);  // (reg) keeps the bits
}
#ifdef __FLT16_MAX__
typedef _Float16 freg __attribute__((vector_size(2 * L), aligned(2), may_alias));
inline reg load(const _Float16* p) {
  return __builtin_convertvector(*reinterpret_cast<const freg*>(p), reg);
}
#endif
inline float hsum(reg v) {  // halve the register until 4 lanes are left
  typedef float f4 __attribute__((vector_size(16), aligned(4), may_alias));
  typedef float f8 __attribute__((vector_size(32), aligned(4), may_alias));
  const f4* x = reinterpret_cast<const f4*>(&v);
  f4 r = x[0];
  if (L == 16) {
    const f8* y = reinterpret_cast<const f8*>(&v);
    const f8 h = y[0] + y[1];
    r = reinterpret_cast<const f4*>(&h)[0] + reinterpret_cast<const f4*>(&h)[1];
  } else if (L == 8) {
    r = x[0] + x[1];
  }
  return (r[0] + r[2]) + (r[1] + r[3]);
}

inline float vmax(vec v) {
  float x = v[0];
  for (int i = 1; i < W; ++i) x = std::max(x, v[i]);
  return x;
}
inline float vsum(vec v) {
  float x = 0.0f;
  for (int i = 0; i < W; ++i) x += v[i];
  return x;
}

// e^x for x <= 0: e^x = 2^n e^r with n = round(x / ln2), |r| <= ln2 / 2, and
// e^r from its Taylor series up to r^7 (error below fp32 rounding).
inline vec exp_neg(vec x) {
  x = x < -87.0f ? splat(-87.0f) : x;  // e^-87: still a normal fp32
  const vec n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // rounds
  const vec r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  vec p = splat(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = p * r + c;
  const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23;
  return p * (vec)two_n;
}

// The scores of one tile: lane i holds q . k_i for the tile's token i < lim.
// On AVX-512, 16 partial-sum vectors are transposed and added in a tree (15
// pairs of shuffles); elsewhere each dot product is summed on its own. `step`
// runs once per token (the walk's prefetches ride on it).
template <typename T, typename Step>
inline vec tile_scores(const reg* qv, int nr, const T* k, const int64_t* rows,
                       int lim, Step step) {
#ifdef __AVX512F__
  __m512 a[W];
  for (int i = 0; i < W; ++i) {
    step();
    reg t{};
    if (i < lim)
      for (int c = 0; c < nr; ++c) t += qv[c] * load(k + rows[i] + c * L);
    a[i] = (__m512)t;
  }
  for (int j = 0; j < 8; ++j)  // tokens 2j, 2j+1: interleave and add
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]),
                         _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // four tokens per 128-bit lane
    const __m512d x = _mm512_castps_pd(a[2 * j]);
    const __m512d y = _mm512_castps_pd(a[2 * j + 1]);
    a[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 3; ++j) {  // across 128-bit lanes: 8 tokens, then 16
    const int i = j < 2 ? 2 * j : 0, o = j < 2 ? j : 0;
    a[o] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[i], a[i + 1], 0xDD));
  }
  return (vec)a[0];
#else
  float s[W] = {};  // a plain array: writing lanes of a vec one by one is slow
  for (int i = 0; i < lim; ++i) {
    step();
    reg t{};
    for (int c = 0; c < nr; ++c) t += qv[c] * load(k + rows[i] + c * L);
    s[i] = hsum(t);
  }
  return *reinterpret_cast<const vec*>(s);
#endif
}

struct Args {
  const float* q;         // [tokens, heads, head_dim] fp32, rows contiguous
  int64_t q_tok, q_head;  // strides of q, in elements
  const void* k_cache;    // [blocks, block_size, kv_heads, head_dim]
  const void* v_cache;
  const int32_t* tables;  // [seqs, table_width], row stride table_width
  int64_t table_width;
  const int64_t* context_lens;     // [seqs]
  const int64_t* query_start_loc;  // [seqs + 1], or null for decode
  int64_t seqs, heads, kv_heads, head_dim, block_size;
  float scale;
  float* out;  // [tokens, heads, head_dim] fp32
};

// ---- walk: one work item (shown in chapter 04b) ----
// The next tile's K and V lines, prefetched a few per token of work on this
// tile. Issued all at once they would fill the core's few miss buffers and
// stall it until memory answered, so that reading and computing took turns; a
// few at a time, memory works while the core computes.
template <typename T>
struct Prefetcher {
  const T *k, *v;        // the item's K and V
  int64_t bytes;         // read per token from each
  const int64_t* slots;  // where the next tile's rows start
  int tokens = 0, per_step = 0, i = 0;
  int64_t b = 0;  // the next line, in bytes from the row's start
  void start(const int64_t* next_slots, int next_tokens, int steps) {
    slots = next_slots, tokens = next_tokens, i = 0, b = 0;
    const int64_t lines = tokens * ((bytes + 63) / 64);
    per_step = steps ? int((lines + steps - 1) / steps) : 0;
  }
  void step() {  // the next per_step lines of K and of V
    for (int j = 0; j < per_step && i < tokens; ++j) {
      __builtin_prefetch(reinterpret_cast<const char*>(k + slots[i]) + b);
      __builtin_prefetch(reinterpret_cast<const char*>(v + slots[i]) + b);
      if ((b += 64) >= bytes) b = 0, ++i;
    }
  }
};

// Online softmax of `rows` query rows (q: pre-scaled, head_dim apart) over the
// keys [begin, end) of sequence `seq`. The item reads `span` KV heads from
// `kvh0` on (decode: all of them, so that each token's K and V rows are read
// whole; prefill: one); row r uses KV head kvh0 + (r / group) % span and sees
// keys below visible[r]. NV = head_dim / 16 when known at compile time, else 0.
template <typename T, int NV>
void walk(const Args& a, int64_t seq, int64_t kvh0, int64_t span, const float* q,
          int rows, const int64_t* visible, int64_t begin, int64_t end, float* acc,
          float* m, float* l) {
  // registers per head_dim: a constant when NV is, so qv and ov stay in registers
  const int nr = NV ? NV * W / L : int(a.head_dim / L), D = nr * L;
  const int64_t bs = a.block_size, row = a.kv_heads * D;  // elements per slot
  const int64_t group = a.heads / a.kv_heads;
  const T* k = static_cast<const T*>(a.k_cache) + kvh0 * D;
  const T* v = static_cast<const T*>(a.v_cache) + kvh0 * D;
  const int32_t* table = a.tables + seq * a.table_width;
  int64_t slot[2][W];  // where this tile's and the next tile's rows start
  auto find_rows = [&](int64_t t0, int64_t* out) {
    int64_t b = t0 / bs, o = t0 % bs;  // one division per tile, not per token
    for (int i = 0; i < W && t0 + i < end; ++i) {
      out[i] = (table[b] * bs + o) * row;
      if (++o == bs) o = 0, ++b;
    }
  };
  Prefetcher<T> next{k, v, span * D * int64_t(sizeof(T))};
  find_rows(begin, slot[0]);
  for (int64_t t0 = begin, cur = 0; t0 < end; t0 += W, cur ^= 1) {
    const int n = int(std::min<int64_t>(W, end - t0));
    const int64_t* s0 = slot[cur];
    int steps = 0;  // tokens of work on this tile: each row's, scores and values
    for (int r = 0; r < rows; ++r)
      steps += 2 * int(std::clamp<int64_t>(visible[r] - t0, 0, n));
    const int ahead = int(std::clamp<int64_t>(end - t0 - W, 0, W));  // next tile
    if (ahead) find_rows(t0 + W, slot[cur ^ 1]);  // its blocks may lie anywhere
    next.start(slot[cur ^ 1], ahead, steps);
    auto step = [&] { next.step(); };
    for (int r = 0; r < rows; ++r) {
      const int lim = int(std::min<int64_t>(n, visible[r] - t0));
      if (lim <= 0) continue;  // causal: row r sees nothing of this tile
      const int64_t head = r / group % span * D;  // this row's KV head, in the row
      reg qv[NV ? NV * W / L : 256 / L], ov[NV ? NV * W / L : 256 / L];
      for (int c = 0; c < nr; ++c) qv[c] = load(q + r * D + c * L);
      vec s = tile_scores(qv, nr, k + head, s0, lim, step);  // q . k_i
      s = LANE < lim ? s : splat(-INFINITY);
      const float m_new = std::max(m[r], vmax(s));
      float* o = acc + r * D;
      for (int c = 0; c < nr; ++c) ov[c] = load(o + c * L);
      if (m_new > m[r]) {  // the max grew: rescale the sums made under the old one
        const float alpha = exp_neg(splat(m[r] - m_new))[0];
        for (int c = 0; c < nr; ++c) ov[c] *= alpha;
        l[r] *= alpha;
        m[r] = m_new;
      }
      float p[W];  // a plain array: the loop below reads one lane at a time
      *reinterpret_cast<vec*>(p) = LANE < lim ? exp_neg(s - m_new) : vec{};
      l[r] += vsum(*reinterpret_cast<const vec*>(p));
      const T* vh = v + head;
      for (int i = 0; i < lim; ++i) {  // acc += p_i v_i
        step();
        for (int c = 0; c < nr; ++c) ov[c] += p[i] * load(vh + s0[i] + c * L);
      }
      for (int c = 0; c < nr; ++c) *reinterpret_cast<reg*>(o + c * L) = ov[c];
    }
  }
}
// ---- end of walk ----

template <typename T>
void run(const Args& a, int64_t parts, int64_t part_len, int threads) {
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads;
  const bool decode = a.query_start_loc == nullptr;
  // Work items: decode, (seq, partition), every KV head; prefill, (seq, chunk
  // of queries, KV head). An item's rows: `chunk` queries x `span` KV heads x
  // `group` query heads.
  const int64_t chunk = decode ? 1 : std::max<int64_t>(1, 32 / group);
  const int64_t span = decode ? a.kv_heads : 1, per_query = span * group;
  const int64_t kv_items = a.kv_heads / span;  // items per (seq, sub)
  std::vector<int64_t> first(a.seqs + 1, 0);  // each sequence's first item
  for (int64_t s = 0; s < a.seqs; ++s) {
    int64_t n = parts;
    if (!decode) {
      const int64_t ql = a.query_start_loc[s + 1] - a.query_start_loc[s];
      n = (ql + chunk - 1) / chunk;
    }
    first[s + 1] = first[s] + n * kv_items;
  }
  const int64_t items = first[a.seqs];
  std::vector<float> part_acc, part_ml;  // split-KV: partial results to merge
  if (parts > 1) {  // decode only: an item's rows are the sequence's heads
    part_acc.resize(items * a.heads * D);
    part_ml.resize(items * a.heads * 2);
  }
  auto walk_fn = walk<T, 0>;
  if (D == 64) walk_fn = walk<T, 4>;
  if (D == 128) walk_fn = walk<T, 8>;

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
    std::vector<int64_t> visible;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t seq =
          std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      const int64_t kvh = (it - first[seq]) % kv_items * span;
      const int64_t sub = (it - first[seq]) / kv_items;
      const int64_t ctx = a.context_lens[seq];
      int64_t q0 = seq, nq = 1, begin = 0, end = ctx;
      if (decode) {  // sub is the partition
        begin = std::min(ctx, sub * part_len);
        end = std::min(ctx, begin + part_len);
      } else {  // sub is the query chunk; its last query sees keys below `end`
        const int64_t qa = a.query_start_loc[seq];
        const int64_t ql = a.query_start_loc[seq + 1] - qa;
        q0 = qa + sub * chunk;
        nq = std::min(chunk, ql - sub * chunk);
        end = ctx - ql + sub * chunk + nq;
      }
      const int rows = int(nq * per_query);
      scratch.assign(rows * (2 * D + 2), 0.0f);
      float* q = scratch.data();
      float *acc = q + rows * D, *m = acc + rows * D, *l = m + rows;
      visible.resize(rows);
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t x = 0; x < per_query; ++x) {
          const int64_t r = j * per_query + x, h = kvh * group + x;
          const float* src = a.q + (q0 + j) * a.q_tok + h * a.q_head;
          for (int64_t d = 0; d < D; ++d) q[r * D + d] = src[d] * a.scale;
          m[r] = -INFINITY;
          visible[r] = decode ? ctx : end - nq + j + 1;  // causal mask
        }
      walk_fn(a, seq, kvh, span, q, rows, visible.data(), begin, end, acc, m, l);
      if (parts > 1) {  // keep the unnormalised partial result for the merge
        std::copy(acc, acc + rows * D, part_acc.begin() + it * a.heads * D);
        for (int64_t r = 0; r < rows; ++r) {
          part_ml[(it * a.heads + r) * 2] = m[r];
          part_ml[(it * a.heads + r) * 2 + 1] = l[r];
        }
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r / per_query, h = kvh * group + r % per_query;
        float* o = a.out + ((q0 + j) * a.heads + h) * D;
        const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      }
    }
  }
  if (parts == 1) return;
  // Merge each (sequence, head)'s partitions: rescale every partial sum to the
  // largest max, add them up, divide by the rescaled normalisers' sum.
#pragma omp parallel for num_threads(threads)
  for (int64_t sh = 0; sh < a.seqs * a.heads; ++sh) {
    const int64_t seq = sh / a.heads, h = sh % a.heads;
    auto item = [&](int64_t p) { return (first[seq] + p) * a.heads + h; };
    float m = -INFINITY, l = 0.0f;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, part_ml[item(p) * 2]);
    float* o = a.out + sh * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t p = 0; p < parts; ++p) {
      if (part_ml[item(p) * 2 + 1] == 0.0f) continue;  // an empty partition
      const float w = std::exp(part_ml[item(p) * 2] - m);
      l += w * part_ml[item(p) * 2 + 1];
      for (int64_t d = 0; d < D; ++d) o[d] += w * part_acc[item(p) * D + d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= l;
  }
}

}  // namespace

// p[0..18]: q, q_tok, q_head, k_cache, v_cache, dtype (0 fp32, 1 bf16, 2 fp16),
// tables, table_width, context_lens, query_start_loc (0 for decode), seqs,
// heads, kv_heads, head_dim, block_size, out, parts, part_len, threads.
// Returns 0, or -1 when this build cannot take the arguments.
extern "C" int pagedkv_attention(const int64_t* p, double scale) {
  auto ptr = [](int64_t x) { return reinterpret_cast<void*>(x); };
  const Args a{static_cast<const float*>(ptr(p[0])),
               p[1],
               p[2],
               ptr(p[3]),
               ptr(p[4]),
               static_cast<const int32_t*>(ptr(p[6])),
               p[7],
               static_cast<const int64_t*>(ptr(p[8])),
               static_cast<const int64_t*>(ptr(p[9])),
               p[10],
               p[11],
               p[12],
               p[13],
               p[14],
               float(scale),
               static_cast<float*>(ptr(p[15]))};
  const int64_t dtype = p[5], parts = p[16], part_len = p[17];
  const int threads = int(p[18]);
  if (a.head_dim % W || a.head_dim > 16 * W || a.heads % a.kv_heads || parts < 1)
    return -1;
  if (dtype == 0) return run<float>(a, parts, part_len, threads), 0;
  if (dtype == 1) return run<uint16_t>(a, parts, part_len, threads), 0;
#ifdef __FLT16_MAX__
  if (dtype == 2) return run<_Float16>(a, parts, part_len, threads), 0;
#endif
  return -1;
}

// ---- layer ops (chapter 05) ----
// The small steps of a Llama layer between its matrix products, for the fused
// runner: each is one pass over a step's rows, fp32 in and out, where PyTorch
// makes three to ten (one per operation, each reading and writing the rows).
namespace {

// Runs body(row) for rows [0, rows) on `threads` threads (the caller passes
// 1 for small work, by the attention's SERIAL_WORK rule).
template <typename F>
void for_rows(int64_t rows, int threads, F body) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) body(r);
}

inline vec loadv(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void storev(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }

}  // namespace

// x += y (when y is not null), then out = w * (x / sqrt(mean(x^2) + eps)),
// row by row over [rows, dim]: a residual add and RMSNorm in one pass.
// p: x, y, w, out, rows, dim, threads.
extern "C" void pagedkv_add_rms_norm(const int64_t* p, double eps) {
  float* x = reinterpret_cast<float*>(p[0]);
  const float* y = reinterpret_cast<const float*>(p[1]);
  const float* w = reinterpret_cast<const float*>(p[2]);
  float* out = reinterpret_cast<float*>(p[3]);
  const int64_t rows = p[4], dim = p[5], body = dim / W * W;
  for_rows(rows, int(p[6]), [&](int64_t r) {
    float* xr = x + r * dim;
    const float* yr = y ? y + r * dim : nullptr;
    vec acc{};
    float tail = 0.0f;
    for (int64_t d = 0; d < body; d += W) {
      vec v = loadv(xr + d);
      if (yr) storev(xr + d, v += loadv(yr + d));
      acc += v * v;
    }
    for (int64_t d = body; d < dim; ++d) {
      if (yr) xr[d] += yr[d];
      tail += xr[d] * xr[d];
    }
    const float mean_sq = (vsum(acc) + tail) / float(dim);
    const float inv = 1.0f / std::sqrt(mean_sq + float(eps));
    float* o = out + r * dim;
    for (int64_t d = 0; d < body; d += W)
      storev(o + d, loadv(w + d) * (loadv(xr + d) * inv));
    for (int64_t d = body; d < dim; ++d) o[d] = w[d] * (xr[d] * inv);
  });
}

// out[r] = silu(gate[r]) * up[r], where row r of gate_up is [gate | up], each
// `inter` wide: the gated MLP's activation in one pass.
// silu(g) = g / (1 + e^-g), with e^-|g| from exp_neg: it never overflows.
// p: gate_up, out, rows, inter, threads.
extern "C" void pagedkv_silu_mul(const int64_t* p) {
  const float* gu = reinterpret_cast<const float*>(p[0]);
  float* out = reinterpret_cast<float*>(p[1]);
  const int64_t rows = p[2], inter = p[3], body = inter / W * W;
  for_rows(rows, int(p[4]), [&](int64_t r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t j = 0; j < body; j += W) {
      const vec gv = loadv(g + j);
      const vec e = exp_neg(gv < 0 ? gv : -gv);  // e^-|g|
      // sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) below
      const vec sig = (gv < 0 ? e : splat(1.0f)) / (1.0f + e);
      storev(o + j, gv * sig * loadv(u + j));
    }
    for (int64_t j = body; j < inter; ++j)
      o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  });
}

// For each token: RoPE on its q and k heads, in place in its row of qkv
// ([heads | kv_heads | kv_heads] x head_dim), x' = x cos + rotate_half(x) sin
// as transformers computes it; then its k and v heads copied to its cache slot.
// p: qkv, qkv_row_stride, cos, sin ([tokens, head_dim] each), slots (int64),
// k_cache, v_cache ([slots, kv_heads, head_dim]), tokens, heads, kv_heads,
// head_dim, threads.
extern "C" void pagedkv_rope_store(const int64_t* p) {
  float* qkv = reinterpret_cast<float*>(p[0]);
  const int64_t stride = p[1];
  const float* cos = reinterpret_cast<const float*>(p[2]);
  const float* sin = reinterpret_cast<const float*>(p[3]);
  const int64_t* slots = reinterpret_cast<const int64_t*>(p[4]);
  float* k_cache = reinterpret_cast<float*>(p[5]);
  float* v_cache = reinterpret_cast<float*>(p[6]);
  const int64_t tokens = p[7], heads = p[8], kv_heads = p[9], D = p[10];
  const int64_t half = D / 2;
  for_rows(tokens, int(p[11]), [&](int64_t t) {
    float* row = qkv + t * stride;
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    float tmp[512];  // one head: layer_ops checks head_dim <= 512
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      float* x = row + h * D;
      for (int64_t i = 0; i < half; ++i) {
        tmp[i] = x[i] * c[i] + -x[i + half] * s[i];
        tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
      std::copy(tmp, tmp + D, x);
    }
    const int64_t kv = kv_heads * D;
    const float* k = row + heads * D;  // then v, right after
    std::copy(k, k + kv, k_cache + slots[t] * kv);
    std::copy(k + kv, k + 2 * kv, v_cache + slots[t] * kv);
  });
}

// y = x @ W.T (+ bias) for a projection, over [rows, K] x [N, K] in fp32, with
// W packed once (by CpuFusedLinear) as [tiles, K, T]: each tile is T = 2 SIMD
// registers of output columns, its K rows of T weights contiguous, the last
// tile padded with zeros. Each thread takes a contiguous range of tiles. The
// rows are cut into blocks of at most 6, as even as can be; for each block a
// 6 x T (at most) block of sums stays in registers while the tile's weights
// are read once, in order. At a decode step's few rows every weight is read
// about once per step, which is what bounds the step.
constexpr int64_t LINEAR_TILE = 2 * L;
extern "C" int64_t pagedkv_linear_tile() { return LINEAR_TILE; }

namespace {
// no may_alias here: the sums must be free to live in registers
typedef float sums __attribute__((vector_size(4 * L)));
constexpr int64_t ROWS = 6, T = LINEAR_TILE;

// y[R rows, one tile] = x[R rows] . w[the tile], then + bias. U sets of sums,
// for interleaved k, keep at least 8 FMAs in flight when R is small (an FMA's
// latency is 4-5 cycles, and two issue per cycle). Meanwhile it prefetches
// `pf_lines` cache lines from `pf` (its share of the next tile), spread over
// the k loop, so that memory streams while the FMAs run.
template <int R, int U>
inline void linear_block(const float* x, int64_t K, const float* w,
                         const float* bias, float* y, int64_t N, int64_t n0,
                         const char* pf, int64_t pf_lines) {
  sums acc[U][R][2] = {};
  auto fma_k = [&](int u, int64_t k) {
    sums w0, w1;
    __builtin_memcpy(&w0, w + k * T, sizeof w0);
    __builtin_memcpy(&w1, w + k * T + L, sizeof w1);
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * K + k];
      acc[u][i][0] += xv * w0;
      acc[u][i][1] += xv * w1;
    }
  };
  const int64_t per_step = (pf_lines + K - 1) / K * U, unrolled = K / U * U;
  for (int64_t k = 0; k < unrolled; k += U) {
    const int64_t first = k / U * per_step;
    for (int64_t j = first; j < std::min(pf_lines, first + per_step); ++j)
      __builtin_prefetch(pf + 64 * j);
    for (int u = 0; u < U; ++u) fma_k(u, k + u);
  }
  for (int64_t k = unrolled; k < K; ++k) fma_k(0, k);
  for (int u = 1; u < U; ++u)
    for (int i = 0; i < R; ++i) {
      acc[0][i][0] += acc[u][i][0];
      acc[0][i][1] += acc[u][i][1];
    }
  const int64_t cols = std::min(T, N - n0);
  for (int i = 0; i < R; ++i) {
    float out[T];
    __builtin_memcpy(out, acc[0][i], sizeof out);
    float* yr = y + i * N + n0;
    for (int64_t j = 0; j < cols; ++j) yr[j] = out[j] + (bias ? bias[n0 + j] : 0.f);
  }
}
}  // namespace

// p: x, w (packed), bias (0: none), y, rows, K, N, threads.
extern "C" void pagedkv_linear(const int64_t* p) {
  const float* x = reinterpret_cast<const float*>(p[0]);
  const float* w = reinterpret_cast<const float*>(p[1]);
  const float* bias = reinterpret_cast<const float*>(p[2]);
  float* y = reinterpret_cast<float*>(p[3]);
  const int64_t rows = p[4], K = p[5], N = p[6];
  const int64_t tiles = (N + T - 1) / T, blocks = (rows + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(int(p[7]))
  {
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t id = 0, nt = 1;
#endif
    const int64_t first = tiles * id / nt, last = tiles * (id + 1) / nt;
    for (int64_t t = first; t < last; ++t) {
      const float* wt = w + t * K * T;
      // a single row streams the weights in order, which the hardware
      // prefetcher follows; there, prefetching too measured slower
      const int64_t lines = rows > 1 && t + 1 < last ? K * T * 4 / 64 : 0;
      const char* next = reinterpret_cast<const char*>(wt + K * T);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = rows * b / blocks, r1 = rows * (b + 1) / blocks;
        const int64_t l0 = lines * b / blocks, n = lines * (b + 1) / blocks - l0;
        const float* xb = x + r0 * K;
        float* yb = y + r0 * N;
        const char* pf = next + 64 * l0;
        switch (r1 - r0) {
          case 1: linear_block<1, 4>(xb, K, wt, bias, yb, N, t * T, pf, n); break;
          case 2: linear_block<2, 2>(xb, K, wt, bias, yb, N, t * T, pf, n); break;
          case 3: linear_block<3, 2>(xb, K, wt, bias, yb, N, t * T, pf, n); break;
          case 4: linear_block<4, 1>(xb, K, wt, bias, yb, N, t * T, pf, n); break;
          case 5: linear_block<5, 1>(xb, K, wt, bias, yb, N, t * T, pf, n); break;
          default: linear_block<6, 1>(xb, K, wt, bias, yb, N, t * T, pf, n); break;
        }
      }
    }
  }
}
// ---- end of layer ops ----
