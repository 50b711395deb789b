// y[m, o] = sum_i x[m, i] * w[o, i] for a few rows m: a weight-streaming matrix product.
//
// XLA's CPU backend emits a fast matrix-vector loop when x has one row, but hands 2..16 rows to
// a general matrix-matrix routine that is far slower per byte of weights at these shapes, so a
// target pass over a handful of speculative tokens costs about twice a one-token pass. This
// kernel reads each weight row once for all rows of x (which stay in L1) and splits the output
// rows over a small pool of worker threads. Built on first use by eagle_jax/kernels/__init__.py.
//
// BlockMatmul is the same product with w given as GGUF-style integer blocks (32 weights, one
// scale and offset each), expanded to float32 in registers as they are used, for 1..32 rows
// (passes of up to 8): a quarter to a sixth of the bytes, and at one row no longer bound by
// memory on two cores.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <cstdint>
#include <cstdlib>
#include <immintrin.h>
#include <sched.h>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The machine's vector: W float32 lanes (AVX-512: 16, else 8).
// A block's 32 weights are kPieces vectors.
#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
// Token rows whose values a block step keeps in registers (kPieces vectors each) beside the
// accumulators; a step over more token rows holds the weights in registers instead.
#ifdef __AVX512F__
constexpr int kRegTokens = 4;
#else
constexpr int kRegTokens = 3;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef int8_t vi8 __attribute__((vector_size(W)));
typedef uint8_t vu8 __attribute__((vector_size(W)));

template <typename V>
inline V Load(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// The lanes of v summed as a tree (halves added, then their halves, ...): the same sum for every
// call, in about 4 dependent steps where a sum in lane order takes W - 1.
inline float TreeHsum(vf v) {
#if defined(__AVX512F__)
  const __m512 z = reinterpret_cast<__m512>(v);
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(z),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
#else
  for (int half = W / 2; half >= 1; half /= 2) {
    for (int j = 0; j < half; ++j) v[j] += v[j + half];
  }
  return v[0];
#endif
}

// Rows [o_begin, o_end) of y for the token rows [m0, m0 + TM), R weight rows at a time; TM x R
// accumulators, TM token vectors and one weight vector fit the vector registers (16 with AVX2,
// 32 with AVX-512). `w` points at weight row o_begin. Each y value is summed in the same order
// whatever TM and m are, so a token row gets the same bits alone or among others.
template <int TM, int R>
void Block(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t m0,
           int64_t o_begin, int64_t o_end) {
  const int64_t inw = in - in % W;
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) {
    const float* wo = w + (o - o_begin) * in;
    vf acc[R][TM] = {};
    for (int64_t i = 0; i < inw; i += W) {
      vf xv[TM];
      for (int t = 0; t < TM; ++t) {
        xv[t] = Load<vf>(x + (m0 + t) * in + i);
        // Opaque to the compiler from here: it keeps the token values in registers for all R
        // rows instead of folding a load from memory into every multiply-add.
        __asm__("" : "+v"(xv[t]));
      }
      for (int r = 0; r < R; ++r) {
        const vf wv = Load<vf>(wo + r * in + i);
        for (int t = 0; t < TM; ++t) acc[r][t] += wv * xv[t];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TM; ++t) {
        float s = TreeHsum(acc[r][t]);
        for (int64_t i = inw; i < in; ++i) s += wo[r * in + i] * x[(m0 + t) * in + i];
        y[(m0 + t) * out + o + r] = s;
      }
    }
  }
  for (; o < o_end; ++o) {  // the last rows, fewer than R
    const float* wo = w + (o - o_begin) * in;
    for (int t = 0; t < TM; ++t) {
      float s = 0.f;
      for (int64_t i = 0; i < in; ++i) s += wo[i] * x[(m0 + t) * in + i];
      y[(m0 + t) * out + o] = s;
    }
  }
}

