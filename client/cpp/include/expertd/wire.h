// The protocol's constants (PROTOCOL.md §1-2): its version, the default endpoint and shm folder, the message cap.
#pragma once

#include <cstddef>

namespace expertd {

inline constexpr int PROTOCOL_VERSION = 3;
inline constexpr const char* DEFAULT_ENDPOINT = "ipc:///tmp/expertd/expertd.sock";
inline constexpr std::size_t MAX_MESSAGE_BYTES = std::size_t{1} << 20;
inline constexpr const char* DEFAULT_SHM_DIR = "/dev/shm";

}  // namespace expertd
