/* nxdt.comm._native: the shm transport's hot loop in C (see nxdt/comm/native.py for the Python side).
 *
 * Three things, all on plain addresses handed over by Python (no Python objects are touched while the
 * GIL is released):
 *   reduce()          out = op(parts[0], parts[1], ...) in the given order, element by element; fp16/bf16
 *                     are accumulated in fp32 and rounded once, so the bits equal nxdt.comm.reduce's torch path;
 *   wait() / set_progress()
 *                     the channel's progress words: spin briefly (adaptive, ≤ 120 µs), poll with sched_yield
 *                     (up to WaitPolicy.spin_s on a rank that has a core), then futex, announcing the sleep in
 *                     the W_SLEEP word so writers wake only when somebody sleeps (nxdt/comm/shm.py);
 *   all_reduce_step() one step of the direct or the slice all-reduce: slot free? fingerprint, copy in, publish,
 *                     wait for every peer, compare fingerprints, reduce (everything, or my slice and mark it),
 *                     (slice: copy the peers' reduced slices out), done.
 * A wait never blocks longer than BLOCK_NS: it returns "pending" and the Python layer checks its deadline
 * and the peers' liveness, then calls again. So timeouts and dead-peer errors stay in Python.
 *
 * Kernels are compiled for AVX-512, AVX2 and baseline x86-64 (target_clones: the loader picks one by
 * CPUID at first call); plain C elsewhere. -ffp-contract=off: no FMA may change the bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifndef __linux__
#error "nxdt.comm._native needs Linux (futex); the torch fallback is used elsewhere"
#endif
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#define CLONES
#endif

/* ---------------------------------------------------------------------------------------------- reductions */
/* codes: nxdt.comm.reduce.DTYPES / REDUCE_OPS index + 1 */
enum { D_F32 = 1, D_F16, D_BF16, D_I32, D_I64, D_U8, D_F64 };
enum { OP_SUM = 1, OP_AVG, OP_MIN, OP_MAX, OP_PROD };
#define BLOCK 1024 /* elements per pass over all members: the fp32 accumulator stays in L1 */

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_load(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t bf16_store(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u = f32_bits(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}
/* IEEE half <-> float, branch-free so the loops vectorise; round to nearest even like F16C / c10::Half */
static inline float f16_load(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7FFFu;
    uint32_t normal = (em << 13) + 0x38000000u;
    uint32_t special = (em << 13) | 0x7F800000u;
    uint32_t sub = f32_bits((float)em * 0x1p-24f);
    return bits_f32(sign | (em >= 0x7C00u ? special : em < 0x400u ? sub : normal));
}
static inline uint16_t f16_store(float f) {
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, x = u & 0x7FFFFFFFu;
    uint32_t normal = (x + 0xC8000FFFu + ((x >> 13) & 1u)) >> 13;      /* rebias exponent, round */
    uint32_t sub = f32_bits(bits_f32(x) + 0.5f) - 0x3F000000u;         /* the FPU rounds to 2^-24 */
    uint32_t big = x > 0x7F800000u ? 0x7E00u : 0x7C00u;               /* NaN : overflow to inf */
    uint32_t r = x >= 0x477FF000u ? big : x < 0x38800000u ? sub : normal;
    return (uint16_t)(sign | r);
}

#define IDENT(x) (x)
#define WRAP_ADD(T, U) ((T)((U)(a) + (U)(b)))
#define MIN_(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b)) /* NaN wins, like torch.minimum */
#define MAX_(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))

/* One kernel per storage type T, accumulating in ACC. Every block of BLOCK elements is loaded from every
 * member before it is stored, so ``out`` may be one of ``parts``. ``out2``, if not NULL, gets the same result
 * (the slice all-reduce's reduced slice goes to the caller's tensor and to its slot for the peers, in one pass).
 * Two-operand sums (the 2-rank all-reduce) take a fused loop: no accumulator round trip through L1. */
#define REDUCE_KERNEL(NAME, T, ACC, U, LOAD, STORE)                                                        \
    CLONES static void NAME(void *out_, void *out2_, void *const *parts, int n, int64_t count, int op, int divisor) { \
        T *out = (T *)out_, *out2 = (T *)out2_;                                                           \
        if (n == 2 && op == OP_SUM) {                                                                     \
            const T *a = (const T *)parts[0], *c = (const T *)parts[1];                                   \
            if (out2)                                                                                     \
                for (int64_t i = 0; i < count; i++) {                                                     \
                    T v = STORE((ACC)((U)LOAD(a[i]) + (U)LOAD(c[i])));                                    \
                    out[i] = v, out2[i] = v;                                                              \
                }                                                                                         \
            else                                                                                          \
                for (int64_t i = 0; i < count; i++) out[i] = STORE((ACC)((U)LOAD(a[i]) + (U)LOAD(c[i])));  \
            return;                                                                                       \
        }                                                                                                 \
        ACC acc[BLOCK];                                                                                   \
        for (int64_t b = 0; b < count; b += BLOCK) {                                                      \
            const int64_t len = count - b < BLOCK ? count - b : BLOCK;                                    \
            const T *p = (const T *)parts[0] + b;                                                         \
            for (int64_t i = 0; i < len; i++) acc[i] = LOAD(p[i]);                                        \
            for (int j = 1; j < n; j++) {                                                                 \
                p = (const T *)parts[j] + b;                                                              \
                if (op == OP_SUM || op == OP_AVG)                                                         \
                    for (int64_t i = 0; i < len; i++) acc[i] = (ACC)((U)acc[i] + (U)LOAD(p[i]));          \
                else if (op == OP_MIN)                                                                    \
                    for (int64_t i = 0; i < len; i++) { ACC v = LOAD(p[i]); acc[i] = MIN_(acc[i], v); }   \
                else if (op == OP_MAX)                                                                    \
                    for (int64_t i = 0; i < len; i++) { ACC v = LOAD(p[i]); acc[i] = MAX_(acc[i], v); }   \
                else                                                                                      \
                    for (int64_t i = 0; i < len; i++) acc[i] = (ACC)((U)acc[i] * (U)LOAD(p[i]));          \
            }                                                                                             \
            if (op == OP_AVG)                                                                             \
                for (int64_t i = 0; i < len; i++) acc[i] = acc[i] / (ACC)divisor;                         \
            for (int64_t i = 0; i < len; i++) out[b + i] = STORE(acc[i]);                                 \
            if (out2) memcpy(out2 + b, out + b, (size_t)len * sizeof(T)); /* still in L1 */              \
        }                                                                                                 \
    }

/* U: the type the add/multiply runs in — unsigned for integers (wrap-around, as torch's) */
REDUCE_KERNEL(reduce_f32, float, float, float, IDENT, IDENT)
REDUCE_KERNEL(reduce_f64, double, double, double, IDENT, IDENT)

/* fp16: converted a block at a time by F16C / AVX-512 (vcvtph2ps, vcvtps2ph: round to nearest even) where the
 * CPU has them — the branch-free C conversion above does not vectorise well — and combined as fp32 */
typedef void (*widen_fn)(float *, const uint16_t *, int64_t);
typedef void (*narrow_fn)(uint16_t *, const float *, int64_t);

static void widen_c(float *dst, const uint16_t *src, int64_t len) { for (int64_t i = 0; i < len; i++) dst[i] = f16_load(src[i]); }
static void narrow_c(uint16_t *dst, const float *src, int64_t len) { for (int64_t i = 0; i < len; i++) dst[i] = f16_store(src[i]); }
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void widen_avx512(float *dst, const uint16_t *src, int64_t len) {
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    widen_c(dst + i, src + i, len - i);
}
__attribute__((target("avx512f"))) static void narrow_avx512(uint16_t *dst, const float *src, int64_t len) {
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    narrow_c(dst + i, src + i, len - i);
}
__attribute__((target("avx,f16c"))) static void widen_f16c(float *dst, const uint16_t *src, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    widen_c(dst + i, src + i, len - i);
}
__attribute__((target("avx,f16c"))) static void narrow_f16c(uint16_t *dst, const float *src, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    narrow_c(dst + i, src + i, len - i);
}
#endif
static widen_fn widen = widen_c;
static narrow_fn narrow = narrow_c;

static void pick_f16_conversions(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) widen = widen_avx512, narrow = narrow_avx512;
    else if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) widen = widen_f16c, narrow = narrow_f16c;
#endif
}

