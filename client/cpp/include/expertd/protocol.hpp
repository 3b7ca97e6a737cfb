// expertd's wire contract in C++, without torch: msgpack values, requests and replies, the typed errors,
// the index segment and the tensor index, checksums, segment files and the control connection.
// PROTOCOL.md (repository root) is the contract this follows; expertd/protocol.py is its Python side.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace expertd {

inline constexpr int PROTOCOL_VERSION = 3;
inline constexpr const char* DEFAULT_ENDPOINT = "ipc:///tmp/expertd/expertd.sock";
inline constexpr std::size_t MAX_MESSAGE_BYTES = std::size_t{1} << 20;
inline constexpr const char* DEFAULT_SHM_DIR = "/dev/shm";

// --- errors: the Python hierarchy (expertd/errors.py), by the same names --------------------------------

class Error : public std::runtime_error {  // ExpertdError
 public:
  using std::runtime_error::runtime_error;
};
class ConfigError : public Error {  // a CURVE key file that cannot be read
 public:
  using Error::Error;
};
class ProtocolError : public Error {  // a malformed message or index, another protocol version
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
EXPERTD_DAEMON_ERROR(Busy)              // another reload or update is being built
EXPERTD_DAEMON_ERROR(GenerationGone)    // the generation this client reads is not served any more
EXPERTD_DAEMON_ERROR(GenerationLimit)   // max_generations reached while leases pin old ones
EXPERTD_DAEMON_ERROR(UpdateRejected)    // a push does not fit
EXPERTD_DAEMON_ERROR(PushDenied)        // the credential may only read
EXPERTD_DAEMON_ERROR(AuthError)         // the request lacked the daemon's auth token or carried a wrong one
EXPERTD_DAEMON_ERROR(DaemonNotRunning)  // no daemon at the endpoint (its ipc:// socket file does not exist)
#undef EXPERTD_DAEMON_ERROR

// Throw the typed error for a reply's `error` name (a plain DaemonError for names without a class).
[[noreturn]] void throw_daemon_error(const std::string& kind, const std::string& message);

// --- msgpack values --------------------------------------------------------------------------------

class Value {
 public:
  enum class Type { Nil, Bool, Int, Float, Str, Bin, Array, Map };
  struct Bin {
    std::string bytes;
    bool operator==(const Bin& o) const { return bytes == o.bytes; }
  };
  using Array = std::vector<Value>;
  using Map = std::vector<std::pair<std::string, Value>>;  // in wire order; keys are strings

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Value(T n) {
    if constexpr (std::is_signed_v<T>) {
      if (n < 0) {
        v_ = static_cast<int64_t>(n);
        return;
      }
    }
    v_ = static_cast<uint64_t>(n);
  }
  Value(double d) : v_(d) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(Bin b) : v_(std::move(b)) {}
  Value(Array a) : v_(std::move(a)) {}
  Value(Map m) : v_(std::move(m)) {}

  Type type() const;
  bool is_nil() const { return v_.index() == 0; }
  bool is_bool() const { return v_.index() == 1; }
  bool is_int() const { return v_.index() == 2 || v_.index() == 3; }  // bool is not an int here
  bool is_float() const { return v_.index() == 4; }
  bool is_str() const { return v_.index() == 5; }
  bool is_array() const { return v_.index() == 7; }
  bool is_map() const { return v_.index() == 8; }
  bool is_negative() const { return v_.index() == 2; }

  // Typed accessors: a ProtocolError naming `what` when the value is not of that type (or out of range).
  bool as_bool(std::string_view what = "value") const;
  int64_t as_int(std::string_view what = "value") const;
  uint64_t as_uint(std::string_view what = "value") const;
  double as_number(std::string_view what = "value") const;  // an int or a float
  const std::string& as_str(std::string_view what = "value") const;
  const Bin& as_bin(std::string_view what = "value") const;
  const Array& as_array(std::string_view what = "value") const;
  const Map& as_map(std::string_view what = "value") const;

  const Value* get(std::string_view key) const;  // a map's entry, or nullptr (also for a non-map)
  Value& set(std::string key, Value value);      // add or replace a map entry (keeps the order)

  bool operator==(const Value& o) const { return v_ == o.v_; }
  bool operator!=(const Value& o) const { return !(v_ == o.v_); }

