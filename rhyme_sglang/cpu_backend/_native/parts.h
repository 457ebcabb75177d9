// Running a kernel's work in parts on plain threads (no OpenMP): parts 0 .. parts-2 run on
// the workers of a pool kept for the process, the last part on the calling thread; the first
// error is rethrown. A model step makes ~150 such calls of 0.05-5 ms, so starting threads per
// call (20-60 us each) would eat much of what a second core gives. Between calls the workers
// spin for up to kSpinMicros, then sleep on a condition variable. Calls are serialised (one
// job at a time), and a process forked from one that had workers starts a pool of its own.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rhyme_parts {

constexpr int kSpinMicros = 50;

// Spins a little before sleeping (yielding now and then, for threads that share the core):
// the next call of a model step usually comes within tens of microseconds, and waking a
// sleeping thread costs about as much as the work of a small call.
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

class Pool {
  public:
    // This process's pool (each native module has its own; workers are made on first need).
    static Pool& instance() {
        static std::mutex guard;
        static Pool* pool = nullptr;
        std::lock_guard<std::mutex> lock(guard);
        if (pool == nullptr || pool->owner_ != getpid())
            pool = new Pool();  // leaked on purpose: workers never join at exit, and a fork's
                                // copy of the parent's pool (and its mutexes) is never touched
        return *pool;
    }

    void run(int64_t parts, const std::function<void(int64_t)>& part_fn) {
        std::lock_guard<std::mutex> call(call_);
        std::vector<std::exception_ptr> errors(static_cast<size_t>(parts));
        std::function<void(int64_t)> guarded = [&](int64_t part) {
            try {
                part_fn(part);
            } catch (...) {
                errors[static_cast<size_t>(part)] = std::current_exception();
            }
        };
        {
            std::lock_guard<std::mutex> lock(mutex_);
            while (static_cast<int64_t>(workers_) < parts - 1) {
                std::thread(&Pool::work, this, static_cast<int64_t>(workers_),
                            generation_.load()).detach();
                ++workers_;
            }
            job_ = &guarded;
            parts_ = parts;
            pending_.store(parts - 1);
            generation_.fetch_add(1);  // under the mutex: a worker reads the job with it
        }
        wake_.notify_all();
        guarded(parts - 1);
        if (!spin_until([&] { return pending_.load() == 0; })) {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [&] { return pending_.load() == 0; });
        }
        for (auto& e : errors)
            if (e) std::rethrow_exception(e);
    }

  private:
    Pool() : owner_(getpid()) {}

    void work(int64_t index, uint64_t seen) {
        for (;;) {
            if (!spin_until([&] { return generation_.load() != seen; })) {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return generation_.load() != seen; });
            }
            const std::function<void(int64_t)>* job;
            int64_t parts;
            {
                // the generation, its job and its size, read together (a job this worker
                // takes no part in may already have been followed by the next)
                std::lock_guard<std::mutex> lock(mutex_);
                seen = generation_.load();
                job = job_;
                parts = parts_;
            }
            if (index >= parts - 1) continue;  // this job needs fewer workers
            (*job)(index);
            if (pending_.fetch_sub(1) == 1) {
                std::lock_guard<std::mutex> lock(mutex_);  // the caller may be about to sleep
                done_.notify_one();
            }
        }
    }

    const pid_t owner_;
    std::mutex call_;   // one job at a time
    std::mutex mutex_;  // job_ and parts_, and the sleeping side of the counters
    std::condition_variable wake_, done_;
    size_t workers_ = 0;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int64_t> pending_{0};
    const std::function<void(int64_t)>* job_ = nullptr;
    int64_t parts_ = 0;
};

template <typename F>
void run_in_parts(int64_t parts, F&& run_part) {
    if (parts <= 1) {
        if (parts == 1) run_part(0);
        return;
    }
    Pool::instance().run(parts, std::function<void(int64_t)>(run_part));
}

}  // namespace rhyme_parts