CLONES static void combine_f32(float *acc, const float *v, int64_t len, int op) {
    if (op == OP_SUM || op == OP_AVG)
        for (int64_t i = 0; i < len; i++) acc[i] = acc[i] + v[i];
    else if (op == OP_MIN)
        for (int64_t i = 0; i < len; i++) acc[i] = MIN_(acc[i], v[i]);
    else if (op == OP_MAX)
        for (int64_t i = 0; i < len; i++) acc[i] = MAX_(acc[i], v[i]);
    else
        for (int64_t i = 0; i < len; i++) acc[i] = acc[i] * v[i];
}

static void reduce_f16(void *out, void *out2, void *const *parts, int n, int64_t count, int op, int divisor) {
    float acc[BLOCK], v[BLOCK];
    for (int64_t b = 0; b < count; b += BLOCK) {
        const int64_t len = count - b < BLOCK ? count - b : BLOCK;
        widen(acc, (const uint16_t *)parts[0] + b, len);
        for (int j = 1; j < n; j++) {
            widen(v, (const uint16_t *)parts[j] + b, len);
            combine_f32(acc, v, len, op);
        }
        if (op == OP_AVG)
            for (int64_t i = 0; i < len; i++) acc[i] = acc[i] / (float)divisor;
        narrow((uint16_t *)out + b, acc, len);
        if (out2) memcpy((uint16_t *)out2 + b, (uint16_t *)out + b, (size_t)len * 2);
    }
}
REDUCE_KERNEL(reduce_bf16, uint16_t, float, float, bf16_load, bf16_store)
REDUCE_KERNEL(reduce_i32, int32_t, int32_t, uint32_t, IDENT, IDENT)
REDUCE_KERNEL(reduce_i64, int64_t, int64_t, uint64_t, IDENT, IDENT)
REDUCE_KERNEL(reduce_u8, uint8_t, uint8_t, uint32_t, IDENT, IDENT)