// Every group of up to kFTokens token rows over weight rows [c, e) (w points at row c).
#ifdef __AVX512F__
constexpr int kFTokens = 4;  // 16 accumulators, 4 token vectors, one weight vector
#else
constexpr int kFTokens = 3;  // 12 accumulators, 3 token vectors, one weight vector
#endif
void Span(const float* x, const float* w, float* y, int64_t m, int64_t in, int64_t out,
          int64_t c, int64_t e) {
  int64_t m0 = 0;
  for (; m0 + kFTokens <= m; m0 += kFTokens) Block<kFTokens, 4>(x, w, y, in, out, m0, c, e);
  switch (m - m0) {
    case 3: Block<3, 4>(x, w, y, in, out, m0, c, e); break;
    case 2: Block<2, 4>(x, w, y, in, out, m0, c, e); break;
    case 1: Block<1, 4>(x, w, y, in, out, m0, c, e); break;
    default: break;
  }
}

constexpr int64_t kSplit = 8;  // threads split the output rows in multiples of this
constexpr int64_t kBlock = 32;  // weights per quantization block (along `in`)
constexpr int kPieces = kBlock / W;  // vectors per block

// Weight rows per chunk: about 24 KB of float32, so a chunk stays in L1 while the token rows
// pass over it.
int64_t ChunkRows(int64_t in) {
  return std::max<int64_t>(kSplit, 24576 / (4 * std::max<int64_t>(in, 1)) / kSplit * kSplit);
}

// Integer weights in blocks of kBlock along `in`: w[o, i] = scale[o, b] * q[o, i] + offset[o, b]
// with b = i / kBlock. `bits` 8: q is int8 [out, in]. `bits` 4: q is uint8 [out, in / 2], byte
// j of a block's 16 holding value j in its low nibble and value j + 16 in its high one (GGUF's
// Q4_0 / Q4_1 order). The product scale * q is exact in float32 for these sizes, so the one
// rounding of the sum gives the float32 weight GGUF's own dequantization gives.
struct Quantized {
  const void* q;
  const float *scale, *offset;
  int bits;
};


