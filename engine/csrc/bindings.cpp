// The one binding file: exposes each ISA's kernel table as a `Kernels` object.
// Arguments are raw addresses (tensor.data_ptr()) plus sizes; cpuserve/model_executor/ops.py
// checks shapes, dtypes and contiguity before anything reaches this file.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <omp.h>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#include "comm/shm_comm.hpp"
#include "kernel_table.hpp"
#include "kernels/prefetch.hpp"
#include "kernels/quant_format.hpp"
#include "platform/numa.hpp"
#include "runner/decoder_step.hpp"

namespace py = pybind11;
using cpuserve::DType;
using cpuserve::KernelTable;

namespace {

template <typename T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

DType to_dtype(int d) {
  if (d < 0 || d > 4) throw std::invalid_argument("unknown dtype code " + std::to_string(d));
  return static_cast<DType>(d);
}

struct Kernels {
  const KernelTable* t;
  explicit Kernels(const std::string& isa) {
    t = isa.empty() ? cpuserve::best_table() : cpuserve::table_by_name(isa.c_str());
    if (t == nullptr) throw std::invalid_argument("ISA '" + isa + "' is not compiled in or not supported by this CPU");
  }
};

cpuserve::QFormat qformat_checked(int t, int64_t k) {
  const cpuserve::QFormat f = cpuserve::qformat(t);
  if (f.block == 0) throw std::invalid_argument("unsupported GGUF quantization type id " + std::to_string(t));
  if (k % f.block != 0)
    throw std::invalid_argument(std::to_string(k) + " input features are not a multiple of the block of " +
                                std::to_string(f.block));
  return f;
}


std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (const char* n : cpuserve::kIsaNames)
    if (cpuserve::table_by_name(n) != nullptr) out.emplace_back(n);
  return out;
}

// DecodeFetch (kernels/prefetch.hpp) by the names CPUSERVE_DECODE_FETCH takes
const char* fetch_name(cpuserve::DecodeFetch f) { return f == cpuserve::DecodeFetch::kL2Ahead ? "l2" : "nta"; }
cpuserve::DecodeFetch fetch_named(const std::string& name) {
  if (name == "nta") return cpuserve::DecodeFetch::kNonTemporal;
  if (name == "l2") return cpuserve::DecodeFetch::kL2Ahead;
  throw std::invalid_argument("decode fetch '" + name + "' is not one of: nta, l2");
}

void bind_decode_fetch(py::module_& m) {
  m.def("decode_fetch", []() { return fetch_name(cpuserve::decode_fetch()); },
        "how decode GEMVs ask for their weights' lines: 'nta' (the next k step's, non-temporal) or 'l2' "
        "(8 k steps ahead, into L2); chosen for the CPU's vendor");
  m.def("set_decode_fetch", [](const std::string& name) { cpuserve::set_decode_fetch(fetch_named(name)); },
        py::arg("name"));
  m.def("decode_fetch_for", [](const std::string& vendor) { return fetch_name(cpuserve::decode_fetch_for(vendor.c_str())); },
        py::arg("vendor"), "the choice for a CPUID vendor string");
}

using G = py::call_guard<py::gil_scoped_release>;  // the kernels and the runner run without the GIL
using KernelsClass = py::class_<Kernels>;

// -- CPU platform: affinity and NUMA memory policy (errno returned, never raised)
void bind_platform(py::module_& m) {
  m.def("get_mempolicy", []() {
    auto p = cpuserve::get_mempolicy();
    return py::make_tuple(p.err, p.mode, p.nodes);
  }, "(errno, mode, nodes) of the calling thread");
  m.def("set_membind", [](const std::vector<int>& nodes) { return cpuserve::set_mempolicy(cpuserve::kMpolBind, nodes); },
        "MPOL_BIND the calling thread to nodes; returns errno or 0");
  m.def("set_mempolicy_default", []() { return cpuserve::set_mempolicy(cpuserve::kMpolDefault, {}); });
  m.def("migrate_pages", &cpuserve::migrate_pages, py::arg("pid"), py::arg("from_nodes"), py::arg("to_nodes"),
        "(errno, pages not moved)");
  m.def("bind_omp_threads", &cpuserve::bind_omp_threads, py::arg("cpus"), py::arg("mem_node") = -1,
        "pin OpenMP thread i to cpus[i] (and bind its memory); returns (affinity errno, mempolicy errno)");
  m.def("omp_thread_cpus", &cpuserve::omp_thread_cpus);
  m.def("line_transfer_ns", &cpuserve::line_transfer_ns, py::arg("rounds") = 20000, py::arg("trials") = 3,
        py::call_guard<py::gil_scoped_release>());
  m.def("populate", [](uintptr_t p, size_t n) {
    py::gil_scoped_release release;
    return cpuserve::populate(reinterpret_cast<void*>(p), n);
  }, "fault in [p, p + n)'s pages as writes would, contents unchanged, over the OpenMP threads; errno or 0");
}

