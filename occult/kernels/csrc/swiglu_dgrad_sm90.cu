// The SwiGLU dgrad of occult's expert MLP as one CUTLASS grouped GEMM (Hopper, bf16), its SwiGLU backward in the
// epilogue: u = dy_sorted @ down[e] per expert (rows in sorted-pair order, fp32 accumulator, never written), then
//   d[a] = g u b silu'(a),  d[b] = g u silu(a)   (both bf16, into one [P, 2F] tensor: a-half, b-half)
//   dg   = sum_f u silu(a) b                     (fp32, per row)
// from the forward's saved [a; b] rows and the pair gates g. The same outputs as kernels.grouped_mm.swiglu_dgrad_grouped
// (torch._grouped_mm for u, then one elementwise pass), without u's round trip through memory.
//
// The epilogue is a CUTLASS epilogue visitor graph on the pointer-array (grouped) TMA warp-specialised epilogue: the
// b half comes in as the GEMM's C operand, the a half through an aux load, g as a column broadcast, d[a] through an
// aux store, d[b] as the GEMM's D, dg through a column reduction with atomics into the group's rows. Everything the
// launch needs per group (problem shapes, pointers, strides) is written on the GPU from the device offsets, so a
// launch never waits for the host and can be captured in a CUDA graph.
//
// C ABI (loaded with ctypes by scripts/probe_swiglu_dgrad_cutlass.py): no torch headers, so one build serves any torch.
// Build (CUTLASS 4.7.0 headers, nvcc 13.0):
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90a -DNDEBUG -Xcompiler -fPIC -shared -cudart static \
//     -I$CUTLASS/include -I$CUTLASS/tools/util/include swiglu_dgrad_sm90.cu -o libswiglu.so [variant flags]
// Variant flags (docs/kernels.md, session 49's table): OCCULT_PINGPONG, OCCULT_TILE_M/N, OCCULT_PLAIN (D = u only),
// OCCULT_NO_ALOAD / OCCULT_NO_AUXSTORE / OCCULT_NO_ROWSUM (that part left out), OCCULT_ALOAD_SUBTILE,
// OCCULT_DIRECT_STORE (d[a] from registers, no TMA).

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using cutlass::Array;

namespace occult_swiglu {

using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;  // dy rows [M, K]
using LayoutB = cutlass::layout::RowMajor;  // down[e] [K, N], N contiguous
using LayoutC = cutlass::layout::RowMajor;  // halves of [a; b] and d[a; b] rows, leading dimension 2F
constexpr int kAlign = 8;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

#ifndef OCCULT_TILE_N
#define OCCULT_TILE_N 128
#endif
#ifndef OCCULT_TILE_M
#define OCCULT_TILE_M 128
#endif
#ifdef OCCULT_PINGPONG
using TileShape = Shape<Int<OCCULT_TILE_M>, Int<OCCULT_TILE_N>, _64>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
#else
using TileShape = Shape<_128, Int<OCCULT_TILE_N>, _64>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
#endif
using ClusterShape = Shape<_1, _1, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using StrideRows = cutlass::detail::TagToStrideC_t<LayoutC>;

// ---- elementwise pieces of the SwiGLU backward (fp32 fragments) ----

CUTLASS_DEVICE float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

template <class T>
struct Sigmoid {
  CUTLASS_DEVICE T operator()(T const& a) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) out[i] = sigmoid(a[i]);
    return out;
  }
};

template <class T>
struct GateGradTerm {  // u silu(a) b
  CUTLASS_DEVICE T operator()(T const& u, T const& b, T const& silu) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) out[i] = u[i] * silu[i] * b[i];
    return out;
  }
};

template <class T>
struct GradA {  // g u b silu'(a) = g u b (s + silu(a) (1 - s)), s = sigmoid(a)
  CUTLASS_DEVICE T operator()(T const& u, T const& b, T const& s, T const& silu, T const& g) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) out[i] = g[i] * u[i] * b[i] * (s[i] + silu[i] * (1.f - s[i]));
    return out;
  }
};

template <class T>
struct GradB {  // g u silu(a)
  CUTLASS_DEVICE T operator()(T const& u, T const& silu, T const& g) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) out[i] = g[i] * u[i] * silu[i];
    return out;
  }
};

// ---- the column sum into each group's own rows (CUTLASS's Sm90ColReduction takes one pointer for all groups) ----

