// Credentials (token, CURVE keys from $EXPERTD_*), the REQ connection over libzmq, and /proc facts.
#include "expertd/connection.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <string_view>

#include "detail.h"
#include "trust.h"

namespace expertd {

using detail::quote;
using detail::fmt;
using detail::shape_text;
using detail::Fd;

// --- credentials and the control connection ----------------------------------------------------------

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// ZeroMQ's certificate format (what `expertd keys` writes): `public-key = "..."`, `secret-key = "..."`.
std::pair<std::optional<std::string>, std::optional<std::string>> load_certificate(const std::string& path,
                                                                                    const std::string& where) {
  std::ifstream f(path);
  if (!f) throw ConfigError(where + " " + path + ": not a readable ZeroMQ key file; make one with `expertd keys`");
  std::optional<std::string> pub, sec;
  std::string line;
  while (std::getline(f, line)) {
    for (auto [key, slot] : {std::pair{"public-key", &pub}, std::pair{"secret-key", &sec}}) {
      auto at = line.find(key);
      if (at == std::string::npos) continue;
      auto q1 = line.find('"', at), q2 = q1 == std::string::npos ? q1 : line.find('"', q1 + 1);
      if (q2 == std::string::npos) continue;
      *slot = line.substr(q1 + 1, q2 - q1 - 1);
    }
  }
  if (!pub) throw ConfigError(where + " " + path + ": holds no public key");
  return {pub, sec};
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

Credentials Credentials::resolve(std::optional<std::string> token, std::optional<std::string> server_key,
                                 std::optional<std::string> client_key, std::optional<std::string> admin_token) {
  Credentials c;
  c.token = token ? token : env("EXPERTD_TOKEN");
  if (c.token && c.token->empty()) c.token.reset();
  c.admin_token = admin_token ? admin_token : env("EXPERTD_ADMIN_TOKEN");
  if (c.admin_token && c.admin_token->empty()) c.admin_token.reset();
  c.allow_plain_tcp_tokens = env("EXPERTD_ALLOW_PLAIN_TCP_TOKENS").value_or("") == "1";
  if (!server_key) server_key = env("EXPERTD_SERVER_KEY");
  if (!client_key) client_key = env("EXPERTD_CLIENT_KEY");
  if (server_key) {
    std::string v = *server_key;
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.back()))) v.pop_back();
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.front()))) v.erase(v.begin());
    c.server_key = v.size() == 40 && !file_exists(v) ? v : *load_certificate(v, "server key").first;
  }
  if (client_key) {
    auto [pub, sec] = load_certificate(*client_key, "client key");
    if (!sec)
      throw ConfigError("client key " + *client_key + ": holds no secret key; use the NAME.key_secret file `expertd keys` wrote");
    c.client_public = pub;
    c.client_secret = sec;
  } else if (c.server_key) {
    // one ephemeral key pair for every connection of this client: the daemon counts leases and checks heartbeats
    // per CURVE key
    char p[41], q[41];
    if (zmq_curve_keypair(p, q) == 0) {
      c.client_public = std::string(p);
      c.client_secret = std::string(q);
    }
  }
  return c;
}

