// expertd's C++ client: leases on a daemon's published weights, served tensors as zero-copy libtorch views.
//
//   expertd::Client c("ipc:///run/expertd/expertd.sock", {.token = "...", .timeout = std::chrono::seconds(10)});
//   expertd::Lease lease = c.attach();                 // pins the latest generation (a heartbeat thread keeps it)
//   std::unordered_map<std::string, at::Tensor> t = lease.tensors();  // served names -> read-only views
//   int64_t g = lease.generation();
//   lease.release();                                   // or let it go out of scope; the tensors stay valid
//
// The same rules as the Python ExpertClient (client/client.py): the lease request is the handshake, the index
// comes from the index segment the lease reply names, a heartbeat thread keeps the lease (every
// lease_timeout_s / 3), and every tensor keeps its segment's mapping alive through its deleter (a tensor may
// outlive its lease and its client). The tensors are read-only at the page level: writing into one kills the
// process with SIGSEGV. Errors are the typed ones of expertd/errors.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "expertd/protocol.h"

namespace expertd {

struct Options {
  std::optional<std::string> token;                  // the daemon's auth_token; else $EXPERTD_TOKEN
  std::chrono::milliseconds timeout{30000};          // every request's receive (and send) timeout
  bool wait_ready = true;   // attach() waits up to `timeout` while the daemon loads its first generation; else NotReady
  bool heartbeat = true;    // keep leases with a heartbeat thread
  std::optional<std::string> server_key;  // CURVE over tcp://: z85 or a key file; else $EXPERTD_SERVER_KEY
  std::optional<std::string> client_key;  // CURVE: a NAME.key_secret file; else $EXPERTD_CLIENT_KEY (else ephemeral)
  std::optional<std::string> admin_token; // the daemon's admin_token (reload, stop); else $EXPERTD_ADMIN_TOKEN
};

struct Hello {  // the `hello` reply
  int64_t protocol = 0;
  bool ready = false;
  int64_t generation = 0;
  double lease_timeout_s = 0;
};

struct LeaseInfo {  // one lease in the `status` reply
  std::string client;
  int64_t pid = 0;
  std::optional<int64_t> generation;
  double age_s = 0, idle_s = 0;
  bool watched = false;  // dropped as soon as its process is gone (same pid namespace as the daemon)
};

struct Status {  // the `status` reply: the fields a client acts on, and the whole reply
  std::string state;  // "serving" or "loading"
  int64_t pid = 0;
  std::string namespace_;
  int64_t generation = 0;
  int64_t latest = 0;
  std::vector<LeaseInfo> leases;
  Value reply;
};

using TensorMap = std::unordered_map<std::string, at::Tensor>;

namespace detail {
class LeaseState;
struct Session;
}  // namespace detail

// A lease on one generation. Movable, not copyable; released by release() or its destructor.
class Lease {
 public:
  Lease(Lease&&) noexcept;
  Lease& operator=(Lease&&) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();  // release(), errors swallowed

  TensorMap tensors();             // every served tensor by the model's parameter name (fused experts whole)
  TensorMap checkpoint_tensors();  // every checkpoint tensor by its checkpoint name (per-expert views), as Python's tensors()
  at::Tensor tensor(const std::string& name);  // by served or checkpoint name (std::out_of_range if neither)
  std::shared_ptr<const Index> index();        // the generation's tensor index (CorruptIndex, ShmError when wrong)
  int64_t generation() const;                  // the generation this lease pins
  int64_t latest_generation() const;           // the newest the daemon serves, from its replies (heartbeats too)
  std::vector<std::string> verify();           // served tensors whose bytes no longer match the index's xxh3
  // Move to the latest generation; returns the served tensors that changed. Tensors taken before stay valid
  // (and unchanged) while held.
  std::vector<std::string> refresh();
  void release();  // idempotent; tensors already handed out stay valid

  std::string id() const;       // the daemon's lease id ("c<N>")
  double timeout_s() const;     // the daemon's lease_timeout_s
  bool lost() const;            // the daemon forgot the lease and the generation is gone (next call: GenerationGone)
  std::string last_heartbeat_error() const;

 private:
  friend class Client;
  explicit Lease(std::unique_ptr<detail::LeaseState> state);
  detail::LeaseState& state() const;
  std::unique_ptr<detail::LeaseState> state_;
};

// A daemon's endpoint and credentials. Constructing one sends nothing; an empty endpoint means
// $EXPERTD_ENDPOINT, else default_endpoint() (connection.h). Every request fails at once with DaemonNotRunning when an
// ipc:// endpoint has no socket file or nothing listens on it.
class Client {
 public:
  explicit Client(std::string endpoint = "", Options options = {});
  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();

  // Take a lease (one `lease` request: the handshake, with pid, pid namespace and start time) and map its
  // index. Throws DaemonNotRunning, DaemonTimeout, AuthError, VersionMismatch, NotReady (still loading after
  // the timeout, or at once without wait_ready), CorruptIndex, ShmError.
  Lease attach();
  Status status();  // needs no lease; answered while loading
  Hello hello();    // the handshake alone
  // The admin ops (Options::admin_token, or under CURVE a client key in the daemon's curve_admin_keys); a
  // credential without the admin permission gets PermissionDenied. stop: `keep` leaves the generations for a
  // successor. reload: the configured checkpoint, or a folder under the daemon's checkpoint_roots; the job reply.
  void stop(bool keep = false);
  Value reload(std::optional<std::string> checkpoint = std::nullopt);

  const std::string& endpoint() const;
  const Options& options() const;

 private:
  std::shared_ptr<detail::Session> session_;
  std::unique_ptr<Connection> conn_;
};

at::ScalarType scalar_type(const std::string& dtype);  // "torch.bfloat16" -> at::kBFloat16 (ShmError if unknown)
const char* dtype_name(at::ScalarType type);            // at::kBFloat16 -> "torch.bfloat16" ("unknown" otherwise)

}  // namespace expertd