template <class CtaTileShapeMNK>
struct GroupedRowSum
    : cutlass::epilogue::fusion::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::atomic_add, 0, CtaTileShapeMNK,
                                                  float, float, kRound> {
  using Base = cutlass::epilogue::fusion::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::atomic_add, 0,
                                                           CtaTileShapeMNK, float, float, kRound>;
  using Base::Base;
  using typename Base::Params;

  struct Arguments {
    float* const* ptr_rows = nullptr;  // per group: its rows' sums (zeroed before the launch)
  };

  template <class ProblemShape_>
  static constexpr Params to_underlying_arguments(ProblemShape_ const&, Arguments const& args, void*) {
    Params p{};
    p.ptr_col = const_cast<float**>(args.ptr_rows);
    p.reduction_identity = 0.f;
    return p;
  }
  template <class ProblemShape_>
  static bool can_implement(ProblemShape_ const&, Arguments const&) { return true; }
  template <class ProblemShape_>
  static size_t get_workspace_size(ProblemShape_ const&, Arguments const&) { return 0; }
  template <class ProblemShape_>
  static cutlass::Status initialize_workspace(ProblemShape_ const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();
    using _W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, _W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    Layout inv_lane_layout_MN = right_inverse(lane_layout_MN);
    int lane_idx = cutlass::canonical_lane_idx();
    auto lane_mn = idx2crd(inv_lane_layout_MN(lane_idx), shape(lane_layout_MN));
    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, _W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    Layout inv_warp_layout_MN = right_inverse(warp_layout_MN);
    int warp_idx = args.thread_idx / cutlass::NumThreadsPerWarp;
    auto warp_mn = idx2crd(inv_warp_layout_MN(warp_idx), shape(warp_layout_MN));

    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    float* rows = reinterpret_cast<float* const*>(this->params.ptr_col)[l];
    // One group's rows; the L mode has stride 0 so the base class's (.., l) indexing stays on this group.
    Tensor mCol = make_tensor(make_gmem_ptr<float>(rows), make_shape(M, N, L), Stride<_1, _0, _0>{});
    Tensor gCol_l = local_tile(mCol, take<0, 2>(args.tile_shape_mnk), make_coord(m, n, _));
    Tensor tCgCol = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(gCol_l(_, _, l), args.epi_tile,
                                                                                        args.tiled_copy, args.thread_idx);
    Tensor tCrCol = make_tensor_like<float>(tCgCol);
    fill(tCrCol, 0.f);
    Layout gBuf_layout = make_layout(take<0, 2>(args.tile_shape_mnk), make_stride(_1{}, _0{}));
    Tensor gBuf_nl = local_tile(make_tensor(make_gmem_ptr<float>(nullptr),
                                            blocked_product(gBuf_layout, make_layout(ceil_div(make_shape(M, N, L),
                                                                                              shape(gBuf_layout))))),
                                take<0, 2>(args.tile_shape_mnk), make_coord(m, _, _));
    Layout sBuf_layout = blocked_product(gBuf_layout, make_layout(make_shape(_1{}, _1{}, size<1>(warp_layout_MN))));
    auto args_tuple = make_tuple(bool_constant<ReferenceSrc>{}, cute::move(tCrCol), args.tCcD, gCol_l, args.cD, gBuf_nl,
                                 sBuf_layout, lane_layout_MN, lane_mn, warp_layout_MN, warp_mn, args.tile_coord_mnkl,
                                 args.residue_cD, args.residue_tCcD, args.epi_tile, args.tiled_copy, args.thread_idx);
    return typename Base::template ConsumerStoreCallbacks<decltype(args_tuple)>(std::move(args_tuple), this->params);
  }
};

// ---- the a half of each group's [a; b] rows, read from global memory into registers (no TMA) ----
// CUTLASS's TMA aux load for grouped GEMMs (Sm90AuxArrayLoad) does not build with per-group strides; this is its
// direct-load form (Sm90AuxLoad<0, ...>) with one pointer per group.

struct GroupedRowsLoad {
  struct SharedStorage {};
  struct Arguments {
    Element const* const* ptr_rows = nullptr;  // per group: its first row
    int64_t ld = 0;                            // elements between rows
  };
  using Params = Arguments;

