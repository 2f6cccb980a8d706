// The C ABI between verl-distributed (Rust) and PyTorch's c10d: a TCPStore for rendezvous and
// metadata, a process group (Gloo; NCCL with VERL_DIST_NCCL), and collectives returning a Work
// handle that Rust waits on in slices. Every entry point catches every C++ exception and returns
// its message through `err` (malloc'd; freed with vd_free); nothing throws across the boundary.
// Tensors arrive as tch's raw pointers, which are `at::Tensor*`.

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef VERL_DIST_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace {

struct Store {
  c10::intrusive_ptr<c10d::Store> store;
};

struct Group {
  c10::intrusive_ptr<c10d::Backend> backend;
};

struct WorkHandle {
  c10::intrusive_ptr<c10d::Work> work;
};

char* copy_string(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, text.c_str(), text.size() + 1);
  }
  return out;
}

// Runs `body`, turning any exception into a message in `*err`; returns false on failure.
template <typename F>
bool guarded(char** err, F&& body) {
  try {
    body();
    return true;
  } catch (const c10::Error& e) {
    *err = copy_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    *err = copy_string(e.what());
  } catch (...) {
    *err = copy_string("unknown C++ exception");
  }
  return false;
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 0:
      return c10d::ReduceOp::SUM;
    case 1:
      return c10d::ReduceOp::MAX;
    case 2:
      return c10d::ReduceOp::MIN;
    default:
      TORCH_CHECK(false, "unknown reduce op ", op);
  }
}

std::chrono::milliseconds ms(int64_t value) {
  return std::chrono::milliseconds(value);
}

template <typename F>
WorkHandle* start(char** err, F&& launch) {
  WorkHandle* handle = nullptr;
  guarded(err, [&] { handle = new WorkHandle{launch()}; });
  return handle;
}

} // namespace

extern "C" {

void vd_free(void* ptr) {
  std::free(ptr);
}

// c10d logs every connection retry and teardown at WARNING; unless the user chose a level with
// TORCH_CPP_LOG_LEVEL, only FATAL gets through (our errors carry what matters). Log lines that
// remain say which rank wrote them.
void vd_quiet_logs(int64_t rank) {
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) {
    FLAGS_caffe2_log_level = 3;
  }
  c10::SetGlobalRank(rank);
}

// A TCPStore client of host:port, or its server when is_server (rank 0 hosts the store).
// `timeout_ms` bounds connecting and every later blocking call.
Store* vd_store_new(
    const char* host,
    uint16_t port,
    int is_server,
    int64_t world_size,
    int64_t timeout_ms,
    char** err) {
  Store* out = nullptr;
  guarded(err, [&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = is_server != 0;
    options.numWorkers = static_cast<std::size_t>(world_size);
    // Joining is checked by the caller through keys, which can name the missing ranks.
    options.waitWorkers = false;
    options.timeout = ms(timeout_ms);
    out = new Store{c10::make_intrusive<c10d::TCPStore>(host, options)};
  });
  return out;
}

void vd_store_free(Store* store) {
  delete store;
}

bool vd_store_set(
    Store* store,
    const char* key,
    const uint8_t* data,
    size_t len,
    char** err) {
  return guarded(err, [&] {
    store->store->set(key, std::vector<uint8_t>(data, data + len));
  });
}

// Whether every one of keys[0..n) is set, without waiting.
bool vd_store_check(
    Store* store,
    const char* const* keys,
    size_t n,
    int* exists,
    char** err) {
  return guarded(err, [&] {
    std::vector<std::string> names(keys, keys + n);
    *exists = store->store->check(names) ? 1 : 0;
  });
}

// The values of keys[0..n) in one round trip (waiting for each up to the store's timeout):
// concatenated into *data (malloc'd), value i's length in lens[i].
bool vd_store_multi_get(
    Store* store,
    const char* const* keys,
    size_t n,
    uint8_t** data,
    size_t* lens,
    char** err) {
  return guarded(err, [&] {
    std::vector<std::string> names(keys, keys + n);
    std::vector<std::vector<uint8_t>> values = store->store->multiGet(names);
    TORCH_CHECK(values.size() == n, "multiGet returned ", values.size(), " values for ", n, " keys");
    size_t total = 0;
    for (const auto& value : values) {
      total += value.size();
    }
    *data = static_cast<uint8_t*>(std::malloc(total == 0 ? 1 : total));
    TORCH_CHECK(*data != nullptr, "out of memory for ", total, " bytes of store values");
    size_t offset = 0;
    for (size_t i = 0; i < n; ++i) {
      lens[i] = values[i].size();
      std::memcpy(*data + offset, values[i].data(), values[i].size());
      offset += values[i].size();
    }
  });
}

