// What a Lease is inside (not installed): its connection, the index it maps, its segments' mappings and the
// heartbeat thread. Lease (include/expertd/client.h) is a movable handle on one of these.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "expertd/client.h"

namespace expertd::detail {

struct Session {  // what a Client and the leases it hands out share
  std::string endpoint;
  Options options;
  Credentials credentials;
  std::shared_ptr<Context> ctx;

  int timeout_ms() const { return static_cast<int>(options.timeout.count()); }
};

class LeaseState {
 public:
  explicit LeaseState(std::shared_ptr<const Session> session);  // the `lease` request; starts the heartbeat
  ~LeaseState();                                                 // close(), errors swallowed

  std::shared_ptr<const Index> index();
  TensorMap served_tensors();
  TensorMap checkpoint_tensors();
  at::Tensor tensor(const std::string& name);
  std::vector<std::string> verify();
  std::vector<std::string> refresh();
  void close();

  std::string lease() const;
  double lease_timeout_s() const { return lease_timeout_s_; }
  std::optional<int64_t> generation() const;
  int64_t latest_generation() const { return latest_.load(); }
  bool lease_lost() const { return lease_lost_.load(); }
  std::string last_heartbeat_error() const;
  bool has_index_place() const;

 private:
  std::shared_ptr<const Index> index_locked();
  Value lease_request(Connection& conn, std::optional<int64_t> generation);
  void take_lease(Connection& conn, std::optional<int64_t> generation);
  const std::map<std::string, std::shared_ptr<const Mapping>>& mappings();
  void remap(const Index& index);
  at::Tensor view(const TensorEntry& entry);
  TensorMap views(bool checkpoint_names);  // every served tensor's view, or every checkpoint tensor's
  void check_gone() const;
  void note_latest(const Value& reply);
  void beat();

  std::shared_ptr<const Session> session_;
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

}  // namespace expertd::detail
