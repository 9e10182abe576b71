/* mlx-rs seeds RandomState::new() from mach_approximate_time(), a macOS call. Elsewhere we
 * provide it over the monotonic clock: nanoseconds, like mach time on Apple Silicon. */
#if !defined(__APPLE__)
#include <stdint.h>
#include <time.h>

uint64_t mach_approximate_time(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}
#endif