// W bytes from p widened to W int32 lanes, sign- or zero-extended. GCC 12 turns the generic
// vector conversion into W scalar ones in these loops, so x86 gets one instruction.
template <bool Signed>
inline vi Widen(const void* p) {
#if defined(__AVX512F__)
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return reinterpret_cast<vi>(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
#elif defined(__AVX2__)
  const __m128i v = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return reinterpret_cast<vi>(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
#else
  if (Signed) {
    vi8 v;
    __builtin_memcpy(&v, p, sizeof(v));
    return __builtin_convertvector(v, vi);
  }
  vu8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, vi);
#endif
}

// One weight row's place in a walk over its blocks: the block's integers, scale and offset. The
// walk advances pointers block by block; computing each block's address from (row, block)
// indices cost more scalar instructions than the vector work itself at one token row.
template <int Bits>
struct Cursor {
  static constexpr int64_t kBytes = Bits == 8 ? kBlock : kBlock / 2;  // integers per block
  const uint8_t* q = nullptr;
  const float *scale = nullptr, *offset = nullptr;
  Cursor() = default;
  Cursor(const Quantized& qw, int64_t in, int64_t o)
      : q(static_cast<const uint8_t*>(qw.q) + o * (in / kBlock) * kBytes),
        scale(qw.scale + o * (in / kBlock)),
        offset(qw.offset + o * (in / kBlock)) {}
  void Next() {
    q += kBytes;
    ++scale;
    ++offset;
  }
};

// Piece P of the 32 weights of the cursor's block, as float32.
template <int Bits, int P>
inline vf Expand(const Cursor<Bits>& c) {
  vi q;
  if (Bits == 8) {
    q = Widen<true>(c.q + P * W);
  } else {  // values 0-15 are the low nibbles of the block's 16 bytes, 16-31 the high ones
    q = Widen<false>(c.q + (P * W) % 16);
    q = P * W < 16 ? (q & 15) : (q >> 4);
  }
  return __builtin_convertvector(q, vf) * *c.scale + *c.offset;
}

// Piece P of the current blocks: acc[r][t] += weights(row r) * x(token t), piece by piece. `x`
// points at the block's first value of the first token row.
template <int Bits, int TM, int R, int P>
inline void Pieces(const float* x, int64_t in, const Cursor<Bits> (&rows)[R], vf (&acc)[R][TM]) {
  if constexpr (P < kPieces) {
    if constexpr (TM > kRegTokens) {  // more token rows than registers: weights held, tokens loaded
      vf w[R];
      for (int r = 0; r < R; ++r) w[r] = Expand<Bits, P>(rows[r]);
      for (int t = 0; t < TM; ++t) {
        vf xs = Load<vf>(x + t * in + P * W);
        __asm__("" : "+v"(xs));  // one load for all R rows
        for (int r = 0; r < R; ++r) acc[r][t] += w[r] * xs;
      }
    } else {
      vf xs[TM];
      for (int t = 0; t < TM; ++t) {
        xs[t] = Load<vf>(x + t * in + P * W);
        __asm__("" : "+v"(xs[t]));  // kept in a register for all R rows (see Pieces4)
      }
      for (int r = 0; r < R; ++r) {
        const vf w = Expand<Bits, P>(rows[r]);
        for (int t = 0; t < TM; ++t) acc[r][t] += w * xs[t];
      }
    }
    Pieces<Bits, TM, R, P + 1>(x, in, rows, acc);
  }
}

#ifdef __AVX512F__
// Pieces for 4-bit blocks on AVX-512, both pieces of a block at once: a block's 16 possible
// weights, scale * {0..15} + offset, form one vector (the same fused multiply-add Expand does per
// weight, so the same bits), and each weight is that vector's lane picked by its nibble
// (vpermps reads an index's low 4 bits: no mask for the low nibbles). One widening and one
// permutation per 16 weights replace a conversion and a multiply-add; the token sums are added
// in the order Pieces adds them.
template <int TM, int R>
inline void Pieces4(const float* x, int64_t in, const Cursor<4> (&rows)[R], vf (&acc)[R][TM]) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto expand = [&](int r, vf& w0, vf& w1) {
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(*rows[r].scale),
                                         _mm512_set1_ps(*rows[r].offset));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r].q)));
    w0 = reinterpret_cast<vf>(_mm512_permutexvar_ps(idx, table));
    w1 = reinterpret_cast<vf>(_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table));
  };
  if constexpr (TM > kRegTokens) {  // more token rows than registers: weights held, tokens loaded
    vf w0[R], w1[R];
    for (int r = 0; r < R; ++r) expand(r, w0[r], w1[r]);
    for (int t = 0; t < TM; ++t) {
      vf lo = Load<vf>(x + t * in), hi = Load<vf>(x + t * in + W);
      __asm__("" : "+v"(lo), "+v"(hi));  // one load for all R rows
      for (int r = 0; r < R; ++r) acc[r][t] += w0[r] * lo;
      for (int r = 0; r < R; ++r) acc[r][t] += w1[r] * hi;
    }
  } else {
    vf lo[TM], hi[TM];
    for (int t = 0; t < TM; ++t) {
      lo[t] = Load<vf>(x + t * in);
      hi[t] = Load<vf>(x + t * in + W);
      // Opaque to the compiler from here: it keeps the token values in registers for all R
      // rows instead of folding a load from memory into every multiply-add (R times the loads;
      // the loop was then bound by loads, about 40% slower at 4 token rows).
      __asm__("" : "+v"(lo[t]), "+v"(hi[t]));
    }
    for (int r = 0; r < R; ++r) {
      vf w0, w1;
      expand(r, w0, w1);
      for (int t = 0; t < TM; ++t) acc[r][t] += w0 * lo[t];
      for (int t = 0; t < TM; ++t) acc[r][t] += w1 * hi[t];
    }
  }
}
#endif

// Requests every cache line of [p, p + bytes) at once. A group of R weight rows is read block
// by block across its rows (R interleaved streams, 16-32 bytes each per step), which the
// hardware prefetchers follow poorly: touching the whole group first lets its reads from memory
// overlap; `eagle-jax bench decode --json` reports the block products' time per token
// (kernel_ms_per_token).
inline void Prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i);
}

