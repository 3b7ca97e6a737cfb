// expertd-cpp-dump ENDPOINT [--token T] [--json] [--views] [--timeout-ms N] [--bench N] [--hold-s S]
//                           [--refresh] [--no-wait] [--server-key KEY] [--client-key FILE]
//                           [--admin-token T] [--stop | --stop-keep | --reload [--checkpoint DIR]]
//
// Attach to a daemon with the C++ client and print one line per served tensor (with --views per checkpoint
// tensor): name, dtype, shape, segment, offset, the xxh3 checksum recomputed over the mapped bytes (in the form
// the index records: "xxh3_64:" or the combined "xxh3_64x<n>:") and OK when it equals the index's, BAD when
// not ("-" when the index records none); then release the lease. --bench N attaches N more times
// (attach + tensors + release) and reports each timing. --hold-s S holds the lease S seconds first (the
// heartbeat thread keeps it) and reports whether the daemon still lists it. --refresh then moves to the latest
// generation and dumps that one (reporting what changed, and whether the views taken before kept their
// bytes). --no-wait fails with NotReady at once while the daemon is still loading (else attach waits up to
// the timeout). With --json it also reports the leases the daemon lists right after the release.
// --stop, --stop-keep and --reload send that admin op instead of attaching (with --admin-token, or a CURVE key the
// daemon lists in curve_admin_keys) and print the reply; a credential without the admin permission exits 11.
// Exit status: 0 ok, 1 a BAD tensor (or an unexpected error), 2 usage or ConfigError (an endpoint that is not
// ipc://PATH or tcp://HOST:PORT, an unreadable key file), 3 DaemonNotRunning, 4 DaemonTimeout,
// 5 AuthError, 6 another DaemonError, 7 ProtocolError / CorruptIndex, 8 ShmError, 9 VersionMismatch,
// 10 DaemonNotTrusted, 11 PermissionDenied (PushDenied too);
// the error's type leads its message on stderr.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "expertd/client.h"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

int usage(const char* why) {
  std::fprintf(stderr,
               "expertd-cpp-dump: %s\nusage: expertd-cpp-dump ENDPOINT [--token T] [--json] [--views] [--timeout-ms N] "
               "[--bench N] [--hold-s S] [--refresh] [--no-wait] [--server-key KEY] [--client-key FILE] [--admin-token T] "
               "[--stop | --stop-keep | --reload [--checkpoint DIR]]\n",
               why);
  return 2;
}

struct Row {
  std::string name, dtype, segment, checksum, recorded, whole, verdict;
  std::vector<int64_t> shape;
  uint64_t offset = 0, nbytes = 0;
};