typedef void (*reduce_fn)(void *, void *, void *const *, int, int64_t, int, int);
static const reduce_fn KERNELS[8] = {NULL, reduce_f32, reduce_f16, reduce_bf16, reduce_i32, reduce_i64, reduce_u8, reduce_f64};
static const int ELEM[8] = {0, 4, 2, 2, 4, 8, 1, 8};

/* ---------------------------------------------------------------------------------------------- waiting */
/* channel header words (int64), as nxdt/comm/shm.py */
enum { W_PROGRESS = 2, W_FP_DIGEST = 4, W_SLEEP = 10, W_FINGERPRINT = 16, FP_WORDS = 6, W_SOURCE = 32 };
/* the context array a channel hands over (nxdt.comm.native.Context) */
enum { C_N, C_ME, C_SLOT_BYTES, C_SPIN_NS, C_SPIN_BASE_NS, C_YIELDS, C_SPIN_EXTRA_NS, C_FUTEX, C_HEADERS };
#define MAX_MEMBERS 64
#define STREAM_SPIN_NS 2000      /* a stream thread barely spins: its rank's compute needs the core */
#define BLOCK_NS 20000000LL      /* back to Python at least this often while blocked: deadline, liveness */
#define SLICE_NS 5000000LL       /* one futex sleep at most */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static inline int64_t *header(const int64_t *ctx, int i) { return (int64_t *)(intptr_t)ctx[C_HEADERS + i]; }
static inline char *slot(const int64_t *ctx, int i, int64_t step) {
    return (char *)(intptr_t)ctx[C_HEADERS + ctx[C_N] + i] + (step & 1) * ctx[C_SLOT_BYTES];
}
static inline int64_t progress(const int64_t *ctx, int i) { return __atomic_load_n(header(ctx, i) + W_PROGRESS, __ATOMIC_ACQUIRE); }

static int first_missing(const int64_t *ctx, uint64_t mask, int64_t target) {
    for (int i = 0; mask; i++, mask >>= 1)
        if ((mask & 1) && progress(ctx, i) < target) return i;
    return -1;
}

static void futex_wait(int64_t *word, int64_t seen, int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    /* the low half of the little-endian int64 word; returns at once when it no longer holds ``seen`` */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
}

/* 0 when every member in ``mask`` has progress >= target; 1 when still waiting after BLOCK_NS of sleeping.
 * ``main``: the caller is its process's main thread (may spin as long as the channel's adaptive budget). */
