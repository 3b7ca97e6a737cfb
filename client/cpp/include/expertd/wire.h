// The protocol's constants (PROTOCOL.md §1-2): its version, the default endpoint and shm folder, the message cap.
#pragma once

#include <cstddef>
#include <string_view>

namespace expertd {

inline constexpr int PROTOCOL_VERSION = 6;
// The default endpoint is not a constant: ipc://RUNTIME_BASE/expertd.sock, a folder no other uid can make first
// (expertd/protocol.py runtime_base): /run/expertd for root, else $XDG_RUNTIME_DIR/expertd when that is a folder of
// the uid's own nobody else may write, else /tmp/expertd-UID. See default_endpoint() in expertd/connection.h.
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