// -- tensor-parallel communication over shared memory
void bind_comm(py::module_& m) {
  using cpuserve::ShmComm;
  py::class_<ShmComm>(m, "ShmComm")
      .def(py::init<const std::string&, int, int, int64_t>(), py::arg("name"), py::arg("rank"), py::arg("world"),
           py::arg("slot_bytes") = int64_t(4) << 20, G())
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("world", &ShmComm::world)
      .def_property_readonly("slot_bytes", &ShmComm::slot_bytes)
      .def_property_readonly("seq", &ShmComm::seq)
      .def_property_readonly("wait_seconds", &ShmComm::wait_seconds)
      .def("reset_wait", &ShmComm::reset_wait)
      .def("all_reduce", [](ShmComm& c, uintptr_t data, int64_t n, int dtype) {
             if (dtype != 0 && dtype != 1) throw std::invalid_argument("all_reduce supports float32 and bfloat16");
             c.all_reduce(ptr<void>(data), n, static_cast<cpuserve::CommDType>(dtype));
           }, G())
      .def("all_gather", [](ShmComm& c, uintptr_t in, uintptr_t out, const std::vector<int64_t>& sizes) {
             c.all_gather(ptr<const void>(in), ptr<void>(out), sizes);
           }, G())
      .def("barrier", &ShmComm::barrier, G())
      .def("abort", &ShmComm::abort)
      .def("unlink", &ShmComm::unlink);
}

using cpuserve::DecoderLayerDesc;
using cpuserve::DecoderStack;
using cpuserve::LinearDesc;
// A linear: (k, bias address or 0, [(weight address, kind, n), ...]); kind: DType code, 16 + ggml type, kInt8Kind (+ 1) or kQDotKind + ggml type.
using LinearSpec = std::tuple<int64_t, uintptr_t, std::vector<std::tuple<uintptr_t, int, int64_t>>>;

LinearDesc to_linear(const LinearSpec& s) {
  LinearDesc l;
  l.k = std::get<0>(s);
  l.bias = std::get<1>(s) ? ptr<const float>(std::get<1>(s)) : nullptr;
  for (const auto& [w, kind, n] : std::get<2>(s)) {
    if (kind >= cpuserve::kQDotKind) qformat_checked(kind - cpuserve::kQDotKind, l.k);
    else if (kind == cpuserve::kInt8Kind || kind == cpuserve::kInt8Kind + 1) {}  // W8A8
    else if (kind >= 16) qformat_checked(kind - 16, l.k);
    else to_dtype(kind);
    l.parts.push_back({ptr<const void>(w), kind, n});
    l.n += n;
  }
  return l;
}