// As Block, for integer-block weights expanded in registers: rows [o_begin, o_end) of y for
// token rows [m0, m0 + TM), R weight rows at a time, then the rest one at a time. Every y value
// takes the same operations in the same order whatever TM, R and m are.
template <int Bits, int TM, int R>
void QBlock(const float* x, const Quantized& qw, float* y, int64_t in, int64_t out, int64_t m0,
            int64_t o_begin, int64_t o_end) {
  const int64_t nb = in / kBlock;
  const int64_t row_bytes = Bits == 8 ? in : in / 2;
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) {
    Prefetch(static_cast<const char*>(qw.q) + o * row_bytes, R * row_bytes);
    Prefetch(qw.scale + o * nb, R * nb * 4);
    Prefetch(qw.offset + o * nb, R * nb * 4);
    Cursor<Bits> rows[R];
    for (int r = 0; r < R; ++r) rows[r] = Cursor<Bits>(qw, in, o + r);
    vf acc[R][TM] = {};
    const float* xb = x + m0 * in;
    for (int64_t b = 0; b < nb; ++b, xb += kBlock) {
#ifdef __AVX512F__
      if constexpr (Bits == 4) {
        Pieces4<TM, R>(xb, in, rows, acc);
      } else {
        Pieces<Bits, TM, R, 0>(xb, in, rows, acc);
      }
#else
      Pieces<Bits, TM, R, 0>(xb, in, rows, acc);
#endif
      for (int r = 0; r < R; ++r) rows[r].Next();
    }
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TM; ++t) y[(m0 + t) * out + o + r] = TreeHsum(acc[r][t]);
    }
  }
  if (R > 1 && o < o_end) QBlock<Bits, TM, 1>(x, qw, y, in, out, m0, o, o_end);
}

// Token rows per pass over the weights, and weight rows per step: R x TM accumulators and either
// TM token vectors (TM <= kRegTokens) or R weight vectors fit the vector registers.
#ifdef __AVX512F__
constexpr int kQTokens = 8;  // 32 registers
template <int TM> constexpr int kQRows = TM <= kRegTokens ? 4 : 2;
#else
constexpr int kQTokens = 3;  // 16 registers
template <int TM> constexpr int kQRows = 2;
#endif

template <int Bits, int TM>
void QPass(const float* x, const Quantized& qw, float* y, int64_t m, int64_t in, int64_t out,
           int64_t m0, int64_t c, int64_t e) {
  if constexpr (TM >= 1) {
    if (m - m0 == TM) {
      QBlock<Bits, TM, kQRows<TM>>(x, qw, y, in, out, m0, c, e);
    } else {
      QPass<Bits, TM - 1>(x, qw, y, m, in, out, m0, c, e);
    }
  }
}

// Every token row over weight rows [c, e): passes of kQTokens token rows, then one pass over the
// rest, so up to kQTokens rows read each weight block once.
template <int Bits>
void QSpan(const float* x, const Quantized& qw, float* y, int64_t m, int64_t in, int64_t out,
           int64_t c, int64_t e) {
  int64_t m0 = 0;
  for (; m0 + kQTokens <= m; m0 += kQTokens) {
    QBlock<Bits, kQTokens, kQRows<kQTokens>>(x, qw, y, in, out, m0, c, e);
  }
  if (m0 < m) QPass<Bits, kQTokens - 1>(x, qw, y, m, in, out, m0, c, e);
}

// All token rows for weight rows [o_begin, o_end): the rows are walked in chunks that stay in
// L1 while every pass of token rows goes over them, so weights come from memory
// once. Integer-block weights (qw.q set) are expanded to float32 in registers as they are used.
void Rows(const float* x, const float* w, const Quantized& qw, float* y, int64_t m, int64_t in,
          int64_t out, int64_t o_begin, int64_t o_end) {
  const int64_t chunk = ChunkRows(in);
  for (int64_t c = o_begin; c < o_end; c += chunk) {
    const int64_t e = std::min(o_end, c + chunk);
    if (qw.q == nullptr) {
      Span(x, w + c * in, y, m, in, out, c, e);
    } else if (qw.bits == 4) {
      QSpan<4>(x, qw, y, m, in, out, c, e);
    } else {
      QSpan<8>(x, qw, y, m, in, out, c, e);
    }
  }
}

