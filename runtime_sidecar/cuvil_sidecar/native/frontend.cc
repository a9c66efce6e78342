// The sidecar's native gRPC front end: gRPC C++ (callback API) takes the HTTP/2 work, the
// handlers stay in Python. Loaded with ctypes by cuvil_sidecar.native; every entry point is
// extern "C".
//
// Each method of the served services is registered raw (bytes in, bytes out). A unary call is
// handed to Python's dispatch callback with its request bytes, metadata and deadline; Python
// answers, from any thread and at any time, with cuvil_frontend_finish. A bidirectional
// streaming method (ModelStreamInfer) hands each message it reads to dispatch the same way, as
// a call of its own; each answer is written to the stream in the order answers come, and the
// stream ends once the client has stopped sending and every message is answered (or at once,
// with the status, when Python answers a message with an error code). A message may have
// several answers (a generation model's, one per token: Triton's decoupled mode): Python writes
// each with cuvil_frontend_write and then finishes the message with no data; answers written
// with `more` wait for the next write without it, so that the answers of one turn of Python's
// event loop start writing once from Python's thread, the rest following from gRPC's threads
// as each write completes. Python asks whether a call, or a message's stream, was cancelled
// (cuvil_frontend_cancelled) before it runs it. A large request of a method with a tensor field
// (ModelInfer's raw_input_contents) is split here first, off the GIL: the tensors' bytes go
// straight from gRPC's slices into one buffer that Python takes over, each at a 64-byte
// boundary, and Python parses only the rest (see wire.py). Health (grpc.health.v1, Check and
// Watch) and reflection come from gRPC C++ itself; the service descriptors reflection serves
// are given by Python as serialized FileDescriptorProtos.
#include <google/protobuf/descriptor.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/codegen/server_callback_handlers.h>
#include <grpcpp/impl/codegen/service_type.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

// dispatch(call, method index, request bytes, size, metadata, size, tensors, entries, count,
// deadline); the metadata is each key and value in turn, each as a native uint32 length and its
// bytes (binary values hold NULs). count is -1 for a request passed whole; for a split one, the
// request bytes are the message without its tensor field, and entries holds count (offset,
// size) pairs into tensors, a buffer Python owns from then on (cuvil_frontend_release). The
// deadline is the client's, in nanoseconds since the Unix epoch, 0 when it set none.
using Dispatch = void (*)(void*, int, const char*, size_t, const char*, size_t, char*,
                          const uint64_t*, int64_t, int64_t);

constexpr size_t kTensorAlignment = 64;

void append_sized(std::string& out, const char* data, size_t size) {
  uint32_t length = static_cast<uint32_t>(size);
  out.append(reinterpret_cast<const char*>(&length), sizeof length).append(data, size);
}

// The client's metadata, then the peer's address under ":peer" (a name no client can send:
// HTTP/2 reserves the leading colon for pseudo-headers).
std::string Metadata(grpc::CallbackServerContext* context) {
  std::string metadata;
  for (const auto& [key, value] : context->client_metadata()) {
    append_sized(metadata, key.data(), key.size());
    append_sized(metadata, value.data(), value.size());
  }
  std::string peer = context->peer();
  append_sized(metadata, ":peer", 5);
  append_sized(metadata, peer.data(), peer.size());
  return metadata;
}

int64_t DeadlineNs(grpc::CallbackServerContext* context) {
  auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return 0;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch())
      .count();
}

// A request's bytes as gRPC holds them: slices, read at any offset.
class Slices {
 public:
  explicit Slices(const std::vector<grpc::Slice>& slices) {
    for (const grpc::Slice& slice : slices) {
      if (slice.size() == 0) continue;
      starts_.push_back(size_);
      data_.push_back(reinterpret_cast<const char*>(slice.begin()));
      size_ += slice.size();
    }
    starts_.push_back(size_);
  }

  size_t size() const { return size_; }

  // The bytes [begin, end) appended to out (end <= size()).
  void Copy(size_t begin, size_t end, char* out) {
    while (begin < end) {
      Seek(begin);
      size_t take = std::min(end, starts_[at_ + 1]) - begin;
      std::memcpy(out, data_[at_] + (begin - starts_[at_]), take);
      out += take;
      begin += take;
    }
  }

