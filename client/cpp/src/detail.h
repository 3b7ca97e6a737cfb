// Small helpers the protocol sources share (not installed).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace expertd::detail {

inline std::string quote(std::string_view s) {  // as Python's repr of a str, near enough for messages
  std::string out = "'";
  out += s;
  out += "'";
  return out;
}

inline std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

struct Fd {  // a file descriptor closed at scope exit
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace expertd::detail