void add_decoder_layer(DecoderStack& st, uintptr_t in_norm, uintptr_t post_norm, float eps, const LinearSpec& qkv,
                       const LinearSpec& o, const LinearSpec& gate_up, const LinearSpec& down, uintptr_t q_norm,
                       uintptr_t k_norm, int64_t hq, int64_t hk, int64_t d, int64_t group, int64_t q_off, float scale,
                       int64_t window, float softcap, uintptr_t cos_sin, int64_t rot_dim, bool neox, uintptr_t kc,
                       uintptr_t vc, int kv_dtype, int64_t block_size, float k_scale, float v_scale) {
  DecoderLayerDesc L;
  L.in_norm = ptr<const float>(in_norm);
  L.post_norm = ptr<const float>(post_norm);
  L.eps = eps;
  L.qkv = to_linear(qkv);
  L.o = to_linear(o);
  L.gate_up = to_linear(gate_up);
  L.down = to_linear(down);
  L.q_norm = q_norm ? ptr<const float>(q_norm) : nullptr;
  L.k_norm = k_norm ? ptr<const float>(k_norm) : nullptr;
  L.hq = hq; L.hk = hk; L.d = d; L.group = group; L.q_off = q_off;
  L.scale = scale; L.window = window; L.softcap = softcap;
  L.cos_sin = ptr<const float>(cos_sin);
  L.rot_dim = rot_dim; L.neox = neox;
  L.k_cache = ptr<void>(kc); L.v_cache = ptr<void>(vc);
  L.kv_dtype = to_dtype(kv_dtype);
  L.block_size = block_size; L.k_scale = k_scale; L.v_scale = v_scale;
  if (L.qkv.n != (hq + 2 * hk) * d || L.o.k != hq * d || L.gate_up.n != 2 * L.down.k)
    throw std::invalid_argument("decoder layer shapes do not fit together");
  st.add_layer(L);
}

// -- the decoder stack: a decode step's layers in one native call
void bind_runner(py::module_& m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init([](const Kernels& k, int64_t hidden, int64_t inter) {
             return new DecoderStack(k.t, hidden, inter);
           }), py::arg("kernels"), py::arg("hidden"), py::arg("intermediate"))
      .def("__len__", &DecoderStack::size)
      .def("add_layer", &add_decoder_layer)
      .def("set_embedding", [](DecoderStack& st, uintptr_t table, int dtype, int64_t rows) {
             st.set_embedding(ptr<const void>(table), to_dtype(dtype), rows);
           })
      .def("set_final_norm", [](DecoderStack& st, uintptr_t w, float eps) {
             st.set_final_norm(ptr<const float>(w), eps);
           })
      // ids: token ids to look up in the embedding (0: h holds the embeddings)
      .def("run", [](DecoderStack& st, uintptr_t ids, uintptr_t h, uintptr_t residual, bool residual_valid,
                     int64_t tokens, uintptr_t positions, uintptr_t slots, uintptr_t tables, int64_t max_blocks,
                     uintptr_t seq_lens, uintptr_t qsl, int64_t num_seqs) {
             st.run(ids ? ptr<const int64_t>(ids) : nullptr, ptr<float>(h), ptr<float>(residual), residual_valid,
                    {tokens, ptr<const int64_t>(positions), ptr<const int64_t>(slots), ptr<const int32_t>(tables),
                     max_blocks, ptr<const int32_t>(seq_lens), ptr<const int32_t>(qsl), num_seqs});
           }, G())
      .def("set_timing", &DecoderStack::set_timing, py::arg("on"))
      .def("reset_timings", &DecoderStack::reset_timings)
      // seconds per kernel category since the last reset, for the categories timed at all
      .def("timings", [](const DecoderStack& st) {
             py::dict out;
             const auto& spent = st.timings();
             for (int i = 0; i < cpuserve::kStepParts; ++i)
               if (spent[i] > 0.0) out[cpuserve::kStepPartNames[i]] = spent[i];
             return out;
           });
}

