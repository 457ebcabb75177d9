// Running a kernel's work in parts on plain threads (no OpenMP): part p runs run_part(p) on a
// thread of its own, the last part on the calling thread; the first error is rethrown.
#pragma once

#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace rhyme_parts {

template <typename F>
void run_in_parts(int64_t parts, F&& run_part) {
    std::vector<std::exception_ptr> errors(static_cast<size_t>(parts));
    auto guarded = [&](int64_t part) {
        try {
            run_part(part);
        } catch (...) {
            errors[part] = std::current_exception();
        }
    };
    std::vector<std::thread> pool;
    for (int64_t part = 0; part + 1 < parts; ++part) pool.emplace_back(guarded, part);
    guarded(parts - 1);
    for (auto& t : pool) t.join();
    for (auto& e : errors)
        if (e) std::rethrow_exception(e);
}

}  // namespace rhyme_parts
