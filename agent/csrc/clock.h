// The clock every stamp of syncscope's C++ library is read from: CLOCK_MONOTONIC in ns, which is
// Python's time.perf_counter_ns on Linux, so the agent compares them with its own directly.
#pragma once

#include <cstdint>
#include <ctime>

namespace syncscope {

inline int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// CLOCK_REALTIME in ns: Python's time.time_ns, the clock Flight Recorder stamps its entries with.
inline int64_t wall_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

}  // namespace syncscope