std::string shape_json(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int run(int argc, char** argv) {
  std::string endpoint;
  expertd::Options options;
  bool json = false, views = false;
  int bench = 0;
  double hold_s = 0;
  bool refresh = false;
  std::string admin_op;  // "stop", "stop-keep" or "reload": sent instead of attaching
  std::optional<std::string> checkpoint;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(flag) + " needs a value");
      return argv[++i];
    };
    if (a == "--token") options.token = value("--token");
    else if (a == "--json") json = true;
    else if (a == "--views") views = true;
    else if (a == "--timeout-ms") options.timeout = std::chrono::milliseconds(std::stoi(value("--timeout-ms")));
    else if (a == "--bench") bench = std::stoi(value("--bench"));
    else if (a == "--hold-s") hold_s = std::stod(value("--hold-s"));
    else if (a == "--refresh") refresh = true;
    else if (a == "--no-wait") options.wait_ready = false;
    else if (a == "--server-key") options.server_key = value("--server-key");
    else if (a == "--client-key") options.client_key = value("--client-key");
    else if (a == "--admin-token") options.admin_token = value("--admin-token");
    else if (a == "--stop" || a == "--stop-keep" || a == "--reload") admin_op = a.substr(2);
    else if (a == "--checkpoint") checkpoint = value("--checkpoint");
    else if (a == "-h" || a == "--help") return usage("attach to an expertd daemon and dump what it serves"), 0;
    else if (!a.empty() && a[0] == '-') return usage(("unknown option " + a).c_str());
    else if (endpoint.empty()) endpoint = a;
    else return usage("more than one ENDPOINT");
  }
  if (endpoint.empty()) return usage("no ENDPOINT");

  expertd::Client client(endpoint, options);
  if (admin_op == "reload") return std::printf("%s\n", expertd::to_json(client.reload(checkpoint)).c_str()), 0;
  if (!admin_op.empty()) return client.stop(admin_op == "stop-keep"), std::printf("stopped\n"), 0;
  auto t0 = Clock::now();
  expertd::Lease lease = client.attach();
  double attach_ms = ms_since(t0);
  std::shared_ptr<const expertd::Index> index = lease.index();
  t0 = Clock::now();
  expertd::TensorMap tensors = views ? lease.checkpoint_tensors() : lease.tensors();
  double tensors_ms = ms_since(t0);

  std::string lease_id = lease.id();
  auto lease_ids = [](const expertd::Status& status) {
    expertd::Value::Array ids;
    for (const auto& l : status.leases) ids.emplace_back(l.client);
    return ids;
  };
  std::string held, refreshed;
  if (hold_s > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(hold_s));
    expertd::Status status = client.status();
    bool alive = false, watched = false;
    for (const auto& l : status.leases)  // status shows a tag of each lease id, never the id: this process's lease
      if (l.pid == static_cast<int64_t>(::getpid())) alive = true, watched = l.watched;
    held = ", \"held\": {\"seconds\": " + std::to_string(hold_s) + ", \"lease_alive\": " + (alive ? "true" : "false") +
           ", \"watched\": " + (watched ? "true" : "false") + ", \"lease\": " + expertd::to_json(lease.id()) +
           ", \"heartbeat_error\": " + expertd::to_json(lease.last_heartbeat_error()) + "}";
    if (!json) std::printf("held %.1f s: lease %s %s\n", hold_s, lease.id().c_str(), alive ? "alive" : "gone");
  }
  if (refresh) {  // move to the latest generation; the views taken before must stay as they were
    int64_t seen = lease.latest_generation();
    std::vector<std::pair<at::Tensor, std::string>> before;
    for (const auto& [name, t] : tensors) before.emplace_back(t, expertd::tensor_checksum(t.data_ptr(), t.nbytes()));
    expertd::Value::Array changed;
    for (auto& name : lease.refresh()) changed.emplace_back(name);
    bool unchanged = true;
    for (const auto& [t, sum] : before) unchanged = unchanged && expertd::tensor_checksum(t.data_ptr(), t.nbytes()) == sum;
    index = lease.index();
    tensors = views ? lease.checkpoint_tensors() : lease.tensors();
    refreshed = ", \"refresh\": {\"latest_seen\": " + std::to_string(seen) + ", \"changed\": " +
                expertd::to_json(expertd::Value(changed)) + ", \"old_views_unchanged\": " + (unchanged ? "true" : "false") + "}";
    if (!json) std::printf("refreshed to generation %" PRId64 ": %zu tensor(s) changed\n", index->generation, changed.size());
  }

  std::vector<Row> rows;
  int bad = 0;
  auto add = [&](const expertd::TensorEntry& e, const at::Tensor& t) {
    Row r;
    r.name = e.name;
    r.dtype = expertd::dtype_name(t.scalar_type());
    r.shape = t.sizes().vec();
    r.segment = e.segment;
    r.offset = e.offset;
    r.nbytes = t.nbytes();
    const void* data = t.nbytes() ? t.data_ptr() : nullptr;
    r.recorded = e.checksum.value_or("");
    r.checksum = expertd::tensor_checksum(data, t.nbytes(), e.checksum ? expertd::checksum_parts(*e.checksum) : 1);
    r.whole = expertd::tensor_checksum(data, t.nbytes(), 1);
    r.verdict = r.recorded.empty() ? "-" : r.checksum == r.recorded ? "OK" : "BAD";
    bad += r.verdict == "BAD";
    rows.push_back(std::move(r));
  };
  if (views) {
    for (const auto& [name, entry] : index->checkpoint_entries()) add(entry, tensors.at(name));
  } else {
    for (const auto& entry : index->tensors) add(entry, tensors.at(entry.name));
  }
  int64_t generation = lease.generation();
  t0 = Clock::now();
  lease.release();
  double release_ms = ms_since(t0);
  int64_t latest = lease.latest_generation();
  std::string after;
  if (json) {  // asked while this process lives: a lease the daemon drops only when its process goes would show
    after = ", \"leases_after_release\": " + expertd::to_json(expertd::Value(lease_ids(client.status())));
    // the tensors outlive their lease: their deleters hold the mappings, the bytes are what they were
    bool same = true;
    for (const Row& r : rows) {
      const at::Tensor& t = tensors.at(r.name);
      same = same && expertd::tensor_checksum(t.nbytes() ? t.data_ptr() : nullptr, t.nbytes(), 1) == r.whole;
    }
    after += std::string(", \"valid_after_release\": ") + (same ? "true" : "false");
  }
  tensors.clear();

  std::vector<std::vector<double>> runs;  // attach, tensors, release
  for (int k = 0; k < bench; ++k) {
    auto a = Clock::now();
    expertd::Lease l = client.attach();
    double x = ms_since(a);
    a = Clock::now();
    auto ts = views ? l.checkpoint_tensors() : l.tensors();
    double t = ms_since(a);
    a = Clock::now();
    l.release();
    runs.push_back({x, t, ms_since(a)});
  }

  if (json) {
    std::string out = "{\"endpoint\": " + expertd::to_json(endpoint) + ", \"lease\": " + expertd::to_json(lease_id) +
                      ", \"generation\": " + std::to_string(generation) + ", \"latest\": " + std::to_string(latest) +
                      ", \"bad\": " + std::to_string(bad) + ", \"tensors\": [";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out += std::string(i ? ", " : "") + "{\"name\": " + expertd::to_json(r.name) + ", \"dtype\": \"" + r.dtype +
             "\", \"shape\": " + shape_json(r.shape) + ", \"segment\": " + expertd::to_json(r.segment) +
             ", \"offset\": " + std::to_string(r.offset) + ", \"nbytes\": " + std::to_string(r.nbytes) +
             ", \"checksum\": \"" + r.checksum + "\", \"recorded\": " +
             (r.recorded.empty() ? std::string("null") : "\"" + r.recorded + "\"") + ", \"xxh3_64\": \"" + r.whole +
             "\", \"verdict\": \"" + r.verdict + "\"}";
    }
    char buf[256];
    std::snprintf(buf, sizeof buf, "], \"timings_ms\": {\"attach\": %.3f, \"tensors\": %.3f, \"release\": %.3f}",
                  attach_ms, tensors_ms, release_ms);
    out += buf;
    out += ", \"bench_ms\": [";
    for (std::size_t i = 0; i < runs.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s{\"attach\": %.3f, \"tensors\": %.3f, \"release\": %.3f}", i ? ", " : "",
                    runs[i][0], runs[i][1], runs[i][2]);
      out += buf;
    }
    out += "]" + held + refreshed + after + "}";
    std::cout << out << std::endl;
  } else {
    std::printf("generation %" PRId64 " (lease %s, latest %" PRId64 ", %zu %s tensors)\n", generation, lease_id.c_str(),
                latest, rows.size(), views ? "checkpoint" : "served");
    for (const Row& r : rows)
      std::printf("%s\t%s\t%s\t%s\t%" PRIu64 "\t%s\t%s\n", r.name.c_str(), r.dtype.c_str(), shape_json(r.shape).c_str(),
                  r.segment.c_str(), r.offset, r.checksum.c_str(), r.verdict.c_str());
    std::printf("attach %.2f ms, tensors %.2f ms, release %.2f ms\n", attach_ms, tensors_ms, release_ms);
    for (const auto& r : runs)
      std::printf("bench: attach %.2f ms, tensors %.2f ms, release %.2f ms\n", r[0], r[1], r[2]);
    if (bad) std::printf("%d tensor(s) BAD: their bytes differ from the index's checksums\n", bad);
  }
  return bad ? 1 : 0;
}

