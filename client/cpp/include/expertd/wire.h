// The protocol's constants (PROTOCOL.md §1-2): its version, the default endpoint and shm folder, the message cap.
#pragma once

#include <cstddef>
#include <string_view>

namespace expertd {

inline constexpr int PROTOCOL_VERSION = 4;
inline constexpr const char* DEFAULT_ENDPOINT = "ipc:///tmp/expertd/expertd.sock";
inline constexpr std::size_t MAX_MESSAGE_BYTES = std::size_t{1} << 20;
inline constexpr const char* DEFAULT_SHM_DIR = "/dev/shm";

// The permission each op needs (expertd/messages.py PERMISSIONS, PROTOCOL.md §2; a test checks all three agree):
// read < push < admin, each implying those before it.
struct OpPermission {
  std::string_view op, permission;
};
inline constexpr OpPermission PERMISSIONS[] = {
    {"hello", "read"},   {"lease", "read"},    {"heartbeat", "read"}, {"refresh", "read"}, {"release", "read"},
    {"status", "read"},  {"index", "read"},    {"job", "read"},       {"cast", "read"},    {"gather", "read"},
    {"update", "push"},  {"stage", "push"},    {"commit", "push"},    {"publish", "push"}, {"abort", "push"},
    {"reload", "admin"}, {"stop", "admin"},
};
inline constexpr std::string_view permission(std::string_view op) {  // "" for an op the table does not name
  for (const auto& p : PERMISSIONS)
    if (p.op == op) return p.permission;
  return "";
}

}  // namespace expertd