std::optional<std::string> ipc_path(const std::string& endpoint) {
  static const std::string prefix = "ipc://";
  if (endpoint.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  return endpoint.substr(prefix.size());
}

namespace {
bool private_folder(const char* path, uid_t uid) {
  struct stat st {};
  return ::lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == uid && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}
}  // namespace

std::string default_endpoint() {
  uid_t uid = ::geteuid();
  std::string base;
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (uid == 0)
    base = private_folder("/run", 0) ? "/run/expertd" : "/tmp/expertd-0";
  else if (xdg != nullptr && xdg[0] == '/' && private_folder(xdg, uid))
    base = std::string(xdg) + "/expertd";
  else
    base = "/tmp/expertd-" + std::to_string(uid);
  return "ipc://" + base + "/expertd.sock";
}

std::string check_endpoint(const std::string& endpoint, const std::string& where) {
  static const std::regex tcp(R"(^tcp://[^:/]+:\d+$)"), tcp_no_port(R"(^tcp://[^:/]+$)"), host_port(R"(^[^:/]+:\d+$)"),
      short_ipc(R"(^ipc:/[^/].*$)"), short_tcp(R"(^tcp:/?[^/].*$)");
  static const std::string absolute = "write it as ipc:// followed by its absolute path, e.g. ipc:///run/expertd/expertd.sock";
  const std::string lead = (where.empty() ? "" : where + ": ") + "endpoint " + quote(endpoint);
  auto starts = [&](const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; };
  if (auto path = ipc_path(endpoint)) {  // a relative path: each process would look under its own working folder
    if (path->empty()) throw ConfigError(lead + " names no socket path");
    if ((*path)[0] != '/')
      throw ConfigError(lead + " names the relative path " + *path + ", which each process would look for under its "
                        "own working folder; " + ((*path)[0] == '.' || (*path)[0] == '~' ? absolute :
                        "an absolute path takes three slashes: ipc:///" + *path));
    return endpoint;
  }
  if (std::regex_match(endpoint, tcp)) return endpoint;
  if (std::regex_match(endpoint, tcp_no_port)) throw ConfigError(lead + " names no port; write it as " + endpoint + ":PORT");
  if (std::regex_match(endpoint, short_ipc))
    throw ConfigError(lead + " has too few slashes; write it as ipc://" + endpoint.substr(4));
  if (std::regex_match(endpoint, short_tcp))
    throw ConfigError(lead + " has too few slashes; write it as tcp://" + endpoint.substr(endpoint[4] == '/' ? 5 : 4));
  bool scheme = endpoint.find("://") != std::string::npos;
  bool sock = endpoint.size() >= 5 && endpoint.compare(endpoint.size() - 5, 5, ".sock") == 0;
  if (!scheme && starts(endpoint, "/")) throw ConfigError(lead + " looks like a socket path; write it as ipc://" + endpoint);
  if (!scheme && (starts(endpoint, ".") || starts(endpoint, "~") || starts(endpoint, "ipc:") || sock))
    throw ConfigError(lead + " looks like a relative socket path; " + absolute);
  if (!scheme && std::regex_match(endpoint, host_port))
    throw ConfigError(lead + " needs its transport; write it as tcp://" + endpoint);
  throw ConfigError(lead + " must be ipc://PATH (a unix socket) or tcp://HOST:PORT");
}

namespace {

// Whether nothing listens on the unix socket `path` (a daemon killed with -9 leaves its file behind).
bool refused(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) return false;  // too long for a probe: let ZeroMQ try and say
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  Fd probe{::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};  // a full backlog: EAGAIN at once
  if (probe.fd < 0) return false;
  if (::connect(probe.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) return false;
  return errno == ECONNREFUSED || errno == ENOENT;
}

}  // namespace

void check_running(const std::string& endpoint) {
  auto path = ipc_path(endpoint);
  if (!path) return;
  const std::string fix = "start one with `expertd start --config CONFIG` (or point to the right one with --endpoint / "
                          "$EXPERTD_ENDPOINT)";
  if (!file_exists(*path))
    throw DaemonNotRunning("no expertd daemon is running at " + endpoint + ": the socket file " + *path +
                           " does not exist; " + fix);
  if (refused(*path))
    throw DaemonNotRunning("no expertd daemon is running at " + endpoint + ": nothing listens on its socket file " + *path +
                           " (left behind by a daemon that was killed); " + fix);
}

class Context {
 public:
  Context() : ctx_(zmq_ctx_new()) {
    if (ctx_ == nullptr) throw Error(std::string("cannot create a ZeroMQ context: ") + zmq_strerror(zmq_errno()));
  }
  ~Context() { zmq_ctx_term(ctx_); }
  void* get() const { return ctx_; }

 private:
  void* ctx_;
};

std::shared_ptr<Context> make_context() { return std::make_shared<Context>(); }

Connection::Connection(std::shared_ptr<Context> ctx, std::string endpoint, int timeout_ms, Credentials credentials)
    : ctx_(std::move(ctx)), endpoint_(check_endpoint(endpoint)), timeout_ms_(std::max(1, timeout_ms)),
      credentials_(std::move(credentials)) {}

Connection::~Connection() { close(); }

void* Connection::socket() {
  if (sock_ != nullptr) return sock_;
  void* s = zmq_socket(ctx_->get(), ZMQ_REQ);
  if (s == nullptr) throw Error(std::string("cannot create a ZeroMQ socket: ") + zmq_strerror(zmq_errno()));
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout_ms_, sizeof timeout_ms_);
  zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeout_ms_, sizeof timeout_ms_);
  if (credentials_.server_key) {
    std::string pub, sec;
    if (credentials_.client_public && credentials_.client_secret) {
      pub = *credentials_.client_public;
      sec = *credentials_.client_secret;
    } else {
      char p[41], q[41];
      if (zmq_curve_keypair(p, q) != 0) {
        zmq_close(s);
        throw Error(std::string("cannot make a CURVE key pair (libzmq without CURVE?): ") + zmq_strerror(zmq_errno()));
      }
      pub = p;
      sec = q;
    }
    // z85 keys: 40 characters and the terminating NUL
    if (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, credentials_.server_key->c_str(), 41) != 0 ||
        zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, pub.c_str(), 41) != 0 ||
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec.c_str(), 41) != 0) {
      std::string why = zmq_strerror(zmq_errno());
      zmq_close(s);
      throw ConfigError("cannot use the CURVE keys (40 z85 characters each): " + why);
    }
  }
  if (zmq_connect(s, endpoint_.c_str()) != 0) {
    std::string why = zmq_strerror(zmq_errno());
    zmq_close(s);
    throw Error("cannot connect to " + endpoint_ + ": " + why);
  }
  sock_ = s;
  return sock_;
}

