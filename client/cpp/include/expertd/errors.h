// The typed errors: the Python hierarchy (expertd/errors.py) by the same names, and the wire's error names
// (PROTOCOL.md §2, "Error names") mapped to them.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace expertd {

// --- errors: the Python hierarchy (expertd/errors.py), by the same names --------------------------------

class Error : public std::runtime_error {  // ExpertdError
 public:
  using std::runtime_error::runtime_error;
};
class ConfigError : public Error {  // a CURVE key file that cannot be read
 public:
  using Error::Error;
};
class ProtocolError : public Error {  // a malformed message or index
 public:
  using Error::Error;
};
class CorruptIndex : public ProtocolError {  // the index segment is truncated, altered or another generation's
 public:
  using ProtocolError::ProtocolError;
};
class ShmError : public Error {  // a segment file cannot be opened or mapped, or an entry does not fit it
 public:
  using Error::Error;
};
class DaemonNotTrusted : public Error {  // the socket folder, socket or a segment is of a user this client does not trust
 public:
  using Error::Error;
};
class DaemonTimeout : public Error {  // no reply within the timeout
 public:
  using Error::Error;
};
class DaemonError : public Error {  // the daemon refused a request; kind() is the error's name on the wire
 public:
  DaemonError(const std::string& message, std::string kind) : Error(message), kind_(std::move(kind)) {}
  const std::string& kind() const noexcept { return kind_; }

 private:
  std::string kind_;
};
#define EXPERTD_DAEMON_ERROR(Name)                                                     \
  class Name : public DaemonError {                                                    \
   public:                                                                             \
    explicit Name(const std::string& message, std::string kind = #Name)                \
        : DaemonError(message, std::move(kind)) {}                                     \
  };
EXPERTD_DAEMON_ERROR(NotReady)          // still loading the first generation
EXPERTD_DAEMON_ERROR(LeaseExpired)      // the lease is unknown: expired, released, or the daemon restarted
EXPERTD_DAEMON_ERROR(LeaseLimit)        // this client holds max_leases_per_client leases already
EXPERTD_DAEMON_ERROR(Busy)              // another reload or update is being built
EXPERTD_DAEMON_ERROR(GenerationGone)    // the generation this client reads is not served any more
EXPERTD_DAEMON_ERROR(LeaseRevoked)      // the lease's generation made room for a push: lease the latest
EXPERTD_DAEMON_ERROR(GenerationLimit)   // max_generations reached while leases pin old ones
EXPERTD_DAEMON_ERROR(UpdateRejected)    // a push does not fit
EXPERTD_DAEMON_ERROR(PermissionDenied)  // the credential lacks the op's permission (read < push < admin, wire.h)
EXPERTD_DAEMON_ERROR(AuthError)         // the request lacked the daemon's auth token or carried a wrong one
EXPERTD_DAEMON_ERROR(VersionMismatch)   // the daemon speaks another protocol version (the message names both)
EXPERTD_DAEMON_ERROR(DaemonNotRunning)  // no daemon at the endpoint (its ipc:// socket file does not exist)
#undef EXPERTD_DAEMON_ERROR
class MappedLimit : public LeaseLimit {  // this holder may still map too many generations it never released
 public:
  explicit MappedLimit(const std::string& message, std::string kind = "MappedLimit")
      : LeaseLimit(message, std::move(kind)) {}
};
class PushDenied : public PermissionDenied {  // a push op with a credential that may only read
 public:
  explicit PushDenied(const std::string& message, std::string kind = "PushDenied")
      : PermissionDenied(message, std::move(kind)) {}
};

// Throw the typed error for a reply's `error` name (a plain DaemonError for names without a class).
[[noreturn]] void throw_daemon_error(const std::string& kind, const std::string& message);

}  // namespace expertd
