// A lease inside: the lease request, index segment, zero-copy tensor views, heartbeat, refresh, release.
#include "lease_state.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <tuple>

#include "compose.h"
#include "detail.h"

namespace expertd::detail {

namespace {

std::optional<IndexSegment> place_of(const Value& reply) {
  const Value* place = reply.get("index_segment");
  if (place == nullptr || place->is_nil()) return std::nullopt;
  return parse_index_segment(*place);
}

}  // namespace

LeaseState::LeaseState(std::shared_ptr<const Session> session) : session_(std::move(session)) {
  conn_ = std::make_unique<Connection>(session_->ctx, session_->endpoint, session_->timeout_ms(), session_->credentials);
  conn_->on_reply = [this](const Value& reply) { note_latest(reply); };
  try {
    Value reply = lease_request(*conn_, std::nullopt);  // handshake + lease
    const Value* client = reply.get("client");
    if (client == nullptr) throw ProtocolError("the lease reply names no client");
    lease_ = client->as_str("the lease reply's client");
    index_place_ = place_of(reply);  // none while the daemon is still loading
    const Value* timeout = reply.get("lease_timeout_s");
    if (timeout == nullptr) throw ProtocolError("the lease reply has no lease_timeout_s");
    lease_timeout_s_ = timeout->as_number("lease_timeout_s");
    const Value* g = reply.get("generation");
    if (g && g->is_int()) generation_ = g->as_int();
  } catch (...) {
    conn_->close();  // e.g. refused for a wrong token: leave no socket behind
    throw;
  }
  if (session_->options.heartbeat) heartbeat_ = std::thread([this] { beat(); });
}

LeaseState::~LeaseState() {
  try {
    close();
  } catch (...) {
  }
}

// --- what users call -------------------------------------------------------------------------------

std::shared_ptr<const Index> LeaseState::index() {
  std::lock_guard<std::mutex> api(api_);
  return index_locked();
}

std::shared_ptr<const Index> LeaseState::index_locked() {
  check_gone();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (index_) return index_;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(session_->timeout_ms());
  while (true) {
    std::optional<IndexSegment> place;
    std::string lease;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      place = index_place_;
      lease = lease_;
    }
    if (!place) {  // leased while the daemon was loading: ask for the descriptor until it has one
      try {
        Value reply = conn_->request("index", {{"client", lease}, {"segment", true}});
        const Value* desc = reply.get("index_segment");
        place = parse_index_segment(desc ? *desc : Value());
      } catch (const NotReady&) {
        if (std::chrono::steady_clock::now() > deadline)
          throw DaemonTimeout("daemon at " + session_->endpoint + " still loading after " +
                              fmt("%.1f", session_->timeout_ms() / 1000.0) + "s");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
    }
    auto index = std::make_shared<const Index>(read_index(*place));
    std::lock_guard<std::mutex> lock(mutex_);
    index_place_ = place;
    generation_ = index->generation;
    index_ = index;
    return index;
  }
}

TensorMap LeaseState::served_tensors() { return views(false); }

TensorMap LeaseState::checkpoint_tensors() { return views(true); }

TensorMap LeaseState::views(bool checkpoint_names) {
  std::lock_guard<std::mutex> api(api_);
  auto index = index_locked();
  mappings();
  TensorMap out;
  if (checkpoint_names)
    for (const auto& [name, entry] : index->checkpoint_entries()) out.emplace(name, view(entry));
  else
    for (const auto& entry : index->tensors) out.emplace(entry.name, view(entry));
  return out;
}

at::Tensor LeaseState::tensor(const std::string& name) {
  std::lock_guard<std::mutex> api(api_);
  auto index = index_locked();
  mappings();
  for (const auto& entry : index->tensors)
    if (entry.name == name) return view(entry);
  auto entries = index->checkpoint_entries();
  auto it = entries.find(name);
  if (it == entries.end()) throw std::out_of_range("no tensor " + name + " in generation " + std::to_string(index->generation));
  return view(it->second);
}

std::vector<std::string> LeaseState::verify() {
  std::lock_guard<std::mutex> api(api_);
  auto index = index_locked();
  mappings();
  std::vector<std::string> bad;
  for (const auto& entry : index->tensors) {
    if (!entry.checksum) continue;
    at::Tensor t = view(entry);  // checks that the entry fits its segment
    const void* data = entry.nbytes ? t.data_ptr() : nullptr;
    if (tensor_checksum(data, entry.nbytes, checksum_parts(*entry.checksum)) != *entry.checksum) bad.push_back(entry.name);
  }
  return bad;
}

std::vector<std::string> LeaseState::refresh() {
  std::lock_guard<std::mutex> api(api_);
  if (closed_) check_gone();
  std::shared_ptr<const Index> old;
  bool gone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone = gone_.has_value();
  }
  if (gone) {  // the daemon restarted without our generation: lease the latest afresh
    {
      std::lock_guard<std::mutex> lock(mutex_);
      old = index_;  // what the tensors handed out hold: their bytes stay valid
    }
    take_lease(*conn_, std::nullopt);
  } else {
    old = index_locked();
  }
  Value reply = conn_->request("refresh", {{"client", lease()}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Value* g = reply.get("generation");
    if (g && g->is_int()) generation_ = g->as_int();
    index_place_ = place_of(reply);
    index_.reset();
  }
  auto now = index_locked();
  using Place = std::tuple<std::string, uint64_t, uint64_t, std::vector<int64_t>, std::string, std::vector<Extent>>;
  std::map<std::string, Place> before;
  if (old)
    for (const auto& t : old->tensors) before[t.name] = {t.segment, t.offset, t.nbytes, t.shape, t.dtype, t.extents};
  std::vector<std::string> changed;
  for (const auto& t : now->tensors) {
    auto it = before.find(t.name);
    if (it == before.end() || it->second != std::make_tuple(t.segment, t.offset, t.nbytes, t.shape, t.dtype, t.extents))
      changed.push_back(t.name);
  }
  remap(*now);
  return changed;
}

void LeaseState::close() {
  if (closed_.exchange(true)) return;
  struct Finally {
    LeaseState* c;
    ~Finally() {
      c->conn_->close();
      {
        std::lock_guard<std::mutex> lock(c->mutex_);  // the heartbeat waits on mutex_: notify under it
      }
      c->wake_.notify_all();
      if (c->heartbeat_.joinable()) c->heartbeat_.join();
      std::lock_guard<std::mutex> api(c->api_);
      std::lock_guard<std::mutex> lock(c->mutex_);
      // this client's own mappings go (tensors already handed out keep theirs)
      c->segments_.reset();
      c->index_.reset();
    }
  } finally{this};
  try {
    std::lock_guard<std::mutex> api(api_);
    conn_->request("release", {{"client", lease()}});
  } catch (const DaemonError&) {  // the daemon is gone or already dropped us: nothing to release
  } catch (const DaemonTimeout&) {
  }
}

bool LeaseState::has_index_place() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_place_.has_value() || index_ != nullptr;
}

