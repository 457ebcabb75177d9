// Running a kernel's work in parts on plain threads (no OpenMP). A model step makes ~150 such
// calls of 0.05-5 ms, so the threads are kept: one pool per process, shared by every native
// module that includes this header (each module calls share_pool() at import; the pool is
// found through an attribute of Python's sys module), so two modules never keep two sets of
// workers spinning on the same cores.
//
// Parts are claimed one at a time, by the calling thread and up to threads - 1 workers, from
// one atomic counter. On a small machine another process (SGLang's tokenizer or detokenizer)
// can hold a core for a time slice; a worker that is not running then claims nothing, and the
// caller runs its parts instead of waiting for it at a join. So callers split the work into
// more parts than threads (several per thread), each small.
//
// Between jobs the workers spin for up to kSpinMicros, then sleep on a condition variable; a
// job wakes sleeping workers only (a broadcast is a syscall).
// Calls are serialised (one job at a time), and a process forked from one that had workers
// makes a pool of its own: a fork handler forgets the parent's pool in the child, so a call
// finds its pool with one atomic load (no lock and no getpid syscall on a path taken ~150
// times a step).
#pragma once

#include <pthread.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace rhyme_parts {

constexpr int kSpinMicros = 1000;

// Spins before sleeping (yielding now and then, for threads that share the core): the next
// call of a model step comes within tens to hundreds of microseconds (Python between kernels),
// and waking a sleeping thread costs about as much as the work of a small call. 50 us let the
// workers fall asleep inside a step: a batch-1 SmolLM2 step spent ~12% of its main thread in
// the wake-up broadcast, and ran 44-63 ms against 38-55 ms with 1000 us (AVX2 EPYC, 2 kernel
// threads, alternating runs). After a step the workers sleep within 1 ms.
inline bool spin_until(const std::function<bool()>& ready) {
    const auto stop = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 1;; ++i) {
        if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if ((i & 63) == 0) {
            if (std::chrono::steady_clock::now() > stop) return false;
            std::this_thread::yield();  // let a thread that shares this core run
        }
    }
}

class Pool;

// What the modules of one process share: the pool (forgotten in a forked child) and the
// guard of its creation.
struct Registry {
    std::mutex guard;
    std::atomic<Pool*> pool{nullptr};
};

// This module's pointer to the process's registry (set by share_pool at import).
inline Registry*& registry_slot() {
    static Registry* slot = nullptr;
    return slot;
}

// In a forked child (one thread, none of the parent's workers): no pool yet, and a fresh guard
// (the parent may have held it). The parent's pool is leaked on purpose: its workers never
// join, and the child's copy of it (and of its mutexes) is never touched.
inline void forget_pool_in_child() {
    if (Registry* reg = registry_slot()) {
        new (&reg->guard) std::mutex();
        reg->pool.store(nullptr);
    }
}

// Sets this module's registry and its fork handler (once per module).
inline void use_registry(Registry* reg) {
    static bool handler = false;
    registry_slot() = reg;
    if (!handler) {
        pthread_atfork(nullptr, nullptr, &forget_pool_in_child);
        handler = true;
    }
}

class Pool {
  public:
    // This process's pool (workers are made on first need).
    static Pool& instance() {
        Registry* reg = registry_slot();
        if (reg == nullptr) {  // share_pool() not called: a pool of its own
            reg = new Registry();
            use_registry(reg);
        }
        if (Pool* pool = reg->pool.load(std::memory_order_acquire)) return *pool;
        std::lock_guard<std::mutex> lock(reg->guard);
        if (reg->pool.load() == nullptr) reg->pool.store(new Pool());  // leaked: workers never join at exit
        return *reg->pool.load();
    }