// A process group of `size` ranks over `store`: backend 0 = Gloo, 1 = NCCL (when compiled in).
// `timeout_ms` is the group's own bound on connecting and on each collective.
Group* vd_group_new(
    Store* store,
    const char* prefix,
    int backend,
    int rank,
    int size,
    int64_t timeout_ms,
    char** err) {
  Group* out = nullptr;
  guarded(err, [&] {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store->store);
    if (backend == 0) {
      auto options = c10d::ProcessGroupGloo::Options::create(ms(timeout_ms));
      // As torch.distributed: GLOO_SOCKET_IFNAME (comma-separated) picks the interfaces,
      // else the address this host name resolves to (loopback when it resolves to none).
      const char* interfaces = std::getenv("GLOO_SOCKET_IFNAME");
      if (interfaces != nullptr && interfaces[0] != '\0') {
        std::string list(interfaces);
        size_t begin = 0;
        while (begin <= list.size()) {
          size_t end = list.find(',', begin);
          if (end == std::string::npos) {
            end = list.size();
          }
          if (end > begin) {
            options->devices.push_back(
                c10d::ProcessGroupGloo::createDeviceForInterface(
                    list.substr(begin, end - begin)));
          }
          begin = end + 1;
        }
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      out = new Group{c10::make_intrusive<c10d::ProcessGroupGloo>(
          prefixed, rank, size, options)};
      return;
    }
#ifdef VERL_DIST_NCCL
    if (backend == 1) {
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = ms(timeout_ms);
      out = new Group{c10::make_intrusive<c10d::ProcessGroupNCCL>(
          prefixed, rank, size, options)};
      return;
    }
#endif
    TORCH_CHECK(false, "backend ", backend, " is not compiled into this shim");
  });
  return out;
}

void vd_group_free(Group* group) {
  delete group;
}

WorkHandle* vd_all_reduce(Group* group, at::Tensor* tensor, int op, char** err) {
  return start(err, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(op);
    return group->backend->allreduce(tensors, options);
  });
}

WorkHandle* vd_broadcast(Group* group, at::Tensor* tensor, int root, char** err) {
  return start(err, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    return group->backend->broadcast(tensors, options);
  });
}

// Gathers `input` of every rank into outputs[0..n) (one tensor per rank, like input).
WorkHandle* vd_all_gather(
    Group* group,
    at::Tensor** outputs,
    size_t n,
    at::Tensor* input,
    char** err) {
  return start(err, [&] {
    std::vector<std::vector<at::Tensor>> out(1);
    for (size_t i = 0; i < n; ++i) {
      out[0].push_back(*outputs[i]);
    }
    std::vector<at::Tensor> in{*input};
    return group->backend->allgather(out, in);
  });
}

// Gathers `input` of every rank into the flat `output` (world size × input's elements).
WorkHandle* vd_all_gather_flat(
    Group* group,
    at::Tensor* output,
    at::Tensor* input,
    char** err) {
  return start(err, [&] { return group->backend->_allgather_base(*output, *input); });
}

// Reduces the flat `input` (world size × output's elements) over ranks; rank r keeps slice r.
WorkHandle* vd_reduce_scatter_flat(
    Group* group,
    at::Tensor* output,
    at::Tensor* input,
    int op,
    char** err) {
  return start(err, [&] {
    c10d::ReduceScatterOptions options;
    options.reduceOp = reduce_op(op);
    return group->backend->_reduce_scatter_base(*output, *input, options);
  });
}

WorkHandle* vd_barrier(Group* group, char** err) {
  return start(err, [&] { return group->backend->barrier(); });
}

// Waits up to `timeout_ms` for the work: 1 = done, 0 = still running, -1 = failed (*err set).
int vd_work_wait(WorkHandle* handle, int64_t timeout_ms, char** err) {
  int state = -1;
  bool ok = guarded(err, [&] {
    try {
      handle->work->wait(ms(timeout_ms));
      state = 1;
    } catch (...) {
      // Work::wait throws both when the slice ends and when the collective failed.
      if (!handle->work->isCompleted()) {
        state = 0;
        return;
      }
      // Completed: it failed, or it finished between the slice's end and the check above
      // (then the first exception is only the slice's timeout). Waiting again on completed
      // work returns at once or throws the collective's own error.
      handle->work->wait(ms(timeout_ms));
      state = 1;
    }
  });
  return ok ? state : -1;
}

void vd_work_free(WorkHandle* handle) {
  delete handle;
}

} // extern "C"
