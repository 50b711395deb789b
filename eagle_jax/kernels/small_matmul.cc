// y[m, o] = sum_i x[m, i] * w[o, i] for a few rows m: a weight-streaming matrix product.
//
// XLA's CPU backend emits a fast matrix-vector loop when x has one row, but hands 2..16 rows to
// a general matrix-matrix routine that is far slower per byte of weights at these shapes, so a
// target pass over a handful of speculative tokens costs about twice a one-token pass. This
// kernel reads each weight row once for all rows of x (which stay in L1) and splits the output
// rows over a small pool of worker threads. Built on first use by eagle_jax/kernels/__init__.py.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <cstdint>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(v8 v) {
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += v[j];
  return s;
}

// Rows [o_begin, o_end) of y for the token rows [m0, m0 + TM), R weight rows at a time; TM x R
// accumulators, TM x vectors and one weight vector fit the 16 vector registers of AVX2.
template <int TM, int R>
void Block(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t m0,
           int64_t o_begin, int64_t o_end) {
  const int64_t in8 = in & ~int64_t{7};
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) {
    v8 acc[R][TM] = {};
    for (int64_t i = 0; i < in8; i += 8) {
      v8 xv[TM];
      for (int t = 0; t < TM; ++t) xv[t] = load8(x + (m0 + t) * in + i);
      for (int r = 0; r < R; ++r) {
        const v8 wv = load8(w + (o + r) * in + i);
        for (int t = 0; t < TM; ++t) acc[r][t] += wv * xv[t];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TM; ++t) {
        float s = hsum(acc[r][t]);
        for (int64_t i = in8; i < in; ++i) s += w[(o + r) * in + i] * x[(m0 + t) * in + i];
        y[(m0 + t) * out + o + r] = s;
      }
    }
  }
  for (; o < o_end; ++o) {  // the last rows, fewer than R
    for (int t = 0; t < TM; ++t) {
      float s = 0.f;
      for (int64_t i = 0; i < in; ++i) s += w[o * in + i] * x[(m0 + t) * in + i];
      y[(m0 + t) * out + o] = s;
    }
  }
}

constexpr int64_t kSplit = 8;  // threads split the output rows in multiples of this

// All token rows for weight rows [o_begin, o_end): the rows are walked in chunks that stay in
// L1 (about 24 KB) while every group of up to 3 token rows passes over them, so weights come
// from memory once.
void Rows(const float* x, const float* w, float* y, int64_t m, int64_t in, int64_t out,
          int64_t o_begin, int64_t o_end) {
  const int64_t chunk = std::max<int64_t>(kSplit, 24576 / (4 * std::max<int64_t>(in, 1)) / kSplit * kSplit);
  for (int64_t c = o_begin; c < o_end; c += chunk) {
    const int64_t e = std::min(o_end, c + chunk);
    int64_t m0 = 0;
    for (; m0 + 3 <= m; m0 += 3) Block<3, 4>(x, w, y, in, out, m0, c, e);
    if (m - m0 == 2) Block<2, 4>(x, w, y, in, out, m0, c, e);
    if (m - m0 == 1) Block<1, 4>(x, w, y, in, out, m0, c, e);
  }
}

// A small private worker pool. XLA may run several independent custom calls at once on its
// own pool, so a call that blocked waiting on tasks queued there could deadlock; here the
// calling thread takes chunks of its own job until none are left, and only then waits for
// chunks that workers are already running.
struct Job {
  const float *x, *w;
  float* y;
  int64_t m, in, out, per, chunks;
  std::atomic<int64_t> next{0}, done{0};
  void Work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Rows(x, w, y, m, in, out, c * per, std::min(out, (c + 1) * per));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool();  // never destroyed: workers live as long as the process
    return *pool;
  }
  int64_t size() const { return static_cast<int64_t>(workers_) + 1; }
  void Run(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int64_t i = 1; i < job->chunks && i <= static_cast<int64_t>(workers_); ++i) queue_.push_back(job);
    }
    cv_.notify_all();
    job->Work();
    while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  }

 private:
  Pool() : workers_(std::max(1u, std::thread::hardware_concurrency()) - 1) {
    for (unsigned i = 0; i < workers_; ++i) std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job->Work();
    }
  }
  unsigned workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
};

ffi::Error SmallMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  // w may carry leading dims of size 1 (jax.vmap over x alone, vmap_method="expand_dims").
  bool shared_w = wd.size() >= 2;
  for (size_t i = 0; i + 2 < wd.size(); ++i) shared_w = shared_w && wd[i] == 1;
  if (!shared_w || xd.size() < 1 || xd.back() != wd[wd.size() - 1]) {
    return ffi::Error::InvalidArgument("small_matmul: x [..., in] and one w [out, in] expected");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->in = wd[wd.size() - 1];
  job->out = wd[wd.size() - 2];
  job->m = x.element_count() / std::max<int64_t>(job->in, 1);
  Pool& pool = Pool::Get();
  // Chunks of whole row blocks; at least 256 rows each, so tiny matrices run on one thread.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.size(), job->out / 256));
  job->per = ((job->out + parts - 1) / parts + kSplit - 1) / kSplit * kSplit;
  job->chunks = (job->out + job->per - 1) / job->per;
  if (job->chunks <= 1) {
    Rows(job->x, job->w, job->y, job->m, job->in, job->out, 0, job->out);
  } else {
    pool.Run(job);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleJaxSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