    // part_fn(0 .. parts - 1), on the caller and up to `helpers` workers; the first error is
    // rethrown once every part has run.
    void run(int64_t parts, int64_t helpers, const std::function<void(int64_t)>& part_fn) {
        std::lock_guard<std::mutex> call(call_);
        std::vector<std::exception_ptr> errors(static_cast<size_t>(parts));
        std::function<void(int64_t)> guarded = [&](int64_t part) {
            try {
                part_fn(part);
            } catch (...) {
                errors[static_cast<size_t>(part)] = std::current_exception();
            }
        };
        uint64_t generation;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            while (static_cast<int64_t>(workers_) < helpers) {
                std::thread(&Pool::work, this, static_cast<int64_t>(workers_),
                            generation_.load()).detach();
                ++workers_;
            }
            job_ = &guarded;
            parts_ = parts;
            helpers_ = helpers;
            finished_.store(0);
            generation = generation_.load() + 1;
            next_.store(generation << 32);  // this job's claims start at part 0
            generation_.store(generation);  // under the mutex: a worker reads the job with it
        }
        if (sleepers_.load() > 0) wake_.notify_all();  // a broadcast costs a syscall or more
        claim(generation, parts, guarded);
        if (!spin_until([&] { return finished_.load() == parts; })) {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [&] { return finished_.load() == parts; });
        }
        for (auto& e : errors)
            if (e) std::rethrow_exception(e);
    }

  private:
    Pool() = default;

    // Runs parts of job `generation` while any is left. The counter holds the job's
    // generation (high 32 bits) and its next part: a thread still holding an older job
    // claims nothing of a newer one.
    void claim(uint64_t generation, int64_t parts, const std::function<void(int64_t)>& job) {
        for (;;) {
            uint64_t seen = next_.load();
            if ((seen >> 32) != (generation & 0xffffffffu)) return;
            const int64_t part = static_cast<int64_t>(seen & 0xffffffffu);
            if (part >= parts) return;
            if (!next_.compare_exchange_weak(seen, seen + 1)) continue;
            job(part);
            if (finished_.fetch_add(1) + 1 == parts) {
                std::lock_guard<std::mutex> lock(mutex_);  // the caller may be about to sleep
                done_.notify_one();
            }
        }
    }

    void work(int64_t index, uint64_t seen) {
        for (;;) {
            if (!spin_until([&] { return generation_.load() != seen; })) {
                std::unique_lock<std::mutex> lock(mutex_);
                ++sleepers_;  // under the mutex, so a caller that sets the generation after it sees it
                wake_.wait(lock, [&] { return generation_.load() != seen; });
                --sleepers_;
            }
            const std::function<void(int64_t)>* job;
            int64_t parts, helpers;
            {
                // the generation, its job and its size, read together (a job this worker
                // takes no part in may already have been followed by the next)
                std::lock_guard<std::mutex> lock(mutex_);
                seen = generation_.load();
                job = job_;
                parts = parts_;
                helpers = helpers_;
            }
            if (index < helpers) claim(seen, parts, *job);
        }
    }

    std::mutex call_;   // one job at a time
    std::mutex mutex_;  // job_, parts_ and helpers_, and the sleeping side of the counters
    std::condition_variable wake_, done_;
    size_t workers_ = 0;
    std::atomic<uint64_t> generation_{0};
    std::atomic<uint64_t> next_{0};  // (generation << 32) | next part to claim
    std::atomic<int64_t> finished_{0};
    std::atomic<int> sleepers_{0};  // workers waiting on wake_
    const std::function<void(int64_t)>* job_ = nullptr;
    int64_t parts_ = 0, helpers_ = 0;
};

// At module import (the GIL held): use the process's registry, made by the first module that
// asks, so every module runs its parts on one pool.
inline void share_pool() {
    namespace py = pybind11;
    py::module_ sys = py::module_::import("sys");
    const char* name = "_rhyme_parts_registry";
    if (!py::hasattr(sys, name))
        sys.attr(name) = py::capsule(new Registry(), name);  // lives as long as the process
    use_registry(sys.attr(name).cast<py::capsule>().get_pointer<Registry>());
}

// run_part(0 .. parts - 1) on up to `threads` threads (the caller's included).
template <typename F>
void run_in_parts(int64_t parts, int64_t threads, F&& run_part) {
    if (parts <= 0) return;
    if (parts == 1 || threads <= 1) {
        for (int64_t part = 0; part < parts; ++part) run_part(part);
        return;
    }
    const int64_t helpers = std::min<int64_t>(threads, parts) - 1;
    Pool::instance().run(parts, helpers, std::function<void(int64_t)>(run_part));
}

// Parts for `items` units of work on `threads` threads: several per thread (see above), at
// most one per item.
inline int64_t parts_for(int64_t items, int64_t threads) {
    if (threads <= 1 || items <= 1) return 1;
    return std::min<int64_t>(items, 4 * threads);
}

}  // namespace rhyme_parts