  template <class P>
  static constexpr Params to_underlying_arguments(P const&, Arguments const& args, void*) { return args; }
  template <class P>
  static bool can_implement(P const&, Arguments const&) { return true; }
  template <class P>
  static size_t get_workspace_size(P const&, Arguments const&) { return 0; }
  template <class P>
  static cutlass::Status initialize_workspace(P const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GroupedRowsLoad() {}
  CUTLASS_HOST_DEVICE GroupedRowsLoad(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class GTensor, class RTensor, class CTensor, class ShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor&& g, RTensor&& r, CTensor&& c, ShapeMNL shape_mnl)
        : tC_g(cute::forward<GTensor>(g)), tC_r(cute::forward<RTensor>(r)), tC_c(cute::forward<CTensor>(c)),
          shape_mnl(shape_mnl) {}
    GTensor tC_g;
    RTensor tC_r;
    CTensor tC_c;
    ShapeMNL shape_mnl;

#ifdef OCCULT_ALOAD_SUBTILE
    // One subtile's rows before it is visited (registers for one subtile).
    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      constexpr auto MCL = decltype(max_common_layout(tC_g(_, _, _, _0{}, _0{}), tC_r)){};
      constexpr int V = cute::min(kAlign, size(MCL));
      Tensor g_vec = recast<Array<Element, V>>(coalesce(tC_g(_, _, _, epi_m, epi_n)));
      Tensor r_vec = recast<Array<Element, V>>(coalesce(tC_r));
      Tensor c_vec = tensor<1>(zipped_divide(coalesce(tC_c(_, _, _, epi_m, epi_n)), MCL.compose(Int<V>{})));
      Tensor p_vec = cute::lazy::transform(c_vec, [&](auto const& c) { return elem_less(c, shape_mnl); });
      copy_if(p_vec, g_vec, r_vec);
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE Array<Element, FragmentSize> visit(Array<ElementAccumulator, FragmentSize> const&, int epi_v, int,
                                                      int) {
      return recast<Array<Element, FragmentSize>>(tC_r)(epi_v);
    }
#else
    // The whole CTA tile's rows at once, before its first subtile: one memory latency a tile, not one a subtile.
    CUTLASS_DEVICE void begin() {
      constexpr auto MCL = decltype(max_common_layout(tC_g(_, _, _, _0{}, _0{}), tC_r(_, _, _, _0{}, _0{}))){};
      constexpr int V = cute::min(kAlign, size(MCL));
      CUTLASS_PRAGMA_UNROLL
      for (int epi_m = 0; epi_m < size<3>(tC_g); ++epi_m) {
        CUTLASS_PRAGMA_UNROLL
        for (int epi_n = 0; epi_n < size<4>(tC_g); ++epi_n) {
          Tensor g_vec = recast<Array<Element, V>>(coalesce(tC_g(_, _, _, epi_m, epi_n)));
          Tensor r_vec = recast<Array<Element, V>>(coalesce(tC_r(_, _, _, epi_m, epi_n)));
          Tensor c_vec = tensor<1>(zipped_divide(coalesce(tC_c(_, _, _, epi_m, epi_n)), MCL.compose(Int<V>{})));
          Tensor p_vec = cute::lazy::transform(c_vec, [&](auto const& c) { return elem_less(c, shape_mnl); });
          copy_if(p_vec, g_vec, r_vec);
        }
      }
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE Array<Element, FragmentSize> visit(Array<ElementAccumulator, FragmentSize> const&, int epi_v,
                                                      int epi_m, int epi_n) {
      return recast<Array<Element, FragmentSize>>(tC_r(_, _, _, epi_m, epi_n))(epi_v);
    }
#endif
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    // The group's own rows: its tile coordinate's L is the group index, which this tensor no longer has.
    auto shape_mnl = make_shape(M, N, 1);
    auto tile_mnkl = make_coord(m, n, k, 0);
    Tensor mRows = make_tensor(make_gmem_ptr(params_ptr->ptr_rows[l]), shape_mnl,
                               make_stride(params_ptr->ld, _1{}, _0{}));
    Tensor tC_g = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        mRows, args.tile_shape_mnk, tile_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tC_r = make_tensor<Element>(shape(tC_g));
    Tensor tC_c = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(shape_mnl), args.tile_shape_mnk, tile_mnkl, args.epi_tile, args.tiled_copy,
        args.thread_idx);
    return ConsumerStoreCallbacks<decltype(tC_g), decltype(tC_r), decltype(tC_c), decltype(shape_mnl)>(
        cute::move(tC_g), cute::move(tC_r), cute::move(tC_c), shape_mnl);
  }
};


// ---- d[a] written from registers straight to each group's rows (no TMA) ----

struct GroupedRowsStore {
  struct SharedStorage {};
  struct Arguments {
    Element* const* ptr_rows = nullptr;  // per group: its first row
    int64_t ld = 0;
  };
  using Params = Arguments;