// Wall time spent inside each kernel, and its calls, since the library was loaded: read by
// eagle_jax.kernels.time_inside (the decode benchmark splits a step into the products, the
// attention and the rest with it). Two clock reads and two atomic adds per call.
enum Kernel { kSmall, kBlocks, kAttend, kKernels };
std::atomic<int64_t> g_inside_ns[kKernels], g_calls[kKernels];
struct Timed {
  Kernel k;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Timed() {
    g_inside_ns[k].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start).count(), std::memory_order_relaxed);
    g_calls[k].fetch_add(1, std::memory_order_relaxed);
  }
};

// A small private worker pool. XLA may run several independent custom calls at once on its
// own pool, so a call that blocked waiting on tasks queued there could deadlock; here the
// calling thread takes chunks of its own job until none are left, and only then waits for
// chunks that workers are already running.
struct Task {
  int64_t chunks = 1;
  std::atomic<int64_t> next{0}, done{0};
  virtual ~Task() = default;
  virtual void Chunk(int64_t c) = 0;
  void Work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Chunk(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

struct Job : Task {
  const float *x, *w;
  Quantized qw{nullptr, nullptr, nullptr, 0};
  float* y;
  int64_t m, in, out, per;
  void Chunk(int64_t c) override { Rows(x, w, qw, y, m, in, out, c * per, std::min(out, (c + 1) * per)); }
};

class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool();  // never destroyed: workers live as long as the process
    return *pool;
  }
  int64_t size() const { return static_cast<int64_t>(workers_) + 1; }
  void Run(const std::shared_ptr<Task>& job) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int64_t i = 1; i < job->chunks && i <= static_cast<int64_t>(workers_); ++i) {
        queue_.push_back(job);
        pending_.fetch_add(1, std::memory_order_release);
      }
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();  // workers still spinning from the last call need no wake-up
    job->Work();
    while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  }

 private:
  // How long an idle worker spins before it sleeps: a forward pass calls the kernel every few
  // tens of microseconds, and waking a sleeping thread costs about as much.
  static constexpr auto kSpin = std::chrono::microseconds(200);

  // Threads, the caller included: EAGLE_JAX_KERNEL_THREADS if set to a positive number, else the
  // cores this process may run on (its affinity mask: a container or `taskset` limit, which
  // hardware_concurrency ignores), else hardware_concurrency.
  static unsigned Threads() {
    if (const char* env = std::getenv("EAGLE_JAX_KERNEL_THREADS")) {
      const long n = std::strtol(env, nullptr, 10);
      if (n > 0) return static_cast<unsigned>(n);
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
      return static_cast<unsigned>(CPU_COUNT(&set));
    }
    return std::max(1u, std::thread::hardware_concurrency());
  }
  Pool() : workers_(Threads() - 1) {
    for (unsigned i = 0; i < workers_; ++i) std::thread([this] { Loop(); }).detach();
  }
  bool SpinForWork() {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
      if (pending_.load(std::memory_order_acquire) > 0) return true;
      if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) return false;
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
    }
  }
  void Loop() {
    for (;;) {
      SpinForWork();
      std::shared_ptr<Task> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ++sleepers_;
        cv_.wait(lock, [this] { return !queue_.empty(); });
        --sleepers_;
        job = std::move(queue_.front());
        queue_.pop_front();
        pending_.fetch_sub(1, std::memory_order_relaxed);
      }
      job->Work();
    }
  }
  unsigned workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  std::atomic<int64_t> pending_{0};
  int sleepers_ = 0;  // guarded by mu_
};

// Splits the output rows over the pool (at least 256 rows a chunk, so tiny matrices run on one
// thread) and runs the job.
void Launch(const std::shared_ptr<Job>& job) {
  Pool& pool = Pool::Get();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.size(), job->out / 256));
  job->per = ((job->out + parts - 1) / parts + kSplit - 1) / kSplit * kSplit;
  job->chunks = (job->out + job->per - 1) / job->per;
  if (job->chunks <= 1) {
    Rows(job->x, job->w, job->qw, job->y, job->m, job->in, job->out, 0, job->out);
  } else {
    pool.Run(job);
  }
}

