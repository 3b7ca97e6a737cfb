// The control connection (PROTOCOL.md §1-3): request and reply envelopes, credentials (token, CURVE keys),
// one REQ socket with timeouts turned into typed errors, and what /proc says about this process.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include "expertd/errors.h"
#include "expertd/value.h"
#include "expertd/wire.h"

namespace expertd {

// --- requests and replies ----------------------------------------------------------------------------

// {op, ...fields, token?, admin_token?}: the map a request sends (the token last, when there is one; then the
// admin_token, with the ops whose permission is not "read" only).
Value request_message(const std::string& op, Value::Map fields = {},
                      const std::optional<std::string>& token = std::nullopt,
                      const std::optional<std::string>& admin_token = std::nullopt);
// A decoded reply to `what` (the request, in the user's words): its map when `ok` is true; else the
// reply's typed error is thrown. A reply without a boolean `ok` is a ProtocolError.
const Value::Map& check_reply(const Value& reply, const std::string& what);
std::string op_words(const std::string& op);  // "lease" -> "attach", as errors say it

// --- the control connection --------------------------------------------------------------------------

struct Credentials {
  std::optional<std::string> token;       // the daemon's auth_token
  std::optional<std::string> admin_token; // the daemon's admin_token: sent with reload and stop only
  std::optional<std::string> server_key;  // CURVE: the daemon's public key, z85 (40 characters)
  std::optional<std::string> client_public, client_secret;  // CURVE: this client's pair (z85); else ephemeral
  // send tokens to a tcp:// endpoint without CURVE (plain text: whoever binds that port receives them); else
  // $EXPERTD_ALLOW_PLAIN_TCP_TOKENS=1, as the Python client reads it
  bool allow_plain_tcp_tokens = false;
  // Arguments first, then $EXPERTD_TOKEN, $EXPERTD_SERVER_KEY (z85 or a key file), $EXPERTD_CLIENT_KEY
  // (a NAME.key_secret file), $EXPERTD_ADMIN_TOKEN, as the Python client resolves them.
  static Credentials resolve(std::optional<std::string> token, std::optional<std::string> server_key = std::nullopt,
                             std::optional<std::string> client_key = std::nullopt,
                             std::optional<std::string> admin_token = std::nullopt);
};

std::optional<std::string> ipc_path(const std::string& endpoint);
// ipc://RUNTIME_BASE/expertd.sock, what a daemon of this uid serves when its config names no endpoint
// (expertd/protocol.py default_endpoint, the same rule): /run/expertd for root, else $XDG_RUNTIME_DIR/expertd when
// that is a folder (not a link) of this uid that nobody else may write, else /tmp/expertd-UID.
std::string default_endpoint();
// `endpoint` when it is ipc://PATH or tcp://HOST:PORT, else a ConfigError saying how to write it, worded as
// expertd/protocol.py check_endpoint words it (`where`, when given, leads the message). Checked before any libzmq call.
std::string check_endpoint(const std::string& endpoint, const std::string& where = "");
void check_running(const std::string& endpoint);  // DaemonNotRunning when an ipc:// socket file is missing

class Context;  // a ZeroMQ context, shared by the connections of one client

// One REQ socket with a receive timeout turned into DaemonTimeout; rebuilt after a timeout (a REQ
// socket that missed a reply is stuck). Thread-safe (one request at a time).
class Connection {
 public:
  Connection(std::shared_ptr<Context> ctx, std::string endpoint, int timeout_ms, Credentials credentials);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  Value request(const std::string& op, Value::Map fields = {});  // the reply map (typed errors thrown)
  void close();
  int timeout_ms() const { return timeout_ms_; }
  const std::string& endpoint() const { return endpoint_; }
  std::function<void(const Value&)> on_reply;  // called with every successful reply

 private:
  void* socket();
  void reset();
  std::string silence() const;
  void check_transport(const std::string& op) const;  // ConfigError before a token goes to plain tcp://

  std::shared_ptr<Context> ctx_;
  std::string endpoint_;
  int timeout_ms_;
  Credentials credentials_;
  std::mutex mutex_;
  void* sock_ = nullptr;
};

std::shared_ptr<Context> make_context();

// This process's pid namespace (inode of /proc/self/ns/pid) and a process's start time (field 22 of
// /proc/PID/stat); nullopt where /proc does not say.
std::optional<uint64_t> pid_namespace();
std::optional<uint64_t> process_start_time(long pid);

}  // namespace expertd