  // A varint at *position, which moves past it; false if it runs off the end or past 10 bytes.
  bool Varint(size_t* position, uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64 && *position < size_; shift += 7) {
      Seek(*position);
      uint8_t byte = static_cast<uint8_t>(data_[at_][*position - starts_[at_]]);
      ++*position;
      *value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (byte < 0x80) return true;
    }
    return false;
  }

 private:
  void Seek(size_t position) {  // reads mostly move forwards
    if (position < starts_[at_]) at_ = 0;
    while (position >= starts_[at_ + 1]) ++at_;
  }

  std::vector<const char*> data_;
  std::vector<size_t> starts_;
  size_t size_ = 0;
  size_t at_ = 0;
};

// A message with its top-level length-delimited fields `number` cut out: header is the rest,
// entries (offset, size) where each cut field's contents lie in tensors.
struct Split {
  std::string header;
  char* tensors = nullptr;
  std::vector<uint64_t> entries;
};

size_t Aligned(size_t size) {
  return (size + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
}

// Walks the fields as protobuf would; false (nothing allocated) for bytes that are no
// message, which Python then parses whole, so that protobuf reports them as it always does.
bool SplitMessage(Slices& bytes, int number, Split* split) {
  std::vector<std::pair<size_t, size_t>> kept, cut;  // [begin, end) ranges of bytes
  size_t start = 0, at = 0, end = bytes.size();
  while (at < end) {
    size_t field_start = at;
    uint64_t tag = 0, value = 0;
    if (!bytes.Varint(&at, &tag)) return false;
    switch (tag & 7) {
      case 0:
        if (!bytes.Varint(&at, &value)) return false;
        break;
      case 1:
        at += 8;
        break;
      case 5:
        at += 4;
        break;
      case 2:
        if (!bytes.Varint(&at, &value) || value > end - at) return false;
        if (static_cast<int>(tag >> 3) == number) {
          kept.emplace_back(start, field_start);
          cut.emplace_back(at, at + value);
          start = at + value;
        }
        at += value;
        break;
      default:  // groups (3, 4) are not used by the protocol; 6 and 7 do not exist
        return false;
    }
    if (at > end) return false;
  }
  kept.emplace_back(start, end);
  size_t header_size = 0, tensors_size = 0;
  for (const auto& [begin, stop] : kept) header_size += stop - begin;
  for (const auto& [begin, stop] : cut) tensors_size += Aligned(stop - begin);
  split->header.resize(header_size);
  char* out = split->header.data();
  for (const auto& [begin, stop] : kept) {
    bytes.Copy(begin, stop, out);
    out += stop - begin;
  }
  if (cut.empty()) return true;
  split->tensors = static_cast<char*>(
      std::aligned_alloc(kTensorAlignment, std::max(tensors_size, kTensorAlignment)));
  if (split->tensors == nullptr) return false;
  size_t offset = 0;
  for (const auto& [begin, stop] : cut) {
    bytes.Copy(begin, stop, split->tensors + offset);
    split->entries.push_back(offset);
    split->entries.push_back(stop - begin);
    offset += Aligned(stop - begin);
  }
  return true;
}

// What Python answers through cuvil_frontend_finish: a unary call, or one message of a stream.
class Call {
 public:
  virtual ~Call() = default;
  // code 0 sends data as the response message (for a stream's message, data null sends
  // nothing more); any other code fails the call with message.
  virtual void Finish(int code, const char* message, const char* data, size_t size) = 0;
  // One more answer to a stream's message, written before it is finished (with `more`: queued
  // for the next write without it); false when nothing more can be written (the stream failed
  // or was cancelled, or the call is unary).
  virtual bool Write(const char* data, size_t size, bool more) { return false; }
  // Whether the call (for a stream's message: its stream) was cancelled: by the client, by its
  // hanging up, or by its deadline. Any thread may ask, until the call is finished.
  virtual bool Cancelled() = 0;
};

class UnaryCall : public Call {
 public:
  UnaryCall(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
            grpc::ByteBuffer* response)
      : context_(context), reactor_(reactor), response_(response) {}

  // The callback API keeps the answer valid from any thread (ServerContextBase::IsCancelled).
  bool Cancelled() override { return context_->IsCancelled(); }

  void Finish(int code, const char* message, const char* data, size_t size) override {
    if (code == 0) {
      grpc::Slice slice(data, size);
      *response_ = grpc::ByteBuffer(&slice, 1);
      reactor_->Finish(grpc::Status::OK);
    } else {
      reactor_->Finish(grpc::Status(static_cast<grpc::StatusCode>(code), message));
    }
  }

 private:
  grpc::CallbackServerContext* context_;  // lives until the reactor is done, after Finish
  grpc::ServerUnaryReactor* reactor_;
  grpc::ByteBuffer* response_;
};

// One bidirectional stream: every message read is dispatched as a call; answers are written one
// at a time, in the order they come. The stream lives until gRPC is done with it and every
// message handed to Python has been answered.
class Stream : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Stream(grpc::CallbackServerContext* context, int index, Dispatch dispatch)
      : index_(index), dispatch_(dispatch), metadata_(Metadata(context)),
        deadline_(DeadlineNs(context)) {
    StartRead(&request_);
  }

  void Answer(int code, const char* message, const char* data, size_t size) {
    std::unique_lock<std::recursive_mutex> guard(lock_);
    --pending_;
    if (code == 0 && !failed_) {
      if (data != nullptr) Queue(data, size);
      Flush();  // with the answers queued with `more`
    } else if (!failed_) {
      failed_ = true;
      status_ = grpc::Status(static_cast<grpc::StatusCode>(code), message);
    }
    MaybeFinish();
    bool last = done_ && pending_ == 0;
    guard.unlock();
    if (last) delete this;
  }

  // An answer to a message that stays unfinished (it has more to come); with `more`, only
  // queued: the next answer written without it (or the message's finish) starts the write.
  bool Write(const char* data, size_t size, bool more) {
    std::lock_guard<std::recursive_mutex> guard(lock_);
    if (failed_ || cancelled_.load(std::memory_order_acquire)) return false;
    Queue(data, size);
    if (!more) Flush();
    return true;
  }

  void OnReadDone(bool ok) override {
    std::unique_lock<std::recursive_mutex> guard(lock_);
    if (!ok || failed_) {
      reads_done_ = true;
      MaybeFinish();
      return;
    }
    ++pending_;
    guard.unlock();
    std::vector<grpc::Slice> slices;
    if (!request_.Dump(&slices).ok()) slices.clear();
    std::string joined;
    for (const grpc::Slice& slice : slices) {
      joined.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    request_.Clear();
    StartRead(&request_);  // the next message is read while this one is served
    dispatch_(new StreamMessage(this), index_, joined.data(), joined.size(), metadata_.data(),
              metadata_.size(), nullptr, nullptr, -1, deadline_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> guard(lock_);
    writes_.pop_front();
    if (!ok) {  // the client is gone: nothing more can be written
      writes_.clear();
      failed_ = true;
    }
    if (!writes_.empty()) {
      StartNextWrite();
    } else {
      writing_ = false;
      MaybeFinish();
    }
  }

  // The client cancelled the stream (or hung up, or its deadline passed): the messages handed
  // to Python and not yet run are dropped there (StreamMessage::Cancelled), unrun.
  void OnCancel() override { cancelled_.store(true, std::memory_order_release); }

  void OnDone() override {
    std::unique_lock<std::recursive_mutex> guard(lock_);
    done_ = true;
    bool last = pending_ == 0;
    guard.unlock();
    if (last) delete this;
  }

 private:
  class StreamMessage : public Call {
   public:
    explicit StreamMessage(Stream* stream) : stream_(stream) {}
    void Finish(int code, const char* message, const char* data, size_t size) override {
      stream_->Answer(code, message, data, size);
    }
    bool Write(const char* data, size_t size, bool more) override {
      return stream_->Write(data, size, more);
    }
    // The stream lives while this message is unanswered (pending_ counts it).
    bool Cancelled() override { return stream_->cancelled_.load(std::memory_order_acquire); }

   private:
    Stream* stream_;
  };

  // Queues one answer (a copy of its bytes); lock_ held.
  void Queue(const char* data, size_t size) {
    grpc::Slice slice(data, size);
    writes_.emplace_back(&slice, 1);
  }

  // Starts writing what is queued, unless a write is under way; lock_ held.
  void Flush() {
    if (!writing_ && !writes_.empty()) {
      writing_ = true;
      StartNextWrite();
    }
  }

  // Writes the front answer. No buffer hint: gRPC may then hold the write's completion until a
  // later write without one, which the queue cannot start before that completion. lock_ held.
  void StartNextWrite() { StartWrite(&writes_.front()); }

  // Ends the stream once nothing more will be written: every message read and answered, or a
  // failure; called with lock_ held.
  void MaybeFinish() {
    if (finish_sent_ || writing_) return;
    if ((reads_done_ && pending_ == 0) || failed_) {
      finish_sent_ = true;
      Finish(status_);
    }
  }

  int index_;
  Dispatch dispatch_;
  std::string metadata_;
  int64_t deadline_;
  grpc::ByteBuffer request_;
  std::recursive_mutex lock_;
  std::deque<grpc::ByteBuffer> writes_;  // the front one is being written
  grpc::Status status_ = grpc::Status::OK;
  std::atomic<bool> cancelled_{false};
  int pending_ = 0;  // messages handed to Python and not yet answered
  bool writing_ = false, reads_done_ = false, failed_ = false, finish_sent_ = false;
  bool done_ = false;
};

class RawService : public grpc::Service {
 public:
  RawService(const std::vector<std::string>& methods, const int* split_fields,
             const int* streaming, size_t split_from, Dispatch dispatch)
      : split_from_(split_from), dispatch_(dispatch) {
    for (const std::string& method : methods) names_.push_back(method);
    split_fields_.assign(split_fields, split_fields + names_.size());
    for (size_t index = 0; index < names_.size(); ++index) {
      if (streaming[index]) {
        AddMethod(new grpc::internal::RpcServiceMethod(
            names_[index].c_str(), grpc::internal::RpcMethod::BIDI_STREAMING, nullptr));
        MarkMethodRawCallback(
            static_cast<int>(index),
            new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                [this, index](grpc::CallbackServerContext* context) {
                  return new Stream(context, static_cast<int>(index), dispatch_);
                }));
        continue;
      }
      AddMethod(new grpc::internal::RpcServiceMethod(
          names_[index].c_str(), grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
      MarkMethodRawCallback(
          static_cast<int>(index),
          new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
              [this, index](grpc::CallbackServerContext* context,
                            const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
                return Handle(static_cast<int>(index), context, request, response);
              }));
    }
  }

 private:
  grpc::ServerUnaryReactor* Handle(int index, grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    std::vector<grpc::Slice> slices;
    if (request != nullptr && !request->Dump(&slices).ok()) slices.clear();
    Slices bytes(slices);
    std::string metadata = Metadata(context);
    int64_t deadline = DeadlineNs(context);
    auto* call = new UnaryCall(context, reactor, response);
    Split split;
    if (split_fields_[index] != 0 && bytes.size() >= split_from_ &&
        SplitMessage(bytes, split_fields_[index], &split)) {
      dispatch_(call, index, split.header.data(), split.header.size(), metadata.data(),
                metadata.size(), split.tensors, split.entries.data(),
                static_cast<int64_t>(split.entries.size() / 2), deadline);
      return reactor;
    }
    std::string joined;
    const char* data = "";
    if (slices.size() == 1) {
      data = reinterpret_cast<const char*>(slices[0].begin());
    } else if (bytes.size() > 0) {
      joined.resize(bytes.size());
      bytes.Copy(0, bytes.size(), joined.data());
      data = joined.data();
    }
    // Python copies what it needs before dispatch returns; the call lives until finish.
    dispatch_(call, index, data, bytes.size(), metadata.data(), metadata.size(), nullptr, nullptr,
              -1, deadline);
    return reactor;
  }

  std::deque<std::string> names_;
  std::vector<int> split_fields_;  // per method: the tensor field cut out of large requests, or 0
  size_t split_from_;
  Dispatch dispatch_;
};

struct Frontend {
  std::unique_ptr<RawService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

std::vector<std::string> split(const char* joined, size_t size) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t at = 0; at < size; ++at) {
    if (joined[at] == '\0') {
      parts.emplace_back(joined + start, at - start);
      start = at + 1;
    }
  }
  return parts;
}

void copy_error(const std::string& text, char* error, size_t error_size) {
  if (error_size == 0) return;
  std::strncpy(error, text.c_str(), error_size - 1);
  error[error_size - 1] = '\0';
}

}  // namespace