static int wait_members(int64_t *ctx, uint64_t mask, int64_t target, int main) {
    if (first_missing(ctx, mask, target) < 0) return 0;
    int64_t start = now_ns();
    int64_t spin = main ? ctx[C_SPIN_NS] : STREAM_SPIN_NS;
    for (unsigned k = 1;; k++) {
        CPU_RELAX();
        if (first_missing(ctx, mask, target) < 0) {
            if (main) { /* spinning paid off: a free core, spin longer next time (up to 4x the base) */
                int64_t more = 2 * ctx[C_SPIN_NS], cap = 4 * ctx[C_SPIN_BASE_NS];
                ctx[C_SPIN_NS] = more < cap ? more : cap;
            }
            return 0;
        }
        if ((k & 63) == 0 && now_ns() - start > spin) break;
    }
    if (main) { /* it did not: ranks outnumber cores, every spin steals the peer's time */
        int64_t less = ctx[C_SPIN_NS] / 2, floor = ctx[C_SPIN_BASE_NS] / 16;
        ctx[C_SPIN_NS] = less > floor ? less : floor;
    }
    /* a main thread whose rank should have a core of its own keeps polling up to C_SPIN_EXTRA_NS, but yields
     * between polls: when other work shares the host a peer may be queued behind us on this very core, and a
     * pure spin would hold it off for a whole time slice (3-4 ms per call measured on a loaded 2-core host) */
    int64_t extra = main ? ctx[C_SPIN_EXTRA_NS] : 0;
    for (int64_t y = 0; y < ctx[C_YIELDS] || now_ns() - start < spin + extra; y++) {
        sched_yield();
        if (first_missing(ctx, mask, target) < 0) return 0;
    }
    int64_t *own = header(ctx, (int)ctx[C_ME]);
    int64_t nap = 20000;
    start = now_ns();
    for (int i; (i = first_missing(ctx, mask, target)) >= 0;) {
        int64_t left = BLOCK_NS - (now_ns() - start);
        if (left <= 0) return 1;
        int64_t *word = header(ctx, i) + W_PROGRESS;
        if (!ctx[C_FUTEX]) { /* poll with growing sleeps (WaitPolicy(futex=False)) */
            struct timespec ts = {0, (long)nap};
            nanosleep(&ts, NULL);
            nap = nap * 2 < 1000000 ? nap * 2 : 1000000;
            continue;
        }
        /* announce "I sleep on member i", fence, re-read: a writer stores, fences, then reads our flag */
        __atomic_store_n(own + W_SLEEP, i + 1, __ATOMIC_SEQ_CST);
        int64_t seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        if (seen < target) futex_wait(word, seen, left < SLICE_NS ? left : SLICE_NS);
        __atomic_store_n(own + W_SLEEP, 0, __ATOMIC_RELEASE);
    }
    return 0;
}

static void set_progress(int64_t *ctx, int64_t value) {
    int n = (int)ctx[C_N], me = (int)ctx[C_ME];
    int64_t *word = header(ctx, me) + W_PROGRESS;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* drains non-temporal stores of the copy before the flag */
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    for (int i = 0; i < n; i++) /* a wake is a syscall: only when a peer announced it sleeps on my word */
        if (i != me && __atomic_load_n(header(ctx, i) + W_SLEEP, __ATOMIC_SEQ_CST) == me + 1) {
            syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
            return;
        }
}

/* ---------------------------------------------------------------------------------------------- one all-reduce step */
enum { DONE = 0, PENDING_SLOT = 1, PENDING_DATA = 2, PEER_SHARED = 3, PENDING_REDUCED = 4, MISMATCH = -1 };

static uint64_t digest(const int64_t *fp, int len) { /* == nxdt.comm.shm._digest */
    uint64_t d = 0;
    for (int i = 0; i < len; i++) d = (d * 1000003u + (uint64_t)fp[i] + 1u) & 0x3FFFFFFFFFFFull;
    return d;
}

/* member i's slice [lo, hi) of a count-element step, as nxdt.comm.shm_algorithms._bounds */
static void slice_of(int64_t count, int n, int i, int64_t *lo, int64_t *hi) {
    int64_t per = (count + n - 1) / n;
    *lo = i * per < count ? i * per : count;
    *hi = (i + 1) * per < count ? (i + 1) * per : count;
}

