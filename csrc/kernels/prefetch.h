/*
 * tawpipe prefetcher: framework-agnostic C API for streaming float32 state kept in (pinned) host
 * memory to and from a device buffer.
 *
 * An owner's float32 master, gradient accumulator and optimizer state can live in host memory;
 * only the compute-dtype weights and the incoming gradients occupy the device. The prefetcher
 * moves them in pieces of `piece_numel` elements through two alternating staging buffers, so the
 * copy engine transfers piece k+1 while piece k is cast (load) or accumulated (gradients):
 *
 *   load:        dst[i] = cast<dst_dtype>(src[i])              host float32 -> device
 *   accumulate:  acc[i] = acc[i] + alpha * float(src[i])       device -> host float32
 *
 * A CUDA prefetcher owns a host-to-device, a cast and a device-to-host stream (all of the highest
 * priority, so their small kernels are scheduled ahead of queued compute), two device and two
 * pinned host staging buffers and their events. A host prefetcher (CPU builds) does the same
 * work with plain copies.
 * Arithmetic is float32 with no fused multiply-add; narrowing casts round to nearest even.
 *
 * Ordering (CUDA):
 *   load: the cast stream first waits for `stream` (the consumer: dst may still be read by work
 *     queued there), then `stream` waits for the last cast. The call returns at once. src must
 *     stay unmodified until tawpipe_prefetch_synchronize (the optimizer step calls it first).
 *   accumulate: the copies wait for `stream` (the producer of src); the call returns when every
 *     piece has been added to acc on the host, or fails after timeout_s seconds.
 * Host prefetchers ignore stream and finish the work before returning.
 *
 * Loads and accumulations share no state: one thread may load while another accumulates, but two
 * threads must not load (or accumulate) through one prefetcher at the same time.
 */
#ifndef TAWPIPE_PREFETCH_H_
#define TAWPIPE_PREFETCH_H_

#include <stddef.h>
#include <stdint.h>

#include "shard_ops.h" /* TAWPIPE_DTYPE_*, the shared status codes */

#ifdef __cplusplus
extern "C" {
#endif

/* Returned when a wait passed its deadline (in addition to the shard_ops.h status codes). */
enum { TAWPIPE_ERR_TIMEOUT = 5 };

typedef struct tawpipe_prefetcher tawpipe_prefetcher;
struct CUstream_st;

/* A host prefetcher: plain copies in the calling thread, with num_threads threads (0: OpenMP's
 * default). piece_numel >= 1. */
int tawpipe_prefetch_create_host(int64_t piece_numel, int num_threads, tawpipe_prefetcher** out);

/* A CUDA prefetcher on device (defined only in builds with the CUDA kernels). num_threads is
 * used for the host-side accumulation. */
int tawpipe_prefetch_create_cuda(int device, int64_t piece_numel, int num_threads, tawpipe_prefetcher** out);

void tawpipe_prefetch_destroy(tawpipe_prefetcher* p);

/* src: host float32 (pinned for a CUDA prefetcher); dst: numel elements of dst_dtype on the
 * prefetcher's device. */
int tawpipe_prefetch_load(tawpipe_prefetcher* p, const float* src, void* dst, int dst_dtype, int64_t numel,
                          struct CUstream_st* stream);

/* src: numel elements of src_dtype on the prefetcher's device; acc: host float32. */
int tawpipe_prefetch_accumulate(tawpipe_prefetcher* p, const void* src, int src_dtype, float* acc, int64_t numel,
                                float alpha, struct CUstream_st* stream, double timeout_s);

/* As tawpipe_prefetch_accumulate, and *sum_of_squares = the sum of acc's squares after the
 * addition (tawpipe_accumulate_squares_cpu: within about 1e-6, not finite if an element is not):
 * the norm of a gradient whose last addition this is, without another pass over it. A CUDA
 * prefetcher sums it piece by piece (piece_numel elements), in order. */
int tawpipe_prefetch_accumulate_norm(tawpipe_prefetcher* p, const void* src, int src_dtype, float* acc,
                                     int64_t numel, float alpha, struct CUstream_st* stream, double timeout_s,
                                     double* sum_of_squares);

/* Waits until every load issued so far has finished reading its source. */
int tawpipe_prefetch_synchronize(tawpipe_prefetcher* p, double timeout_s);

/* Elements per piece, and bytes of device and of pinned host staging this prefetcher holds. */
int64_t tawpipe_prefetch_piece_numel(const tawpipe_prefetcher* p);
size_t tawpipe_prefetch_device_bytes(const tawpipe_prefetcher* p);
size_t tawpipe_prefetch_host_bytes(const tawpipe_prefetcher* p);

/* Text of the last error of a tawpipe_prefetch_* call on this thread (names the call and the
 * failing CUDA function). */
const char* tawpipe_prefetch_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TAWPIPE_PREFETCH_H_ */