// Whether a weight operand is one [rows, cols] matrix (leading dims of size 1 allowed). Under
// jax.vmap the Python side passes one matrix always: a batch of x becomes rows of x, a batch of
// weights runs XLA's einsum instead (eagle_jax/kernels/__init__.py, _weights_stay_shared).
bool OneMatrix(ffi::Span<const int64_t> d) {
  bool ok = d.size() >= 2;
  for (size_t i = 0; i + 2 < d.size(); ++i) ok = ok && d[i] == 1;
  return ok;
}

ffi::Error SmallMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  const Timed timed{kSmall};
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (!OneMatrix(wd) || xd.size() < 1 || xd.back() != wd[wd.size() - 1]) {
    return ffi::Error::InvalidArgument("small_matmul: x [..., in] and one w [out, in] expected");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->in = wd[wd.size() - 1];
  job->out = wd[wd.size() - 2];
  job->m = x.element_count() / std::max<int64_t>(job->in, 1);
  Launch(job);
  return ffi::Error::Success();
}

// x's rows RMS-normalised and scaled by `weight` (n values each), as eagle_jax.model.RMSNorm
// computes them: x * (1 / sqrt(mean(x * x) + eps)) * weight, the squares summed in a fixed
// order, so a row gets the same bits alone or among others.
void RmsNorm(const float* x, const float* weight, float eps, int64_t m, int64_t n, float* out) {
  for (int64_t t = 0; t < m; ++t) {
    const float* xr = x + t * n;
    vf acc = {};
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const vf v = Load<vf>(xr + i);
      acc += v * v;
    }
    float ss = TreeHsum(acc);
    for (; i < n; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (i = 0; i < n; ++i) out[t * n + i] = weight[i] * (xr[i] * r);
  }
}

// y = x @ w^T with w given as integer blocks (see Quantized): q int8 [out, in] or uint8
// [out, in / 2], scale and offset float32 [out, in / 32]. `norm`: empty, or an RMSNorm weight
// [in] applied to x first (RmsNorm, with `eps`), in place of XLA's four small operations.
ffi::Error BlockMatmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::F32> norm, float eps,
                       ffi::ResultBuffer<ffi::F32> y) {
  const Timed timed{kBlocks};
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  const bool u8 = q.element_type() == ffi::DataType::U8;
  if (!u8 && q.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("block_matmul: q must be int8 or uint8");
  }
  if (!OneMatrix(qd) || !OneMatrix(sd) || xd.size() < 1) {
    return ffi::Error::InvalidArgument("block_matmul: x [..., in] and one weight matrix expected");
  }
  const int64_t in = xd.back(), out = qd[qd.size() - 2];
  if (in % kBlock != 0 || qd.back() != (u8 ? in / 2 : in) || sd[sd.size() - 2] != out ||
      sd.back() != in / kBlock || offset.element_count() != scale.element_count()) {
    return ffi::Error::InvalidArgument("block_matmul: q, scale and offset do not match x's width");
  }
  if (norm.element_count() != 0 && norm.element_count() != in) {
    return ffi::Error::InvalidArgument("block_matmul: the norm weight does not match x's width");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  const int64_t rows = x.element_count() / std::max<int64_t>(in, 1);
  thread_local std::vector<float> normed;  // this call's normalised rows (one call per thread)
  if (norm.element_count() == in) {
    normed.resize(rows * in);
    RmsNorm(x.typed_data(), norm.typed_data(), eps, rows, in, normed.data());
    job->x = normed.data();
  }
  job->w = nullptr;
  job->qw = Quantized{q.untyped_data(), scale.typed_data(), offset.typed_data(), u8 ? 4 : 8};
  job->y = y->typed_data();
  job->in = in;
  job->out = out;
  job->m = x.element_count() / std::max<int64_t>(in, 1);
  Launch(job);
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// Attention of a few new tokens (decode steps, verify passes over small trees) to a KV cache.
//
// XLA's CPU backend hands the two products of such an attention to a general matrix library
// that transposes the cached keys on every call: on a 2-core EPYC about 70 us per layer for a
// 256-slot cache and 210 us for 1024 slots, more than the layer's weights take. Here each
// query row reads each key and value row once, in place, and skips slots its bias hides.
//
// out[b, k, m] = softmax over (cached slots s, new tokens j) of q[b, k, m] . key + bias, applied
// to the values, where m = g * T + t (query head g of kv head k, new token t), the cache part
// uses keys/values kc, vc [B, K, S, Dh] and bias bc [B, Tc, S] (Tc = 1: shared by all t), and
// the new part kn, vn [B, K, T, Dh] with bias bn [B, T, T]. Biases are additive; one at or
// below kHidden marks a slot the query cannot see (its weight is exactly zero).

constexpr float kHidden = -1e37f;

// exp(x) for x <= 0 (lanes of W floats): Cody-Waite range reduction and a degree-6 polynomial,
// within about 2 ulp of expf; x below -87 gives about 1e-38 instead of 0.
inline vf ExpNonPositive(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;
  const vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + (vf{} - 0.5f), vi), vf);
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<vf>(e);
}