  template <class P>
  static constexpr Params to_underlying_arguments(P const&, Arguments const& args, void*) { return args; }
  template <class P>
  static bool can_implement(P const&, Arguments const&) { return true; }
  template <class P>
  static size_t get_workspace_size(P const&, Arguments const&) { return 0; }
  template <class P>
  static cutlass::Status initialize_workspace(P const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GroupedRowsStore() {}
  CUTLASS_HOST_DEVICE GroupedRowsStore(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class GTensor, class RTensor, class CTensor, class ShapeMNL>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor&& g, RTensor&& r, CTensor&& c, ShapeMNL shape_mnl)
        : tC_g(cute::forward<GTensor>(g)), tC_r(cute::forward<RTensor>(r)), tC_c(cute::forward<CTensor>(c)),
          shape_mnl(shape_mnl) {}
    GTensor tC_g;
    RTensor tC_r;
    CTensor tC_c;
    ShapeMNL shape_mnl;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int,
                              Array<ElementInput, FragmentSize> const& frg_input) {
      cutlass::NumericArrayConverter<Element, ElementInput, FragmentSize, kRound> convert{};
      recast<Array<Element, FragmentSize>>(tC_r)(epi_v) = convert(frg_input);
      return frg_input;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      constexpr auto MCL = decltype(max_common_layout(tC_g(_, _, _, _0{}, _0{}), tC_r)){};
      constexpr int V = cute::min(kAlign, size(MCL));
      Tensor g_vec = recast<Array<Element, V>>(coalesce(tC_g(_, _, _, epi_m, epi_n)));
      Tensor r_vec = recast<Array<Element, V>>(coalesce(tC_r));
      Tensor c_vec = tensor<1>(zipped_divide(coalesce(tC_c(_, _, _, epi_m, epi_n)), MCL.compose(Int<V>{})));
      Tensor p_vec = cute::lazy::transform(c_vec, [&](auto const& c) { return elem_less(c, shape_mnl); });
      copy_if(p_vec, r_vec, g_vec);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto shape_mnl = make_shape(M, N, 1);
    auto tile_mnkl = make_coord(m, n, k, 0);
    Tensor mRows = make_tensor(make_gmem_ptr(params_ptr->ptr_rows[l]), shape_mnl,
                               make_stride(params_ptr->ld, _1{}, _0{}));
    Tensor tC_g = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        mRows, args.tile_shape_mnk, tile_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tC_r = make_tensor<Element>(take<0, 3>(shape(tC_g)));
    Tensor tC_c = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(shape_mnl), args.tile_shape_mnk, tile_mnkl, args.epi_tile, args.tiled_copy,
        args.thread_idx);
    return ConsumerStoreCallbacks<decltype(tC_g), decltype(tC_r), decltype(tC_c), decltype(shape_mnl)>(
        cute::move(tC_g), cute::move(tC_r), cute::move(tC_c), shape_mnl);
  }
};

// ---- the kernel ----

namespace fusion = cutlass::epilogue::fusion;
namespace ecd = cutlass::epilogue::collective::detail;
using EpiDesc = ecd::EpilogueDescriptor<TileShape, cutlass::epilogue::collective::EpilogueTileAuto, Element, Element,
                                        EpilogueSchedule>;
using AuxStoreDesc = ecd::AuxStoreDescriptor<EpiDesc, LayoutC, Element>;
constexpr int kEpiWarpGroups = EpilogueSchedule::NumEpilogueWarpGroups;

#ifdef OCCULT_NO_ALOAD
using LoadA = fusion::Sm90SrcFetch<Element>;
#else
using LoadA = GroupedRowsLoad;
#endif
using StoreGradA = fusion::Sm90AuxArrayStore<AuxStoreDesc::Stages, kEpiWarpGroups, typename EpiDesc::EpilogueTile,
                                             Element, kRound, StrideRows*, typename AuxStoreDesc::SmemLayoutAtom,
                                             typename AuxStoreDesc::CopyOpR2S>;
using Gate = fusion::Sm90ColBroadcast<0, TileShape, float*, float>;

