/* mlx-c's private io header formats error messages with std::format, which libstdc++
 * only ships from gcc 13 on. With an older library we provide the small subset it uses:
 * "{}" placeholders filled left to right with operator<<. */
#pragma once
#ifdef __cplusplus
#if __has_include(<format>)
#include <format>
#else
#include <sstream>
#include <string>
#include <string_view>

namespace std {
namespace mlx_engine_format_fallback {
inline void put(ostringstream& out, string_view fmt) {
  out << fmt;
}
template <class T, class... Rest>
void put(ostringstream& out, string_view fmt, const T& value, const Rest&... rest) {
  const auto at = fmt.find("{}");
  if (at == string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, at) << value;
  put(out, fmt.substr(at + 2), rest...);
}
} // namespace mlx_engine_format_fallback

template <class... Args>
string format(string_view fmt, const Args&... args) {
  ostringstream out;
  mlx_engine_format_fallback::put(out, fmt, args...);
  return out.str();
}
} // namespace std
#endif
#endif