struct AttnJob {
  const float *q, *kc, *vc, *bc, *kn, *vn, *bn;
  float* out;
  int64_t B, K, M, T, S, Tc, D;
};

// Sum of the lanes as a tree (shuffles), for the many short dot products of attention.
inline float TreeSum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s[W];
  __builtin_memcpy(s, &v, sizeof(v));
  for (int w = W / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
#endif
}

// One query row with C = D / W vectors per head: scores into `sc` (S + T floats; -inf where
// hidden), weights in place of them, then the weighted sum of values kept in registers.
template <int C>
void AttendRow(const AttnJob& a, int64_t b, int64_t k, int64_t m, float* sc) {
  const int64_t t = m % a.T, D = a.D;
  const float* q = a.q + ((b * a.K + k) * a.M + m) * D;
  const float* bias_c = a.bc + (b * a.Tc + (a.Tc == 1 ? 0 : t)) * a.S;
  const float* bias_n = a.bn + (b * a.T + t) * a.T;
  const float* kc = a.kc + (b * a.K + k) * a.S * D;
  const float* vc = a.vc + (b * a.K + k) * a.S * D;
  const float* kn = a.kn + (b * a.K + k) * a.T * D;
  const float* vn = a.vn + (b * a.K + k) * a.T * D;
  const int64_t n = a.S + a.T;
  auto key = [&](int64_t j) { return j < a.S ? kc + j * D : kn + (j - a.S) * D; };
  auto value = [&](int64_t j) { return j < a.S ? vc + j * D : vn + (j - a.S) * D; };
  vf qv[C];
  for (int c = 0; c < C; ++c) qv[c] = Load<vf>(q + c * W);
  auto score = [&](int64_t j, float bj) {
    const float* kj = key(j);
    vf acc = qv[0] * Load<vf>(kj);
    for (int c = 1; c < C; ++c) acc += qv[c] * Load<vf>(kj + c * W);
    return TreeSum(acc) + bj;
  };
  const float inf = __builtin_inff();
  float mx = -inf;
  for (int pass = 0; pass < 2 && mx == -inf; ++pass) {  // pass 1: nothing visible (never so for
    for (int64_t j = 0; j < n; ++j) {                   // a causal or tree mask): no slot hidden
      const float bj = j < a.S ? bias_c[j] : bias_n[j - a.S];
      sc[j] = (pass == 0 && bj <= kHidden) ? -inf : score(j, bj);
      mx = std::max(mx, sc[j]);
    }
  }
  for (int64_t j = n; j < n + W; ++j) sc[j] = -inf;
  for (int64_t j = 0; j < n; j += W) {
    const vf x = Load<vf>(sc + j);
    const vf e = ExpNonPositive(x - mx);
    const vf w = x == -inf ? vf{} : e;
    __builtin_memcpy(sc + j, &w, sizeof(w));
  }
  vf out[C] = {};
  float denom = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float w = sc[j];
    if (w == 0.f) continue;
    denom += w;
    const float* vj = value(j);
    for (int c = 0; c < C; ++c) out[c] += w * Load<vf>(vj + c * W);
  }
  float* o = a.out + ((b * a.K + k) * a.M + m) * D;
  for (int c = 0; c < C; ++c) {
    const vf r = out[c] / denom;
    __builtin_memcpy(o + c * W, &r, sizeof(r));
  }
}