extern "C" {

// Adds one serialized FileDescriptorProto to the pool reflection answers from, once per process
// (a second add of the same file would abort in protobuf). Returns 1 if added, 0 if there already.
// The pool keeps pointing into the bytes it is given, so they are copied into storage kept for
// the life of the process; and it is not asked first, because a lookup that misses is cached.
int cuvil_frontend_add_descriptor(const char* name, const char* data, size_t size) {
  static std::mutex lock;
  static std::set<std::string> added;
  static std::deque<std::string> kept;
  std::lock_guard<std::mutex> guard(lock);
  if (!added.insert(name).second) return 0;
  const std::string& copy = kept.emplace_back(data, size);
  google::protobuf::DescriptorPool::InternalAddGeneratedFile(copy.data(), static_cast<int>(size));
  return 1;
}

// Starts a server on address ("host:port"); methods: "/pkg.Service/Method" names, each ended
// by '\0'; split_fields: per method, the field number of its tensor bytes (0: none), cut out of
// requests of split_from bytes or more; streaming: per method, 1 for a bidirectional stream.
// With a certificate and key (PEM files) it serves TLS, and with a client CA too it requires
// and verifies a client certificate signed by it (mTLS); the files are read again every
// reload_s seconds, so a renewed certificate applies without a restart. Empty paths serve
// plaintext. Returns a handle, or null with the reason in error.
void* cuvil_frontend_start(const char* address, const char* methods, size_t methods_size,
                           const int* split_fields, const int* streaming, size_t split_from,
                           int max_message_bytes, const char* cert_path, const char* key_path,
                           const char* client_ca_path, int reload_s, Dispatch dispatch,
                           char* error, size_t error_size) {
  auto frontend = std::make_unique<Frontend>();
  frontend->service = std::make_unique<RawService>(split(methods, methods_size), split_fields,
                                                   streaming, split_from, dispatch);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (cert_path[0] != '\0') {
    bool mutual = client_ca_path[0] != '\0';
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        key_path, cert_path, client_ca_path, static_cast<unsigned int>(reload_s));
    grpc::experimental::TlsServerCredentialsOptions options(provider);
    options.watch_identity_key_cert_pairs();
    if (mutual) {
      options.watch_root_certs();
      options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    credentials = grpc::experimental::TlsServerCredentials(options);
  }
  builder.AddListeningPort(address, credentials, &frontend->port);
  builder.RegisterService(frontend->service.get());
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  frontend->server = builder.BuildAndStart();
  if (!frontend->server || frontend->port == 0) {
    copy_error(std::string("could not listen on ") + address, error, error_size);
    return nullptr;
  }
  return frontend.release();
}

int cuvil_frontend_port(void* handle) { return static_cast<Frontend*>(handle)->port; }

// Health: service "" is the whole server.
void cuvil_frontend_set_serving(void* handle, const char* service, int serving) {
  auto* frontend = static_cast<Frontend*>(handle);
  frontend->server->GetHealthCheckService()->SetServingStatus(service, serving != 0);
}

// Answers a call (or a stream's message): code 0 sends data as the response message, any other
// code fails the call (ends the stream) with message. Each call is finished exactly once.
void cuvil_frontend_finish(void* handle, int code, const char* message, const char* data,
                           size_t size) {
  auto* call = static_cast<Call*>(handle);
  call->Finish(code, message, data, size);
  delete call;
}

// Writes one answer to a stream's message without finishing it (more answers follow, then
// cuvil_frontend_finish with code 0 and no data); with `more` nonzero it waits in the stream's
// queue for the next write without it. 1 if queued, 0 if nothing more can be written to its
// stream (failed or cancelled) or the call is unary. Only for a call not yet finished.
int cuvil_frontend_write(void* handle, const char* data, size_t size, int more) {
  return static_cast<Call*>(handle)->Write(data, size, more != 0) ? 1 : 0;
}

// 1 if the call (or the stream whose message it is) was cancelled, else 0; only for a call not
// yet finished.
int cuvil_frontend_cancelled(void* handle) { return static_cast<Call*>(handle)->Cancelled(); }

// Stops taking calls and gives those in flight grace_ms to finish; then cancels the rest.
void cuvil_frontend_stop(void* handle, int grace_ms) {
  auto* frontend = static_cast<Frontend*>(handle);
  frontend->server->Shutdown(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(grace_ms));
  frontend->server->Wait();
}

// Frees a split request's tensor buffer, once nothing reads it any more.
void cuvil_frontend_release(char* tensors) { std::free(tensors); }

// Frees a stopped server; every call it handed over must have been finished.
void cuvil_frontend_free(void* handle) { delete static_cast<Frontend*>(handle); }

}  // extern "C"
