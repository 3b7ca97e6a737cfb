// expertd's C++ client: a lease on a daemon's published weights, served tensors as zero-copy libtorch views.
//
//   expertd::Client client("ipc:///tmp/expertd/expertd.sock", {.token = "..."});
//   auto tensors = client.served_tensors();   // name -> at::Tensor over read-only shared memory
//   client.close();                           // releases the lease; the tensors stay valid
//
// The same rules as the Python ExpertClient (client/client.py): the lease request is the handshake, the index
// comes from the index segment the lease reply names, a heartbeat thread keeps the lease (every
// lease_timeout_s / 3), and every tensor keeps its segment's mapping alive (the mapping outlives the client).
// The tensors are read-only at the page level: writing into one kills the process with SIGSEGV.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "expertd/protocol.hpp"

namespace expertd {

struct Options {
  std::optional<std::string> token;       // the daemon's auth_token; else $EXPERTD_TOKEN
  int timeout_ms = 30000;                 // every request's receive (and send) timeout
  bool heartbeat = true;                  // keep the lease with a heartbeat thread
  std::optional<std::string> server_key;  // CURVE over tcp://: z85 or a key file; else $EXPERTD_SERVER_KEY
  std::optional<std::string> client_key;  // CURVE: a NAME.key_secret file; else $EXPERTD_CLIENT_KEY (else ephemeral)
};

struct Hello {  // the `hello` reply
  int64_t protocol = 0;
  bool ready = false;
  int64_t generation = 0;
  double lease_timeout_s = 0;
};

class Client {
 public:
  // Attach: one `lease` request carrying the protocol version, pid, pid namespace and start time.
  // An empty endpoint means $EXPERTD_ENDPOINT, else DEFAULT_ENDPOINT. Throws DaemonNotRunning,
  // DaemonTimeout, AuthError, DaemonError (e.g. kind "ProtocolError" for another protocol version).
  explicit Client(std::string endpoint = "", Options options = {});
  ~Client();  // close(), errors swallowed
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The generation's tensor index (mapped from its index segment and decoded here), waiting up to the
  // timeout while the daemon is still loading. CorruptIndex / ProtocolError / ShmError when it is wrong.
  // refresh() moves on to a new one; the one returned before stays valid while held.
  std::shared_ptr<const Index> index();
  // Every served tensor by the model's parameter name (fused experts as whole blocks).
  std::map<std::string, at::Tensor> served_tensors();
  // Every checkpoint tensor by its checkpoint name (per-expert views of the fused blocks), as Python's tensors().
  std::map<std::string, at::Tensor> tensors();
  // One tensor, by served or checkpoint name (std::out_of_range if neither).
  at::Tensor tensor(const std::string& name);
  // Names of served tensors whose bytes no longer match the index's xxh3 checksums.
  std::vector<std::string> verify();
  // Move the lease to the latest generation; returns the served tensors that changed. Tensors taken
  // before stay valid (and unchanged) while held.
  std::vector<std::string> refresh();
  Value status();  // the daemon's status reply
  Hello hello();   // the handshake alone (attach does not need it)
  void close();    // release the lease (idempotent); tensors already handed out stay valid

  const std::string& endpoint() const { return endpoint_; }
  std::string lease() const;
  double lease_timeout_s() const { return lease_timeout_s_; }
  std::optional<int64_t> generation() const;  // the generation this client reads (once known)
  int64_t latest_generation() const { return latest_.load(); }  // the newest the daemon serves, from its replies
  bool lease_lost() const { return lease_lost_.load(); }  // the daemon forgot the lease and the generation is gone
  std::string last_heartbeat_error() const;

 private:
  void connect();
  std::shared_ptr<const Index> index_locked();
  Value lease_request(Connection& conn, std::optional<int64_t> generation);
  void take_lease(Connection& conn, std::optional<int64_t> generation);
  const std::map<std::string, std::shared_ptr<const Mapping>>& attach();
  void remap(const Index& index);
  at::Tensor view(const TensorEntry& entry);
  void check_gone() const;
  void note_latest(const Value& reply);
  void beat();

  std::string endpoint_;
  Options options_;
  Credentials credentials_;
  std::shared_ptr<Context> ctx_;
  std::unique_ptr<Connection> conn_;

  std::mutex api_;            // one public call at a time (the heartbeat thread never takes it)
  mutable std::mutex mutex_;  // guards the state below (the heartbeat thread reads and changes the lease)
  std::string lease_;
  double lease_timeout_s_ = 0;
  std::optional<int64_t> generation_;
  std::optional<IndexSegment> index_place_;
  std::shared_ptr<const Index> index_;
  std::optional<std::map<std::string, std::shared_ptr<const Mapping>>> segments_;
  std::optional<std::string> gone_;  // why the generation is gone (GenerationGone), once the heartbeat learns it
  std::string heartbeat_error_;

  std::atomic<int64_t> latest_{0};
  std::atomic<bool> lease_lost_{false};
  std::atomic<bool> closed_{false};
  std::condition_variable wake_;
  std::thread heartbeat_;
};

at::ScalarType scalar_type(const std::string& dtype);  // "torch.bfloat16" -> at::kBFloat16 (ShmError if unknown)

}  // namespace expertd