using AttendFn = void (*)(const AttnJob&, int64_t, int64_t, int64_t, float*);

struct AttnTask : Task {
  AttnJob a;
  AttendFn row;
  int64_t rows, per;
  void Chunk(int64_t c) override {
    thread_local std::vector<float> sc;  // scores of one query row, reused across calls
    const size_t need = static_cast<size_t>(a.S + a.T + 2 * W);
    if (sc.size() < need) sc.resize(need);
    for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
      row(a, r / (a.K * a.M), (r / a.M) % a.K, r % a.M, sc.data());
    }
  }
};
constexpr int kMaxChunks = 16;  // head dims up to 16 vectors (256 on AVX-512, 128 on AVX2)

template <int C>
AttendFn AttendFor(int64_t chunks) {
  if constexpr (C > kMaxChunks) {
    return nullptr;
  } else {
    return chunks == C ? &AttendRow<C> : AttendFor<C + 1>(chunks);
  }
}

ffi::Error Attend(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                  ffi::Buffer<ffi::F32> bc, ffi::Buffer<ffi::F32> kn, ffi::Buffer<ffi::F32> vn,
                  ffi::Buffer<ffi::F32> bn, ffi::ResultBuffer<ffi::F32> out) {
  const Timed timed{kAttend};
  const auto qd = q.dimensions(), cd = kc.dimensions(), nd = kn.dimensions(), bcd = bc.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || nd.size() != 4 || bcd.size() != 3 ||
      bn.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("attend: q, caches, new keys [B, K, *, D], biases [B, *, *]");
  }
  AttnJob a{q.typed_data(), kc.typed_data(), vc.typed_data(), bc.typed_data(), kn.typed_data(),
            vn.typed_data(), bn.typed_data(), out->typed_data(),
            qd[0], qd[1], qd[2], nd[2], cd[2], bcd[1], qd[3]};
  if (cd[0] != a.B || cd[1] != a.K || cd[3] != a.D || nd[0] != a.B || nd[1] != a.K ||
      nd[3] != a.D || a.T < 1 || a.M % a.T != 0 || bcd[0] != a.B || bcd[2] != a.S ||
      (a.Tc != 1 && a.Tc != a.T) || vc.element_count() != kc.element_count() ||
      vn.element_count() != kn.element_count() || bn.element_count() != a.B * a.T * a.T) {
    return ffi::Error::InvalidArgument("attend: operand shapes do not match");
  }
  const AttendFn row = a.D % W == 0 ? AttendFor<1>(a.D / W) : nullptr;
  if (row == nullptr) {
    return ffi::Error::InvalidArgument("attend: head dim must be a multiple of the vector width, "
                                       "at most 16 vectors");
  }
  auto task = std::make_shared<AttnTask>();
  task->a = a;
  task->row = row;
  task->rows = a.B * a.K * a.M;
  // Query rows are spread over the pool a few at a time, taken as threads come free (a row is
  // computed by one thread, so its result does not depend on the split); small calls (a draft
  // head's short cache) stay on the calling thread.
  task->per = std::max<int64_t>(1, (task->rows + 63) / 64);
  task->chunks = (task->rows + task->per - 1) / task->per;
  if (task->rows * (a.S + a.T) * a.D < (int64_t{1} << 15) || task->chunks == 1) {
    for (int64_t c = 0; c < task->chunks; ++c) task->Chunk(c);
  } else {
    Pool::Get().Run(task);
  }
  return ffi::Error::Success();
}

}  // namespace

// out[2 k], out[2 k + 1]: nanoseconds inside kernel k (SmallMatmul, BlockMatmul, Attend) and its
// calls so far.
extern "C" void EagleJaxTimeInside(int64_t* out) {
  for (int k = 0; k < kKernels; ++k) {
    out[2 * k] = g_inside_ns[k].load(std::memory_order_relaxed);
    out[2 * k + 1] = g_calls[k].load(std::memory_order_relaxed);
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleJaxSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleJaxBlockMatmul, BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleJaxAttend, Attend,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
