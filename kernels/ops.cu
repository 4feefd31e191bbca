/*
 * ops.cu — the cuda backend's MoE kernels (DESIGN §6): layout, dispatch,
 * combine and their low-latency forms, on the slab layout and protocol of
 * the host backend (kernels/host_ops.h), launched by client/cuda_ops.c.
 * This is the one translation unit of the fatbin (nvcc -fatbin takes one
 * input, and the library looks every kernel up by name in the one module
 * it loads): the throughput kernels are in ops_tp.cuh, the low-latency
 * ones in ops_ll.cuh, what both combines share in ops_combine.cuh, their
 * building blocks in ops_dev.cuh; here is the warm-up.
 *
 * Grid of every communicating kernel: G = min(world * P, B) CTAs (P =
 * J.parts, B the SM budget: kabi.h, client/cuda_attach.c), and world * P
 * units of send work, unit u part u % P of the rows for peer u / P.  CTA b
 * first sends units b, b + G, ... in turn (units, ops_dev.cuh), waiting
 * only as a unit's own protocol does; then it receives: it waits,
 * bounded, for every source's flag and takes its share of the receive
 * work — in the low-latency ops a fixed share (every gridDim.x-th token
 * or row), in the throughput ops
 * rows or tokens claimed from a counter as each becomes ready (the row
 * marks of ops_rows.cuh).  Every CTA doing both halves keeps every warp
 * busy in each phase (a receiver-only CTA idles while the senders run).
 * A job that streams is the exception (ops_stream.cuh): a sender waiting
 * for credit must not hold a receiver back, so there each CTA's first
 * warps send and the others receive.  Every order is
 * the host's (sources, tokens, k ascending) and every sum a float32 sum in
 * that order with explicit round-to-nearest adds and multiplies (no FMA
 * contraction), so outputs are bit-identical to the host backend's and
 * from run to run.
 */
#include "ops_dev.cuh"
#include "ops_tp.cuh"
#include "ops_ll.cuh"

/* ---- warm-up: touch every slab --------------------------------------------------------- */

/*
 * CTA s reads one word in every 64 KiB of rank s's slab, so that the GPU's
 * page tables for the peers' memory (mapped at attach, on this GPU or
 * another) are walked now and not by the first operation, which would
 * otherwise run well past its steady time (BENCHMARKS.md).  Reads only:
 * the slabs are the job's.
 */
KERNEL dep__k_touch(const cuops_job J, const cuops_touch_args a) {
  uint32_t v = 0;
  const uint8_t *slab = slab_of(J, blockIdx.x);
  if (slab == nullptr) /* a rank on another node: its blocks come through the exchange region */
    return;
  for (uint64_t off = (uint64_t)threadIdx.x << 16; off < a.bytes; off += (uint64_t)CUOPS_THREADS << 16)
    v += *(const volatile uint32_t *)(slab + off);
  if (v == 0x9e3779b9u) /* never in practice; keeps the reads */
    J.dev->pad = v;
}