/* One step of shm_algorithms.all_reduce for a private (non-shared) ``dst``, either algorithm:
 *   direct (sliced = 0): copy all of dst in, publish, wait, reduce everything in member order into dst, done;
 *   slice  (sliced = 1): copy in only the slices the peers reduce, publish, wait, reduce my slice into dst and
 *                        into my slot in one pass, mark it reduced, copy each peer's reduced slice out of its slot
 *                        as soon as it is marked, done. Each rank converts, adds and stores 1/n of the elements and
 *                        moves 2(n-1)/n of the bytes: for 2 ranks half the work of direct, for one synchronisation more.
 * ``phase`` 0 starts the step (again after PENDING_SLOT), 1 resumes after PENDING_DATA (published already), 2 after
 * PENDING_REDUCED (my slice reduced and marked). PEER_SHARED: published, but a peer's data lies in its shared tensor:
 * the caller finishes the step the Python way (_reduce_by_slices reads either layout). The operand order is member
 * order (my slice read from dst in my place), as the direct step's and the fallback's: every element gets the same
 * bits whichever member's slice it falls in, so cutting a message into pieces changes no bit (nxdt.parallel.overlap). */
static int all_reduce_step(int64_t *ctx, int64_t step, char *dst, int64_t count, int dtype, int op, int64_t fp0, int64_t fp_count,
                           int phase, int main, int sliced) {
    int n = (int)ctx[C_N], me = (int)ctx[C_ME];
    uint64_t peers = (n >= 64 ? ~0ull : ((1ull << n) - 1)) & ~(1ull << me);
    int64_t *own = header(ctx, me);
    int parity = (int)(step & 1);
    size_t elem = (size_t)ELEM[dtype];
    char *mine = slot(ctx, me, step);
    int64_t lo, hi;
    if (phase == 0) {
        if (step >= 2 && wait_members(ctx, peers, 3 * (step - 2) + 3, main)) return PENDING_SLOT;
        /* stored only when they change: a store takes the cache line from a peer that read it, and the peers read
         * my W_SOURCE word (a line of its own) every step; unchanged, that read stays a local hit (2 ranks, 1 KB) */
        int64_t fp[FP_WORDS] = {fp0, dtype, fp_count, 0, 0, 0}; /* the whole message's count */
        int64_t *fpw = own + W_FINGERPRINT + parity * FP_WORDS, d = (int64_t)digest(fp, 4);
        if (memcmp(fpw, fp, sizeof fp)) memcpy(fpw, fp, sizeof fp);
        if (own[W_FP_DIGEST + parity] != d) own[W_FP_DIGEST + parity] = d;
        if (own[W_SOURCE + 2 * parity] != 0) own[W_SOURCE + 2 * parity] = 0;
        if (!sliced)
            memcpy(mine, dst, (size_t)count * elem);
        else
            for (int j = 0; j < n; j++)
                if (j != me) {
                    slice_of(count, n, j, &lo, &hi);
                    memcpy(mine + lo * elem, dst + lo * elem, (size_t)(hi - lo) * elem);
                }
        set_progress(ctx, 3 * step + 1);
    }
    if (phase <= 1) {
        if (wait_members(ctx, peers, 3 * step + 1, main)) return PENDING_DATA;
        for (int i = 0; i < n; i++) {
            int64_t *h = header(ctx, i);
            if (h[W_FP_DIGEST + parity] != own[W_FP_DIGEST + parity]) return MISMATCH;
            if (h[W_SOURCE + 2 * parity] != 0) return PEER_SHARED;
        }
        void *parts[MAX_MEMBERS];
        if (!sliced) {
            for (int i = 0; i < n; i++) parts[i] = i == me ? (void *)dst : (void *)slot(ctx, i, step); /* dst still holds mine */
            KERNELS[dtype](dst, NULL, parts, n, count, op, n);
            set_progress(ctx, 3 * step + 3);
            return DONE;
        }
        slice_of(count, n, me, &lo, &hi);
        for (int i = 0; i < n; i++) parts[i] = i == me ? dst + lo * elem : slot(ctx, i, step) + lo * elem;
        if (hi > lo) KERNELS[dtype](dst + lo * elem, mine + lo * elem, parts, n, hi - lo, op, n);
        set_progress(ctx, 3 * step + 2);
    }
    /* every peer's reduced slice, whichever is marked first (none ready: wait for the lowest-numbered) */
    for (uint64_t left = peers; left;) {
        int j = -1;
        for (int i = 0; i < n; i++)
            if (((left >> i) & 1) && progress(ctx, i) >= 3 * step + 2) { j = i; break; }
        if (j < 0) {
            int first = __builtin_ctzll(left);
            if (wait_members(ctx, 1ull << first, 3 * step + 2, main)) return PENDING_REDUCED; /* resumed: copies again */
            j = first;
        }
        slice_of(count, n, j, &lo, &hi);
        memcpy(dst + lo * elem, slot(ctx, j, step) + lo * elem, (size_t)(hi - lo) * elem);
        left &= ~(1ull << j);
    }
    set_progress(ctx, 3 * step + 3);
    return DONE;
}

