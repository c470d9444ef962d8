// rmacomm's stream-ordered signals as kernels: what a CUDA graph can replay
// (a stream memory operation's value is fixed when it is captured) and what
// runs where the driver has no stream memory operations. Every word is
// 8-byte aligned, in device memory or host memory registered with the
// device; each word has one writer at a time.
typedef unsigned long long u64;

// One more signal: the count in `word` (this rank's slot in the peer's
// signal buffer, which only this rank writes) goes up by one, after
// everything the stream did before is visible system-wide.
extern "C" __global__ void rmacomm_signal_next(volatile u64* word) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        __threadfence_system();
        *word = *word + 1;
        __threadfence_system();
    }
}

// The next signal: waits until `word` (the peer's slot in this rank's
// signal buffer) reaches one more than `taken` (this rank's count of the
// peer's signals taken), then counts it taken. First it writes what it
// waits for into `want` (host memory the host's watchdog reads: a wait
// whose `want` is above its word is one in flight, whose peer may be gone).
extern "C" __global__ void rmacomm_wait_next(volatile u64* taken, const volatile u64* word, volatile u64* want) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u64 w = *taken + 1;
        *want = w;
        __threadfence_system();
        while (*word < w) __nanosleep(100);
        *taken = w;
        __threadfence_system();
    }
}

// Waits until `word` (the peer's count of what it took of this rank's
// sends, in this rank's memory) reaches `*bound` (this rank's count of
// sends, in the peer's memory, which only this rank writes): every chunk
// sent before was taken. The next signal_next on the bound sends one more.
// `want` as for rmacomm_wait_next.
extern "C" __global__ void rmacomm_wait_reach(const volatile u64* word, const volatile u64* bound, volatile u64* want) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u64 w = *bound;
        *want = w;
        __threadfence_system();
        while (*word < w) __nanosleep(100);
        __threadfence_system();
    }
}