using Callbacks = fusion::Sm90TopologicalVisitor<
    float,
    cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>,  // 0 u, 1 b, 2 a, 3 g
                cute::seq<2>, cute::seq<2, 4>,                       // 4 sigmoid(a), 5 silu(a)
                cute::seq<0, 1, 4, 5, 3>, cute::seq<6>,              // 6 d[a], 7 stored
                cute::seq<0, 1, 5>, cute::seq<8>,                    // 8 u silu(a) b, 9 summed per row
                cute::seq<0, 5, 3>>,                                 // 10 d[b]: the GEMM's D
    fusion::Sm90AccFetch, fusion::Sm90SrcFetch<Element>, LoadA, Gate,
    fusion::Sm90Compute<Sigmoid, float, float, kRound>, fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
    fusion::Sm90Compute<GradA, float, float, kRound>,
#ifdef OCCULT_NO_AUXSTORE
    fusion::Sm90Compute<cutlass::epilogue::thread::Identity, float, float, kRound>,
#elif defined(OCCULT_DIRECT_STORE)
    GroupedRowsStore,
#else
    StoreGradA,
#endif
    fusion::Sm90Compute<GateGradTerm, float, float, kRound>,
#ifdef OCCULT_NO_ROWSUM
    fusion::Sm90Compute<cutlass::epilogue::thread::Identity, float, float, kRound>,
#else
    GroupedRowSum<TileShape>,
#endif
    fusion::Sm90Compute<GradB, Element, float, kRound>>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutC*, kAlign, Element, LayoutC*, kAlign,
    EpilogueSchedule,
#ifdef OCCULT_PLAIN
    fusion::LinearCombination<Element, float>
#else
    Callbacks
#endif
    >::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign, float,
    TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideC = typename GemmKernel::InternalStrideC;
using StrideD = typename GemmKernel::InternalStrideD;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// Per-group launch data, written on the GPU (one struct of arrays in a caller-owned buffer).
struct Groups {
  Shape3* shapes;
  Element const** a;
  Element const** b;
  Element const** c;
  Element** d;
  Element const** aux_a;
  Element** aux_da;
  float const** gate;
  float** dg;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  StrideRows* stride_aux;
};

template <class T>
T* carve(char*& p, int n) {
  T* out = reinterpret_cast<T*>(p);
  p += ((sizeof(T) * n + 255) / 256) * 256;
  return out;
}

Groups carve_groups(void* buf, int E, size_t* bytes) {
  char* p = static_cast<char*>(buf);
  Groups g;
  g.shapes = carve<Shape3>(p, E);
  g.a = carve<Element const*>(p, E);
  g.b = carve<Element const*>(p, E);
  g.c = carve<Element const*>(p, E);
  g.d = carve<Element*>(p, E);
  g.aux_a = carve<Element const*>(p, E);
  g.aux_da = carve<Element*>(p, E);
  g.gate = carve<float const*>(p, E);
  g.dg = carve<float*>(p, E);
  g.stride_a = carve<StrideA>(p, E);
  g.stride_b = carve<StrideB>(p, E);
  g.stride_c = carve<StrideC>(p, E);
  g.stride_d = carve<StrideD>(p, E);
  g.stride_aux = carve<StrideRows>(p, E);
  *bytes = p - static_cast<char*>(buf);
  return g;
}

template <class S>
CUTLASS_HOST_DEVICE S row_stride(int64_t ld) {
  S s{};
  get<0>(s) = ld;
  return s;
}

__global__ void prepare_groups(Groups g, int E, int const* offsets, Element const* dy, Element const* down,
                               Element const* ab, Element* dab, float const* gate_sorted, float* dg_sorted, int F,
                               int H) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    int64_t lo = offsets[e], m = offsets[e + 1] - offsets[e];
    g.shapes[e] = Shape3(int(m), F, H);
    g.a[e] = dy + lo * H;
    g.b[e] = down + int64_t(e) * H * F;
    g.c[e] = ab + lo * 2 * F + F;
    g.d[e] = dab + lo * 2 * F + F;
    g.aux_a[e] = ab + lo * 2 * F;
    g.aux_da[e] = dab + lo * 2 * F;
    g.gate[e] = gate_sorted + lo;
    g.dg[e] = dg_sorted + lo;
    g.stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(int(m), H, 1));
    g.stride_b[e] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(F, H, 1));
    g.stride_c[e] = row_stride<StrideC>(2 * F);
    g.stride_d[e] = row_stride<StrideD>(2 * F);
    g.stride_aux[e] = row_stride<StrideRows>(2 * F);
  }
}