// -- a layer's kernels other than the linears
void bind_layer_kernels(KernelsClass& cls) {
  cls.def("rms_norm", [](const Kernels& k, uintptr_t out, uintptr_t x, uintptr_t w, int64_t rows, int64_t dim,
                          int64_t xs, int64_t os, float eps) {
             k.t->rms_norm(ptr<float>(out), ptr<const float>(x), ptr<const float>(w), rows, dim, xs, os, eps);
           }, G())
      .def("fused_add_rms_norm", [](const Kernels& k, uintptr_t x, uintptr_t res, uintptr_t w, int64_t rows,
                                    int64_t dim, int64_t xs, int64_t rs, float eps) {
             k.t->fused_add_rms_norm(ptr<float>(x), ptr<float>(res), ptr<const float>(w), rows, dim, xs, rs, eps);
           }, G())
      .def("rotary", [](const Kernels& k, uintptr_t q, uintptr_t kk, uintptr_t pos, uintptr_t cs, int64_t tokens,
                        int64_t hq, int64_t hk, int64_t d, int64_t rot, int64_t qs, int64_t ks, bool neox) {
             k.t->rotary(ptr<float>(q), ptr<float>(kk), ptr<const int64_t>(pos), ptr<const float>(cs), tokens, hq,
                         hk, d, rot, qs, ks, neox);
           }, G())
      .def("silu_and_mul", [](const Kernels& k, uintptr_t out, uintptr_t x, int64_t tokens, int64_t d, int64_t xs,
                              int64_t os) {
             k.t->silu_and_mul(ptr<float>(out), ptr<const float>(x), tokens, d, xs, os);
           }, G())
      .def("gelu_and_mul", [](const Kernels& k, uintptr_t out, uintptr_t x, int64_t tokens, int64_t d, int64_t xs,
                              int64_t os, bool tanh_approx) {
             k.t->gelu_and_mul(ptr<float>(out), ptr<const float>(x), tokens, d, xs, os, tanh_approx);
           }, G())
      .def("reshape_and_cache", [](const Kernels& k, uintptr_t key, uintptr_t value, uintptr_t kc, uintptr_t vc,
                                   int dt, uintptr_t slots, int64_t tokens, int64_t heads, int64_t d, int64_t bs,
                                   int64_t ks, int64_t vs, float k_scale, float v_scale) {
             k.t->reshape_and_cache(ptr<const float>(key), ptr<const float>(value), ptr<void>(kc), ptr<void>(vc),
                                    to_dtype(dt), ptr<const int64_t>(slots), tokens, heads, d, bs, ks, vs, k_scale,
                                    v_scale);
           }, py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("dtype"),
           py::arg("slots"), py::arg("tokens"), py::arg("heads"), py::arg("head_dim"), py::arg("block_size"),
           py::arg("key_stride"), py::arg("value_stride"), py::arg("k_scale") = 1.f, py::arg("v_scale") = 1.f, G())
      .def("paged_attention", [](const Kernels& k, uintptr_t out, uintptr_t q, uintptr_t kc, uintptr_t vc, int dt,
                                 uintptr_t tables, int64_t max_blocks, uintptr_t seq_lens, uintptr_t qsl,
                                 int64_t num_seqs, int64_t hq, int64_t hk, int64_t group, int64_t q_off, int64_t d,
                                 int64_t bs, float scale, int64_t window, float softcap, int64_t qs, int64_t os,
                                 float k_scale, float v_scale) {
             k.t->paged_attention(ptr<float>(out), ptr<const float>(q), ptr<const void>(kc), ptr<const void>(vc),
                                  to_dtype(dt), ptr<const int32_t>(tables), max_blocks, ptr<const int32_t>(seq_lens),
                                  ptr<const int32_t>(qsl), num_seqs, hq, hk, group, q_off, d, bs, scale, window,
                                  softcap, qs, os, k_scale, v_scale);
           }, py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("dtype"),
           py::arg("block_tables"), py::arg("max_blocks"), py::arg("seq_lens"), py::arg("query_start_loc"),
           py::arg("num_seqs"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("group"),
           py::arg("q_head_offset"), py::arg("head_dim"), py::arg("block_size"), py::arg("scale"),
           py::arg("sliding_window"), py::arg("softcap"), py::arg("q_stride"), py::arg("out_stride"),
           py::arg("k_scale") = 1.f, py::arg("v_scale") = 1.f, G());
}

// -- float linears, and the roofline's read probe, the sampler's argmax and the greedy LM head
void bind_float_kernels(KernelsClass& cls) {
  cls.def("pack_weight", [](const Kernels& k, uintptr_t dst, uintptr_t src, int dt, int64_t n, int64_t kk) {
             k.t->pack_weight(ptr<void>(dst), ptr<const void>(src), to_dtype(dt), n, kk);
           }, G())
      .def("gemm", [](const Kernels& k, uintptr_t c, uintptr_t a, uintptr_t w, int dt, uintptr_t bias, int64_t m,
                      int64_t n, int64_t kk, int64_t lda, int64_t ldc) {
             k.t->gemm(ptr<float>(c), ptr<const float>(a), ptr<const void>(w), to_dtype(dt),
                       bias ? ptr<const float>(bias) : nullptr, m, n, kk, lda, ldc);
           }, G())
      .def("gemm_silu", [](const Kernels& k, uintptr_t act, uintptr_t a, uintptr_t w, int dt, int64_t m, int64_t f,
                           int64_t kk, int64_t lda, int64_t ldo) {
             k.t->gemm_silu(ptr<float>(act), ptr<const float>(a), ptr<const void>(w), to_dtype(dt), m, f, kk, lda, ldo);
           }, G())
      .def("read_sum", [](const Kernels& k, uintptr_t x, int64_t n) { return k.t->read_sum(ptr<const float>(x), n); },
           G())
      .def("peak_flops", [](const Kernels& k, bool pairs, int64_t steps) { return k.t->peak_flops(pairs, steps); },
           G())
      .def("argmax", [](const Kernels& k, uintptr_t out, uintptr_t x, int64_t rows, int64_t n, int64_t xs) {
             k.t->argmax(ptr<int64_t>(out), ptr<const float>(x), rows, n, xs);
           }, G())
      .def("greedy_head", [](const Kernels& k, uintptr_t out, uintptr_t approx, int64_t as, uintptr_t x, int64_t xs,
                             uintptr_t w, uintptr_t norms, float norm_max, int bound, int64_t rows, int64_t n,
                             int64_t kk) {
             return k.t->greedy_head(ptr<int64_t>(out), ptr<const float>(approx), as, ptr<const float>(x), xs,
                                     ptr<const float>(w), ptr<const float>(norms), norm_max, bound, rows, n, kk);
           }, G());
}

// -- quantized linears: GGUF blocks widened in registers, W8A8 int8 and int8-activation dot products
void bind_quant_kernels(KernelsClass& cls) {
  cls.def("qgemm_silu", [](const Kernels& k, uintptr_t act, uintptr_t a, uintptr_t w, int qt, int64_t m, int64_t f,
                            int64_t kk, int64_t lda, int64_t ldo) {
             qformat_checked(qt, kk);
             k.t->qgemm_silu(ptr<float>(act), ptr<const float>(a), ptr<const uint8_t>(w), qt, m, f, kk, lda, ldo);
           }, G())
      .def("qpacked_bytes", [](const Kernels& k, int qt, int64_t n, int64_t kk) {
             qformat_checked(qt, kk);
             return cpuserve::qpacked_bytes(qt, n, kk, k.t->gemm_nr);
           })
      .def("qpack", [](const Kernels& k, uintptr_t dst, uintptr_t src, int qt, int64_t n, int64_t kk) {
             qformat_checked(qt, kk);
             k.t->qpack(ptr<uint8_t>(dst), ptr<const uint8_t>(src), qt, n, kk);
           }, G())
      .def("qgemm", [](const Kernels& k, uintptr_t c, uintptr_t a, uintptr_t w, int qt, uintptr_t bias, int64_t m,
                       int64_t n, int64_t kk, int64_t lda, int64_t ldc) {
             qformat_checked(qt, kk);
             k.t->qgemm(ptr<float>(c), ptr<const float>(a), ptr<const uint8_t>(w), qt,
                        bias ? ptr<const float>(bias) : nullptr, m, n, kk, lda, ldc);
           }, G())
      .def("qrows", [](const Kernels& k, uintptr_t out, uintptr_t w, int qt, uintptr_t ids, int64_t count,
                       int64_t kk) {
             qformat_checked(qt, kk);
             k.t->qrows(ptr<float>(out), ptr<const uint8_t>(w), qt, ptr<const int64_t>(ids), count, kk);
           }, G())
      .def("i8packed_bytes", [](const Kernels& k, int64_t n, int64_t kk) { return k.t->i8packed_bytes(n, kk); })
      .def("i8pack", [](const Kernels& k, uintptr_t dst, uintptr_t w, uintptr_t scale, int64_t n, int64_t kk) {
             k.t->i8pack(ptr<uint8_t>(dst), ptr<const int8_t>(w), ptr<const float>(scale), n, kk);
           }, G())
      .def("i8gemm", [](const Kernels& k, uintptr_t c, uintptr_t a, uintptr_t w, uintptr_t bias, int64_t m, int64_t n,
                        int64_t kk, int64_t lda, int64_t ldc, bool act_asym) {
             k.t->i8gemm(ptr<float>(c), ptr<const float>(a), ptr<const uint8_t>(w),
                         bias ? ptr<const float>(bias) : nullptr, m, n, kk, lda, ldc, act_asym);
           }, G())
      .def("i8gemm_silu", [](const Kernels& k, uintptr_t act, uintptr_t a, uintptr_t w, int64_t m, int64_t f,
                             int64_t kk, int64_t lda, int64_t ldo, bool act_asym) {
             k.t->i8gemm_silu(ptr<float>(act), ptr<const float>(a), ptr<const uint8_t>(w), m, f, kk, lda, ldo, act_asym);
           }, G())
      .def("qdpacked_bytes", [](const Kernels& k, int qt, int64_t n, int64_t kk) {
             qformat_checked(qt, kk);
             return k.t->qdpacked_bytes(qt, n, kk);
           })
      .def("qdpack", [](const Kernels& k, uintptr_t dst, uintptr_t src, int qt, int64_t n, int64_t kk) {
             qformat_checked(qt, kk);
             k.t->qdpack(ptr<uint8_t>(dst), ptr<const uint8_t>(src), qt, n, kk);
           }, G())
      .def("qdgemm_silu", [](const Kernels& k, uintptr_t act, uintptr_t a, uintptr_t w, int qt, int64_t m, int64_t f,
                             int64_t kk, int64_t lda, int64_t ldo) {
             qformat_checked(qt, kk);
             k.t->qdgemm_silu(ptr<float>(act), ptr<const float>(a), ptr<const uint8_t>(w), qt, m, f, kk, lda, ldo);
           }, G())
      .def("qdgemm", [](const Kernels& k, uintptr_t c, uintptr_t a, uintptr_t w, int qt, uintptr_t bias, int64_t m,
                        int64_t n, int64_t kk, int64_t lda, int64_t ldc) {
             qformat_checked(qt, kk);
             k.t->qdgemm(ptr<float>(c), ptr<const float>(a), ptr<const uint8_t>(w), qt,
                         bias ? ptr<const float>(bias) : nullptr, m, n, kk, lda, ldc);
           }, G())
      .def("qdrows", [](const Kernels& k, uintptr_t out, uintptr_t w, int qt, uintptr_t ids, int64_t count,
                        int64_t kk) {
             qformat_checked(qt, kk);
             k.t->qdrows(ptr<float>(out), ptr<const uint8_t>(w), qt, ptr<const int64_t>(ids), count, kk);
           }, G());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpuserve native kernels";
  m.def("available_isas", &available_isas, "ISAs compiled in and supported by this CPU, best first");
  m.def("omp_max_threads", []() { return omp_get_max_threads(); });
  m.def("omp_set_num_threads", [](int n) { omp_set_num_threads(n); });
  bind_decode_fetch(m);
  bind_platform(m);
  bind_comm(m);
  bind_runner(m);
  KernelsClass kernels(m, "Kernels");
  kernels.def(py::init<const std::string&>(), py::arg("isa") = "")
      .def_property_readonly("isa", [](const Kernels& k) { return std::string(k.t->isa); })
      .def_property_readonly("vec_width", [](const Kernels& k) { return k.t->vec_width; })
      .def_property_readonly("gemm_nr", [](const Kernels& k) { return k.t->gemm_nr; })
      .def_property_readonly("bf16_dot", [](const Kernels& k) { return k.t->bf16_dot; })
      .def_property_readonly("bf16_k_align", [](const Kernels& k) { return k.t->bf16_k_align; });
  bind_layer_kernels(kernels);
  bind_float_kernels(kernels);
  bind_quant_kernels(kernels);
}