/* ---------------------------------------------------------------------------------------------- Python bindings */
static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int check_dtype_op(long long dtype, long long op, long long n) {
    if (dtype < 1 || dtype > 7 || op < 1 || op > 5 || n < 1 || n > MAX_MEMBERS) {
        PyErr_Format(PyExc_ValueError, "nxdt.comm._native: bad dtype %lld / op %lld / members %lld", dtype, op, n);
        return -1;
    }
    return 0;
}

/* reduce(out, parts, count, dtype, op, divisor): ``parts`` a tuple of addresses, reduced in that order */
static PyObject *py_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[6];
    if (nargs != 6 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "reduce(out, parts: tuple, count, dtype, op, divisor)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[1]);
    for (int i = 0; i < 6; i++) {
        a[i] = i == 1 ? 0 : PyLong_AsLongLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return NULL;
    }
    if (check_dtype_op(a[3], a[4], n)) return NULL;
    void *parts[MAX_MEMBERS];
    for (Py_ssize_t i = 0; i < n; i++) {
        parts[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[1], i));
        if (parts[i] == NULL && PyErr_Occurred()) return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    KERNELS[a[3]]((void *)(intptr_t)a[0], NULL, parts, (int)n, a[2], (int)a[4], (int)a[5]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* wait(ctx, mask, target, main) -> 0 done | 1 still waiting (check the deadline and the peers, call again) */
static PyObject *py_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[4];
    if (ints(args, nargs, 4, a, "wait")) return NULL;
    int64_t *ctx = (int64_t *)(intptr_t)a[0];
    if (first_missing(ctx, (uint64_t)a[1], a[2]) < 0) return PyLong_FromLong(0); /* no GIL round trip */
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = wait_members(ctx, (uint64_t)a[1], a[2], (int)a[3]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

static PyObject *py_set_progress(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[2];
    if (ints(args, nargs, 2, a, "set_progress")) return NULL;
    set_progress((int64_t *)(intptr_t)a[0], a[1]);
    Py_RETURN_NONE;
}

/* all_reduce_step(ctx, step, dst, count, dtype, op, fp0, fp_count, phase, main, sliced) -> DONE | PENDING_* | PEER_SHARED | MISMATCH */
static PyObject *py_all_reduce_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[11];
    if (ints(args, nargs, 11, a, "all_reduce_step")) return NULL;
    int64_t *ctx = (int64_t *)(intptr_t)a[0];
    if (check_dtype_op(a[4], a[5], ctx[C_N])) return NULL;
    if (a[3] * ELEM[a[4]] > ctx[C_SLOT_BYTES]) {
        PyErr_SetString(PyExc_ValueError, "nxdt.comm._native.all_reduce_step: the chunk does not fit the slot");
        return NULL;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = all_reduce_step(ctx, a[1], (char *)(intptr_t)a[2], a[3], (int)a[4], (int)a[5], a[6], a[7], (int)a[8], (int)a[9], (int)a[10]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

static PyMethodDef METHODS[] = {

    {"reduce", (PyCFunction)(void (*)(void))py_reduce, METH_FASTCALL, "reduce(out, parts, count, dtype, op, divisor)"},
    {"wait", (PyCFunction)(void (*)(void))py_wait, METH_FASTCALL, "wait(ctx, mask, target, main) -> 0 | 1"},
    {"set_progress", (PyCFunction)(void (*)(void))py_set_progress, METH_FASTCALL, "set_progress(ctx, value)"},
    {"all_reduce_step", (PyCFunction)(void (*)(void))py_all_reduce_step, METH_FASTCALL,
     "all_reduce_step(ctx, step, dst, count, dtype, op, fp0, fp_count, phase, main, sliced) -> status"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_native", "The shm transport's hot loop (see _native.c).", -1, METHODS};

PyMODINIT_FUNC PyInit__native(void) {
    pick_f16_conversions();
    PyObject *m = PyModule_Create(&MODULE);
    /* nxdt.comm.native.VERSION: a build of older source is refused (its operand order may differ from the fallback's) */
    if (m && PyModule_AddIntConstant(m, "VERSION", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