std::string LeaseState::lease() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lease_;
}

std::optional<int64_t> LeaseState::generation() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return generation_;
}

std::string LeaseState::last_heartbeat_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return heartbeat_error_;
}

// --- internals -------------------------------------------------------------------------------------

Value LeaseState::lease_request(Connection& conn, std::optional<int64_t> generation) {
  // the pid namespace and start time let a daemon in the same pid namespace drop the lease as soon as this
  // process is gone (not a lease timeout later)
  long pid = static_cast<long>(::getpid());
  auto ns = pid_namespace();
  auto start = process_start_time(pid);
  Value::Map fields = {{"pid", pid},
                       {"protocol", PROTOCOL_VERSION},
                       {"pid_ns", ns ? Value(*ns) : Value()},
                       {"start_time", start ? Value(*start) : Value()}};
  if (generation) fields.emplace_back("generation", *generation);
  return conn.request("lease", std::move(fields));
}

void LeaseState::take_lease(Connection& conn, std::optional<int64_t> generation) {
  Value reply = lease_request(conn, generation);
  note_latest(reply);
  std::lock_guard<std::mutex> lock(mutex_);
  lease_ = reply.get("client") ? reply.get("client")->as_str("the lease reply's client") : lease_;
  gone_.reset();
  if (!generation) {
    index_place_ = place_of(reply);
    index_.reset();
  }
}

const std::map<std::string, std::shared_ptr<const Mapping>>& LeaseState::mappings() {
  if (!segments_) {
    auto index = index_locked();
    std::map<std::string, std::shared_ptr<const Mapping>> segments;
    for (const auto& s : index->segments) segments[s.name] = map_segment(s.name, s.nbytes, index->shm_dir);
    segments_ = std::move(segments);
  }
  return *segments_;
}

