// Request and reply envelopes, and the wire's error names turned into the typed errors.
#include "expertd/connection.h"

#include <map>
#include <set>

#include "detail.h"

namespace expertd {

using detail::quote;
using detail::fmt;
using detail::shape_text;
using detail::Fd;

// --- errors ----------------------------------------------------------------------------------------

// One line per error: each throws its own C++ type by name, which a table would have to restate as a lambda each.
// The kinds thrown as their own type below: their message does not restate the kind (expertd.errors.refusal).
bool typed_kind(const std::string& kind) {
  static const std::set<std::string> typed = {"NotReady", "LeaseExpired", "LeaseLimit", "Busy", "GenerationGone",
                                              "GenerationLimit", "UpdateRejected", "PushDenied", "PermissionDenied",
                                              "AuthError", "VersionMismatch", "DaemonNotRunning", "LeaseRevoked",
                                              "MappedLimit"};
  return typed.count(kind) != 0;
}

void throw_daemon_error(const std::string& kind, const std::string& message) {
  if (kind == "NotReady") throw NotReady(message);
  if (kind == "LeaseExpired") throw LeaseExpired(message);
  if (kind == "MappedLimit") throw MappedLimit(message);
  if (kind == "LeaseLimit") throw LeaseLimit(message);
  if (kind == "LeaseRevoked") throw LeaseRevoked(message);
  if (kind == "Busy") throw Busy(message);
  if (kind == "GenerationGone") throw GenerationGone(message);
  if (kind == "GenerationLimit") throw GenerationLimit(message);
  if (kind == "UpdateRejected") throw UpdateRejected(message);
  if (kind == "PushDenied") throw PushDenied(message);
  if (kind == "PermissionDenied") throw PermissionDenied(message);
  if (kind == "AuthError") throw AuthError(message);
  if (kind == "VersionMismatch") throw VersionMismatch(message);
  if (kind == "DaemonNotRunning") throw DaemonNotRunning(message);
  throw DaemonError(message, kind);
}

// --- requests and replies ----------------------------------------------------------------------------

Value request_message(const std::string& op, Value::Map fields, const std::optional<std::string>& token,
                      const std::optional<std::string>& admin_token) {
  Value::Map m;
  m.reserve(fields.size() + 3);
  m.emplace_back("op", Value(op));
  for (auto& kv : fields) m.push_back(std::move(kv));
  if (token) m.emplace_back("token", Value(*token));
  if (admin_token && permission(op) != "read") m.emplace_back("admin_token", Value(*admin_token));
  return Value(std::move(m));
}

const Value::Map& check_reply(const Value& reply, const std::string& what) {
  const Value* ok = reply.get("ok");
  if (!reply.is_map() || ok == nullptr || !ok->is_bool())
    throw ProtocolError("the daemon's reply to " + what + " is malformed");
  if (!ok->as_bool()) {
    const Value* error = reply.get("error");
    const Value* message = reply.get("message");
    std::string kind = error && error->is_str() ? error->as_str() : (error ? to_json(*error) : "None");
    std::string text = message && message->is_str() ? message->as_str() : (message ? to_json(*message) : "None");
    std::string said = "daemon refused " + what + ": " + (typed_kind(kind) ? "" : kind + ": ") + text;
    if (kind == "AuthError")  // the fix, as the Python client gives it
      said += "; give the daemon's auth_token (its config key) as $EXPERTD_TOKEN or Options::token";
    throw_daemon_error(kind, said);
  }
  return reply.as_map();
}

std::string op_words(const std::string& op) {
  static const std::map<std::string, std::string> words = {
      {"hello", "the handshake"}, {"lease", "attach"}, {"index", "the tensor index"}, {"heartbeat", "a heartbeat"},
      {"release", "detach"}, {"refresh", "refresh"}, {"status", "status"}, {"stop", "stop"}, {"reload", "reload"},
      {"update", "an update"}, {"stage", "an update's bytes"}, {"commit", "an update"},
      {"publish", "publishing an update"}, {"abort", "dropping an update"}, {"job", "build progress"}};
  auto it = words.find(op);
  return it == words.end() ? op : it->second;
}

}  // namespace expertd
