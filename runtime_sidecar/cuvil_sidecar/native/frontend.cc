// The sidecar's native gRPC front end: gRPC C++ (callback API) takes the HTTP/2 work, the
// handlers stay in Python. Loaded with ctypes by cuvil_sidecar.native; every entry point is
// extern "C".
//
// Each unary method of the served services is registered raw (bytes in, bytes out). A call is
// handed to Python's dispatch callback with its request bytes and metadata; Python answers,
// from any thread and at any time, with cuvil_frontend_finish. Health (grpc.health.v1, Check and
// Watch) and reflection come from gRPC C++ itself; the service descriptors reflection serves
// are given by Python as serialized FileDescriptorProtos.
#include <google/protobuf/descriptor.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/codegen/server_callback_handlers.h>
#include <grpcpp/impl/codegen/service_type.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

// dispatch(call, method index, request bytes, size, metadata, size); the metadata is each key
// and value in turn, each as a native uint32 length and its bytes (binary values hold NULs).
using Dispatch = void (*)(void*, int, const char*, size_t, const char*, size_t);

void append_sized(std::string& out, const char* data, size_t size) {
  uint32_t length = static_cast<uint32_t>(size);
  out.append(reinterpret_cast<const char*>(&length), sizeof length).append(data, size);
}

struct Call {
  grpc::ServerUnaryReactor* reactor;
  grpc::ByteBuffer* response;
};

class RawService : public grpc::Service {
 public:
  RawService(const std::vector<std::string>& methods, Dispatch dispatch) : dispatch_(dispatch) {
    for (const std::string& method : methods) names_.push_back(method);
    for (size_t index = 0; index < names_.size(); ++index) {
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
    std::string joined;
    const char* data = "";
    size_t size = 0;
    if (request != nullptr && request->Dump(&slices).ok()) {
      if (slices.size() == 1) {
        data = reinterpret_cast<const char*>(slices[0].begin());
        size = slices[0].size();
      } else {
        for (const grpc::Slice& slice : slices)
          joined.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
        data = joined.data();
        size = joined.size();
      }
    }
    std::string metadata;
    for (const auto& [key, value] : context->client_metadata()) {
      append_sized(metadata, key.data(), key.size());
      append_sized(metadata, value.data(), value.size());
    }
    // Python copies what it needs before dispatch returns; the call lives until finish.
    dispatch_(new Call{reactor, response}, index, data, size, metadata.data(), metadata.size());
    return reactor;
  }

  std::deque<std::string> names_;
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
// by '\0'. Returns a handle, or null with the reason in error.
void* cuvil_frontend_start(const char* address, const char* methods, size_t methods_size,
                           int max_message_bytes, Dispatch dispatch, char* error,
                           size_t error_size) {
  auto frontend = std::make_unique<Frontend>();
  frontend->service = std::make_unique<RawService>(split(methods, methods_size), dispatch);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &frontend->port);
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

// Answers a call: code 0 sends data as the response message, any other code fails the call
// with message. Each call is finished exactly once.
void cuvil_frontend_finish(void* handle, int code, const char* message, const char* data,
                           size_t size) {
  auto* call = static_cast<Call*>(handle);
  if (code == 0) {
    grpc::Slice slice(data, size);
    *call->response = grpc::ByteBuffer(&slice, 1);
    call->reactor->Finish(grpc::Status::OK);
  } else {
    call->reactor->Finish(grpc::Status(static_cast<grpc::StatusCode>(code), message));
  }
  delete call;
}

// Stops taking calls and gives those in flight grace_ms to finish; then cancels the rest.
void cuvil_frontend_stop(void* handle, int grace_ms) {
  auto* frontend = static_cast<Frontend*>(handle);
  frontend->server->Shutdown(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(grace_ms));
  frontend->server->Wait();
}

// Frees a stopped server; every call it handed over must have been finished.
void cuvil_frontend_free(void* handle) { delete static_cast<Frontend*>(handle); }

}  // extern "C"