void LeaseState::remap(const Index& index) {
  if (!segments_) return;
  std::map<std::string, std::shared_ptr<const Mapping>> keep;
  for (const auto& s : index.segments) {
    auto it = segments_->find(s.name);
    keep[s.name] = it != segments_->end() ? it->second : map_segment(s.name, s.nbytes, index.shm_dir);
  }
  segments_ = std::move(keep);
}

at::Tensor LeaseState::view(const TensorEntry& entry) {
  at::ScalarType type = scalar_type(entry.dtype);
  uint64_t count = 1, itemsize = dtype_itemsize(entry.dtype);
  bool overflow = false;
  for (int64_t d : entry.shape) {
    auto n = static_cast<uint64_t>(d);
    overflow = overflow || (n != 0 && count > UINT64_MAX / n);
    count *= n;
  }
  overflow = overflow || (count != 0 && itemsize > UINT64_MAX / count);
  if (overflow || count * itemsize != entry.nbytes)
    throw ShmError("index entry " + entry.name + ": " + shape_text(entry.shape) + " " + entry.dtype + " is not " +
                   std::to_string(entry.nbytes) + " bytes");
  auto options = at::TensorOptions().dtype(type);
  if (!entry.extents.empty()) return compose(*segments_, entry, options);
  auto it = segments_->find(entry.segment);
  if (it == segments_->end() || entry.offset + entry.nbytes > it->second->size() || entry.offset + entry.nbytes < entry.offset)
    throw ShmError("index entry " + entry.name + " lies outside segment " + entry.segment);
  if (count == 0) return at::empty(entry.shape, options);
  std::shared_ptr<const Mapping> mapping = it->second;
  // the mapping lives as long as the last tensor over it: the deleter holds a reference
  void* data = const_cast<uint8_t*>(mapping->data() + entry.offset);
  return at::from_blob(data, entry.shape, [mapping](void*) {}, options);
}

void LeaseState::check_gone() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw Error("lease " + lease_ + " on " + session_->endpoint + " was released: attach again");
  if (gone_) throw GenerationGone(*gone_);
}

void LeaseState::note_latest(const Value& reply) {
  const Value* latest = reply.get("latest");
  if (latest == nullptr || !latest->is_int() || latest->is_negative()) return;
  int64_t n = latest->as_int(), seen = latest_.load();
  while (n > seen && !latest_.compare_exchange_weak(seen, n)) {
  }
}

void LeaseState::beat() {
  std::unique_ptr<Connection> conn;
  while (true) {
    std::string lease;
    double timeout_s;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      lease = lease_;
      timeout_s = lease_timeout_s_;
    }
    int timeout_ms = std::max(1, static_cast<int>(std::min(session_->timeout_ms() / 1000.0, timeout_s) * 1000));
    if (!conn || conn->timeout_ms() != timeout_ms)
      conn = std::make_unique<Connection>(session_->ctx, session_->endpoint, timeout_ms, session_->credentials);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto every = std::chrono::duration<double>(std::max(0.05, timeout_s / 3));
      if (wake_.wait_for(lock, every, [this] { return closed_.load(); })) return;
    }
    try {
      note_latest(conn->request("heartbeat", {{"client", lease}}));
    } catch (const LeaseRevoked& exc) {
      // its generation made room for a push (max_generations): the next call says so, refresh() leases the latest
      std::lock_guard<std::mutex> lock(mutex_);
      if (lease == lease_) {
        gone_ = exc.what();
        lease_lost_ = true;
      }
    } catch (const LeaseExpired&) {
      // the daemon forgot our lease (it restarted, or we were silent too long): take one on the generation this
      // client reads, which a successor that adopted it keeps; if that one is gone, the next call says so
      std::optional<int64_t> generation;
      bool ours;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ours = lease == lease_ && !gone_;
        generation = generation_;
      }
      if (!ours) continue;
      try {
        take_lease(*conn, generation);
      } catch (const GenerationGone& exc) {
        std::lock_guard<std::mutex> lock(mutex_);
        gone_ = exc.what();
        lease_lost_ = true;
      } catch (const std::exception& exc) {
        std::lock_guard<std::mutex> lock(mutex_);
        heartbeat_error_ = exc.what();
      }
    } catch (const std::exception& exc) {  // the thread must outlive any one failed beat
      std::lock_guard<std::mutex> lock(mutex_);
      heartbeat_error_ = exc.what();
    }
  }
}

}  // namespace expertd::detail