void Connection::reset() {
  if (sock_ != nullptr) {
    zmq_close(sock_);
    sock_ = nullptr;
  }
}

void Connection::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  reset();
}

std::string Connection::silence() const {
  if (ipc_path(endpoint_)) return "its socket exists: is it stuck, or is the timeout too short?";
  if (credentials_.server_key)
    return "with CURVE a daemon never answers a client whose server key is not its public key, nor a client key it "
           "does not allow: check EXPERTD_SERVER_KEY and EXPERTD_CLIENT_KEY; or it is not running there, or the "
           "timeout is too short";
  return "is it running there? A daemon with CURVE never answers a client without its public key: give it with "
         "EXPERTD_SERVER_KEY";
}

void Connection::check_transport(const std::string& op) const {
  // a token to tcp:// without CURVE is plain text: refused unless allowed (expertd/security.py check_transport)
  bool admin = credentials_.admin_token && permission(op) != "read";
  if ((!credentials_.token && !admin) || credentials_.server_key || credentials_.allow_plain_tcp_tokens ||
      endpoint_.rfind("tcp://", 0) != 0)
    return;
  throw ConfigError("not sending the " + std::string(credentials_.token ? "auth_token" : "admin_token") + " to " +
                    endpoint_ + ": tcp:// without CURVE is plain text, and any local user who binds that port while "
                    "the daemon is down (or anyone on the path) would receive it; give the daemon's public key "
                    "(Options::server_key, $EXPERTD_SERVER_KEY) or, accepting that risk, set "
                    "EXPERTD_ALLOW_PLAIN_TCP_TOKENS=1 (Credentials::allow_plain_tcp_tokens)");
}

Value Connection::request(const std::string& op, Value::Map fields) {
  std::string frame;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (sock_ == nullptr) {
      check_running(endpoint_);
      if (auto path = ipc_path(endpoint_)) detail::check_socket(*path);  // before a token goes out: whose socket?
    }
    check_transport(op);  // before a token goes out in clear
    void* s = socket();
    std::string message = encode(request_message(op, std::move(fields), credentials_.token, credentials_.admin_token));
    if (message.size() > MAX_MESSAGE_BYTES)  // the daemon's socket would drop it unanswered
      throw ProtocolError(op_words(op) + " is a " + std::to_string(message.size()) + "-byte request; the daemon takes "
                          "requests of at most " + std::to_string(MAX_MESSAGE_BYTES) + " bytes");
    auto timeout = [&]() {
      reset();
      throw DaemonTimeout("the daemon at " + endpoint_ + " did not answer " + op_words(op) + " within " +
                          fmt("%.1f", timeout_ms_ / 1000.0) + "s (" + silence() + ")");
    };
    while (zmq_send(s, message.data(), message.size(), 0) < 0) {
      int err = zmq_errno();
      if (err == EINTR) continue;
      if (err == EAGAIN) timeout();
      reset();
      throw Error("cannot send to " + endpoint_ + ": " + zmq_strerror(err));
    }
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    while (zmq_msg_recv(&msg, s, 0) < 0) {
      int err = zmq_errno();
      if (err == EINTR) continue;  // a signal: wait on (pyzmq retries the same way)
      zmq_msg_close(&msg);
      if (err == EAGAIN) timeout();
      reset();
      throw Error("cannot receive from " + endpoint_ + ": " + zmq_strerror(err));
    }
    frame.assign(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    bool more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
    if (more) {  // never sent by a daemon: drop the rest so the socket can send again
      reset();
      throw ProtocolError("the daemon's reply to " + quote(op) + " has more than one frame");
    }
  }
  Value reply = decode(frame.data(), frame.size(), "the daemon's reply to " + quote(op));
  check_reply(reply, quote(op));
  if (on_reply) on_reply(reply);
  return reply;
}

// --- /proc ---------------------------------------------------------------------------------------------

std::optional<uint64_t> pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return std::nullopt;
  return static_cast<uint64_t>(st.st_ino);
}

std::optional<uint64_t> process_start_time(long pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  std::string stat = ss.str();
  auto close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 0; i <= 19; ++i)
    if (!(fields >> field)) return std::nullopt;
  try {
    return static_cast<uint64_t>(std::stoull(field));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace expertd