template <class E>
bool is(const std::exception& e) {
  return dynamic_cast<const E*>(&e) != nullptr;
}

// An error's exit status and the type that leads its message (the header's list), the first that matches.
struct Failure {
  int code;
  const char* type;  // nullptr: the DaemonError's kind()
  bool (*matches)(const std::exception&);
};
const Failure failures[] = {
    {3, "DaemonNotRunning", is<expertd::DaemonNotRunning>},
    {4, "DaemonTimeout", is<expertd::DaemonTimeout>},
    {10, "DaemonNotTrusted", is<expertd::DaemonNotTrusted>},
    {11, nullptr, is<expertd::PermissionDenied>},  // PermissionDenied or PushDenied: its kind() leads
    {5, "AuthError", is<expertd::AuthError>},
    {9, "VersionMismatch", is<expertd::VersionMismatch>},
    {6, nullptr, is<expertd::DaemonError>},
    {7, "CorruptIndex", is<expertd::CorruptIndex>},
    {7, "ProtocolError", is<expertd::ProtocolError>},
    {8, "ShmError", is<expertd::ShmError>},
    {2, "ConfigError", is<expertd::ConfigError>},
};

int fail(const std::exception& exc) {
  int code = 1;
  std::string type = "Error";
  for (const Failure& f : failures) {
    if (!f.matches(exc)) continue;
    code = f.code;
    type = f.type ? f.type : static_cast<const expertd::DaemonError&>(exc).kind();
    break;
  }
  std::fprintf(stderr, "expertd-cpp-dump: %s: %s\n", type.c_str(), exc.what());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::invalid_argument& e) {
    return usage(e.what());
  } catch (const std::exception& e) {
    return fail(e);
  }
}