 private:
  std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string, Bin, Array, Map> v_;
};

const char* type_name(Value::Type t);
// One msgpack object filling all of data[0, size) (trailing bytes are an error), else a ProtocolError
// naming `what`; bin objects over max_bin bytes are refused (as the Python side refuses them).
Value decode(const void* data, std::size_t size, std::string_view what = "message",
             std::size_t max_bin = MAX_MESSAGE_BYTES);
// Canonical msgpack: the smallest form of each integer and string, floats as float64, maps in their order.
std::string encode(const Value& value);
std::string to_json(const Value& value);  // JSON text (bin as {"$bin": hex})

// --- requests and replies ----------------------------------------------------------------------------

// {op, ...fields, token?}: the map a request sends (the token last, when there is one).
Value request_message(const std::string& op, Value::Map fields = {},
                      const std::optional<std::string>& token = std::nullopt);
// A decoded reply to `what` (the request, in the user's words): its map when `ok` is true; else the
// reply's typed error is thrown. A reply without a boolean `ok` is a ProtocolError.
const Value::Map& check_reply(const Value& reply, const std::string& what);
std::string op_words(const std::string& op);  // "lease" -> "attach", as errors say it

// --- the tensor index --------------------------------------------------------------------------------

struct IndexSegment {  // the descriptor a lease (refresh, index with segment) reply names
  std::string segment;
  uint64_t nbytes = 0;
  std::string checksum;
  int64_t generation = 0;
  std::string shm_dir = DEFAULT_SHM_DIR;
};
IndexSegment parse_index_segment(const Value& desc);  // ProtocolError when malformed

struct SegmentEntry {
  std::string name;
  uint64_t nbytes = 0;
};
struct ExpertBlock {  // a partitioned daemon's fused expert tensor: which experts it holds
  int64_t total = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (first expert, count)
};
struct ExpertParallel {
  int64_t size = 0;
  std::vector<int64_t> ranks;
};
struct TensorEntry {
  std::string name;
  std::string segment;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  std::vector<int64_t> shape;
  std::string dtype;                 // "torch.bfloat16", ...
  std::vector<std::string> sources;  // expanded from a pattern
  std::optional<std::string> base;   // the served tensor a view lies inside
  std::optional<std::string> checksum;
  std::optional<ExpertBlock> experts;
};
struct Index {
  int schema = 2;  // as read (1 or 2)
  int64_t generation = 0;
  std::string namespace_;
  std::string model_type;
  std::string layout;
  Value config;  // the model's config.json, as a map
  std::vector<SegmentEntry> segments;
  std::vector<TensorEntry> tensors;
  std::optional<std::vector<TensorEntry>> views;  // only schema 1 writes them out
  std::string shm_dir = DEFAULT_SHM_DIR;
  std::optional<ExpertParallel> expert_parallel;

  std::vector<TensorEntry> all_views() const;  // the per-expert views (derived from the fused tensors)
  // Every checkpoint tensor name -> where its bytes are (a served tensor or a view): Python's rule.
  std::map<std::string, TensorEntry> checkpoint_entries() const;
};

Index index_from_value(const Value& data);  // TensorIndex.from_dict: ProtocolError when malformed
std::vector<TensorEntry> derive_views(const std::vector<TensorEntry>& tensors);
std::vector<std::string> decode_sources(const Value& value);

// The index dict in an index segment's bytes, checked against the descriptor (magic, generation,
// length, header and payload xxh3): CorruptIndex when anything disagrees.
Value unpack_index_segment(const void* blob, std::size_t size, const IndexSegment& desc);
// Map the index segment read-only, check and decode it (ShmError when it cannot be opened).
Index read_index(const IndexSegment& desc);

inline constexpr char INDEX_MAGIC[8] = {'E', 'X', 'P', 'D', 'I', 'D', 'X', '\x01'};
inline constexpr std::size_t INDEX_HEADER_BYTES = 32;

// --- checksums, dtypes, segment files ----------------------------------------------------------------

uint64_t xxh3_64(const void* data, std::size_t size);
std::string checksum_text(uint64_t value);  // "xxh3_64:%016x"
int checksum_parts(const std::string& recorded);  // n of "xxh3_64x<n>:", 1 for "xxh3_64:"
// A tensor's checksum as the index records it: of its bytes, or combined from `parts` equal parts.
std::string tensor_checksum(const void* data, std::size_t size, int parts = 1);
std::string combined_checksum(const std::vector<std::string>& part_checksums);

std::size_t dtype_itemsize(const std::string& dtype);  // ShmError for a dtype expertd does not serve
const std::vector<std::string>& dtype_names();

std::string segment_path(const std::string& name, const std::string& shm_dir = DEFAULT_SHM_DIR);

class Mapping {  // a read-only shared mapping of a segment file; unmapped when the last owner goes
 public:
  Mapping(void* data, std::size_t size, std::string name) : data_(data), size_(size), name_(std::move(name)) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(data_); }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void* data_;
  std::size_t size_;
  std::string name_;
};
// Map `nbytes` of segment `name` read-only (ShmError if missing, unreadable or shorter).
std::shared_ptr<const Mapping> map_segment(const std::string& name, uint64_t nbytes,
                                           const std::string& shm_dir = DEFAULT_SHM_DIR);

// --- the control connection --------------------------------------------------------------------------

struct Credentials {
  std::optional<std::string> token;       // the daemon's auth_token
  std::optional<std::string> server_key;  // CURVE: the daemon's public key, z85 (40 characters)
  std::optional<std::string> client_public, client_secret;  // CURVE: this client's pair (z85); else ephemeral
  // Arguments first, then $EXPERTD_TOKEN, $EXPERTD_SERVER_KEY (z85 or a key file), $EXPERTD_CLIENT_KEY
  // (a NAME.key_secret file), as the Python client resolves them.
  static Credentials resolve(std::optional<std::string> token, std::optional<std::string> server_key = std::nullopt,
                             std::optional<std::string> client_key = std::nullopt);
};

std::optional<std::string> ipc_path(const std::string& endpoint);
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
