// expertd::Client (endpoint, credentials, status, attach) and expertd::Lease (a handle on a detail::LeaseState).
#include "expertd/client.h"

#include <cstdlib>
#include <utility>

#include "lease_state.h"

namespace expertd {

namespace {

const std::pair<const char*, at::ScalarType> DTYPES[] = {
    {"torch.float8_e4m3fn", at::kFloat8_e4m3fn}, {"torch.float8_e5m2", at::kFloat8_e5m2},
    {"torch.bfloat16", at::kBFloat16},           {"torch.float16", at::kHalf},
    {"torch.float32", at::kFloat},               {"torch.float64", at::kDouble},
    {"torch.int64", at::kLong},                  {"torch.int32", at::kInt},
    {"torch.int16", at::kShort},                 {"torch.int8", at::kChar},
    {"torch.uint8", at::kByte},                  {"torch.bool", at::kBool}};

std::string resolve_endpoint(std::string endpoint) {  // checked here so that an $EXPERTD_ENDPOINT error says so
  if (!endpoint.empty()) return check_endpoint(endpoint);
  const char* env = std::getenv("EXPERTD_ENDPOINT");
  return env != nullptr && *env != '\0' ? check_endpoint(env, "$EXPERTD_ENDPOINT") : default_endpoint();
}

LeaseInfo lease_info(const Value& v) {
  LeaseInfo info;
  info.client = v.get("client") ? v.get("client")->as_str("a status lease's client") : "";
  if (const Value* x = v.get("pid")) info.pid = x->as_int("a status lease's pid");
  if (const Value* x = v.get("generation"); x && !x->is_nil()) info.generation = x->as_int("a status lease's generation");
  if (const Value* x = v.get("age_s")) info.age_s = x->as_number("a status lease's age_s");
  if (const Value* x = v.get("idle_s")) info.idle_s = x->as_number("a status lease's idle_s");
  if (const Value* x = v.get("watched")) info.watched = x->as_bool("a status lease's watched");
  return info;
}

}  // namespace

at::ScalarType scalar_type(const std::string& dtype) {
  for (const auto& [name, type] : DTYPES)
    if (dtype == name) return type;
  throw ShmError("index names unknown dtype '" + dtype + "'");
}

const char* dtype_name(at::ScalarType type) {
  for (const auto& [name, t] : DTYPES)
    if (t == type) return name;
  return "unknown";
}

// --- Client ----------------------------------------------------------------------------------------

Client::Client(std::string endpoint, Options options) {
  auto session = std::make_shared<detail::Session>();
  session->endpoint = resolve_endpoint(std::move(endpoint));
  if (options.timeout.count() < 1 || options.timeout.count() > INT32_MAX)
    throw ConfigError("expertd::Options::timeout must be between 1 ms and 2^31 ms");
  session->credentials = Credentials::resolve(options.token, options.server_key, options.client_key, options.admin_token);
  session->options = std::move(options);
  session->ctx = make_context();
  conn_ = std::make_unique<Connection>(session->ctx, session->endpoint, session->timeout_ms(), session->credentials);
  session_ = std::move(session);
}

Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

Lease Client::attach() {
  auto state = std::make_unique<detail::LeaseState>(session_);
  if (!session_->options.wait_ready && !state->has_index_place()) {
    std::string id = state->lease();
    state->close();
    throw NotReady("daemon at " + session_->endpoint + " is still loading its first generation (lease " + id +
                   " released; attach with wait_ready to wait for it)");
  }
  state->index();  // maps and checks the index (waits while loading): a lease in hand has its generation
  return Lease(std::move(state));
}

Status Client::status() {
  Status s;
  s.reply = conn_->request("status");
  if (const Value* v = s.reply.get("state")) s.state = v->as_str("status state");
  if (const Value* v = s.reply.get("pid")) s.pid = v->as_int("status pid");
  if (const Value* v = s.reply.get("namespace")) s.namespace_ = v->as_str("status namespace");
  if (const Value* v = s.reply.get("generation")) s.generation = v->as_int("status generation");
  if (const Value* v = s.reply.get("latest")) s.latest = v->as_int("status latest");
  if (const Value* v = s.reply.get("leases"))
    for (const Value& l : v->as_array("status leases")) s.leases.push_back(lease_info(l));
  return s;
}

void Client::stop(bool keep) { conn_->request("stop", keep ? Value::Map{{"keep", true}} : Value::Map{}); }

Value Client::reload(std::optional<std::string> checkpoint) {
  return conn_->request("reload", checkpoint ? Value::Map{{"checkpoint", *checkpoint}} : Value::Map{});
}

Hello Client::hello() {
  Value reply = conn_->request("hello", {{"protocol", PROTOCOL_VERSION}});
  Hello h;
  if (const Value* v = reply.get("protocol")) h.protocol = v->as_int("protocol");
  if (const Value* v = reply.get("ready")) h.ready = v->as_bool("ready");
  if (const Value* v = reply.get("generation")) h.generation = v->as_int("generation");
  if (const Value* v = reply.get("lease_timeout_s")) h.lease_timeout_s = v->as_number("lease_timeout_s");
  return h;
}

const std::string& Client::endpoint() const { return session_->endpoint; }
const Options& Client::options() const { return session_->options; }

// --- Lease -----------------------------------------------------------------------------------------

Lease::Lease(std::unique_ptr<detail::LeaseState> state) : state_(std::move(state)) {}
Lease::Lease(Lease&&) noexcept = default;
Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    state_.reset();  // the lease this one held goes (~LeaseState releases it, errors swallowed)
    state_ = std::move(other.state_);
  }
  return *this;
}
Lease::~Lease() = default;  // ~LeaseState releases

detail::LeaseState& Lease::state() const {
  if (!state_) throw Error("expertd::Lease: used after it was moved from");
  return *state_;
}

TensorMap Lease::tensors() { return state().served_tensors(); }
TensorMap Lease::checkpoint_tensors() { return state().checkpoint_tensors(); }
at::Tensor Lease::tensor(const std::string& name) { return state().tensor(name); }
std::shared_ptr<const Index> Lease::index() { return state().index(); }
int64_t Lease::generation() const { return state().generation().value_or(0); }
int64_t Lease::latest_generation() const { return state().latest_generation(); }
std::vector<std::string> Lease::verify() { return state().verify(); }
std::vector<std::string> Lease::refresh() { return state().refresh(); }
void Lease::release() {
  if (state_) state_->close();
}
std::string Lease::id() const { return state().lease(); }
double Lease::timeout_s() const { return state().lease_timeout_s(); }
bool Lease::lost() const { return state().lease_lost(); }
std::string Lease::last_heartbeat_error() const { return state().last_heartbeat_error(); }

}  // namespace expertd