// gate_sorted[r] = gates[pair[r]], dg_sorted[r] = 0 for the P = offsets[E] sorted pairs.
__global__ void gather_gates(int const* offsets, int E, int const* pair, float const* gates, float* gate_sorted,
                             float* dg_sorted, int bound) {
  int num_pairs = offsets[E];
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < bound; r += gridDim.x * blockDim.x) {
    gate_sorted[r] = r < num_pairs ? gates[pair[r]] : 0.f;
    dg_sorted[r] = 0.f;
  }
}

// dg[pair[r]] = dg_sorted[r] for the P sorted pairs (dg zeroed by the caller).
__global__ void scatter_gate_grads(int const* offsets, int E, int const* pair, float const* dg_sorted, float* dg) {
  int num_pairs = offsets[E];
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < num_pairs; r += gridDim.x * blockDim.x) dg[pair[r]] = dg_sorted[r];
}

typename Gemm::Arguments make_arguments(Groups const& g, int E, int F, int sm_count, int device) {
  cutlass::KernelHardwareInfo hw{device, sm_count};
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {E, g.shapes, nullptr};
  args.mainloop = {g.a, g.stride_a, g.b, g.stride_b};
  auto& t = args.epilogue.thread;
#ifdef OCCULT_PLAIN
  t.alpha = 1.f;
  t.beta = 0.f;
#else
#ifndef OCCULT_NO_ALOAD
  get<2>(t) = {g.aux_a, 2 * F};                                // a
#endif
  get<3>(t) = {g.gate};                                       // g
#if defined(OCCULT_DIRECT_STORE)
  get<7>(t) = {g.aux_da, 2 * F};                              // d[a]
#elif !defined(OCCULT_NO_AUXSTORE)
  get<7>(t) = {g.aux_da, g.stride_aux, sm_count};             // d[a]
#endif
#ifndef OCCULT_NO_ROWSUM
  get<9>(t) = {g.dg};                                         // dg
#endif
#endif
  args.epilogue.ptr_C = g.c;
  args.epilogue.dC = g.stride_c;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.stride_d;
  args.hw_info = hw;
  return args;
}

}  // namespace occult_swiglu

extern "C" {

// Bytes of the per-group buffer and of CUTLASS's workspace for E groups (query once per E).
int occult_swiglu_dgrad_sizes(int E, int F, int sm_count, int device, long long* group_bytes, long long* workspace_bytes) {
  using namespace occult_swiglu;
  size_t bytes = 0;
  Groups g = carve_groups(nullptr, E, &bytes);
  *group_bytes = static_cast<long long>(bytes);
  *workspace_bytes = static_cast<long long>(Gemm::get_workspace_size(make_arguments(g, E, F, sm_count, device)));
  return 0;
}

// Runs the fused dgrad on `stream`. dy [>=P, H], down [E, H, F], ab [>=P, 2F], dab [>=P, 2F] bf16 row-major;
// gates fp32 [R*K]; pair int32 [bound]; offsets int32 [E + 1] (device); gate_sorted, dg_sorted fp32 [bound]
// scratch; dg fp32 [bound] zeroed. Returns 0, or a cutlass::Status / cudaError_t code (negated for CUDA errors).
int occult_swiglu_dgrad_run(void const* dy, void const* down, void const* ab, void const* gates, void const* pair,
                            void const* offsets, void* dab, float* dg, float* gate_sorted, float* dg_sorted,
                            void* group_buf, void* workspace, int E, int bound, int F, int H, int sm_count, int device,
                            cudaStream_t stream) {
  using namespace occult_swiglu;
  size_t bytes = 0;
  Groups g = carve_groups(group_buf, E, &bytes);
  auto const* offs = static_cast<int const*>(offsets);
  int blocks = bound > 0 ? std::min((bound + 255) / 256, 4 * sm_count) : 1;
  gather_gates<<<blocks, 256, 0, stream>>>(offs, E, static_cast<int const*>(pair), static_cast<float const*>(gates),
                                           gate_sorted, dg_sorted, bound);
  prepare_groups<<<(E + 127) / 128, 128, 0, stream>>>(g, E, offs, static_cast<Element const*>(dy),
                                                      static_cast<Element const*>(down), static_cast<Element const*>(ab),
                                                      static_cast<Element*>(dab), gate_sorted, dg_sorted, F, H);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return -static_cast<int>(err);
  Gemm gemm;
  auto args = make_arguments(g, E, F, sm_count, device);
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  scatter_gate_grads<<<blocks, 256, 0, stream>>>(offs, E, static_cast<int const*>(pair), dg_sorted, dg);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return -static_cast<int>(err);
  return 0;
}

}  // extern "C"
