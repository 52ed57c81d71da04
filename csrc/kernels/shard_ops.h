/*
 * tawpipe shard kernels: framework-agnostic C API.
 *
 * Moves many tensors into / out of one flat buffer with a dtype cast, in one call:
 * the unit of work is a table of segments, each a (src, dst, dtype pair, numel).
 * Weight pipelining packs hundreds to thousands of parameters per transfer, so the
 * whole table is handled by one parallel region (CPU) or one kernel launch (CUDA)
 * instead of one copy per tensor.
 *
 * No framework headers: plain C/C++, CuPy (via ctypes) or JAX custom calls can link
 * the library built from csrc/kernels (see CMakeLists.txt) and call these functions.
 *
 * Semantics per segment, elementwise over numel elements:
 *   accumulate == 0:  dst[k] = cast<dst_dtype>(src[k])
 *   accumulate != 0:  dst[k] = cast<dst_dtype>(float(dst[k]) + alpha * float(src[k]))
 * Arithmetic is float32; narrowing casts round to nearest even (NaN stays NaN).
 * The caller guarantees that no segment's dst overlaps another segment's dst or any src.
 */
#ifndef TAWPIPE_SHARD_OPS_H_
#define TAWPIPE_SHARD_OPS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types, stored in tawpipe_segment.src_dtype / dst_dtype. */
enum { TAWPIPE_DTYPE_F32 = 0, TAWPIPE_DTYPE_BF16 = 1, TAWPIPE_DTYPE_F16 = 2 };

/* Return codes of every function below. */
enum {
  TAWPIPE_OK = 0,
  TAWPIPE_ERR_INVALID_ARGUMENT = 1, /* bad dtype, negative numel, null pointer, short workspace */
  TAWPIPE_ERR_CUDA = 2,             /* a CUDA runtime call failed: see tawpipe_cuda_last_error */
  TAWPIPE_ERR_STREAM_CAPTURING = 3, /* the stream is capturing a CUDA graph (unsupported) */
  TAWPIPE_ERR_OUT_OF_MEMORY = 4     /* a host allocation failed */
};

typedef struct tawpipe_segment {
  const void* src;
  void* dst;
  int64_t numel;     /* elements; 0 is allowed and skipped */
  int32_t src_dtype; /* TAWPIPE_DTYPE_* */
  int32_t dst_dtype; /* TAWPIPE_DTYPE_* */
} tawpipe_segment;

/* A short, static description of a return code. */
const char* tawpipe_status_string(int status);

/*
 * Host memory. Runs all segments with num_threads threads (0: the OpenMP default),
 * splitting the concatenated element range of all segments into equal parts, so a table of
 * many tiny segments parallelises as well as one large one.
 */
int tawpipe_shard_segments_cpu(const tawpipe_segment* segments, int64_t num_segments, int accumulate,
                               float alpha, int num_threads);

/*
 * Host memory: acc[i] = acc[i] + alpha * float(src[i]) for i < numel, rounded as the
 * accumulation of tawpipe_shard_segments_cpu (the same acc, bit for bit), and *sum_of_squares =
 * the sum of acc[i]^2 after the addition (not finite if an element is not), taken from blocks of
 * 16 Ki elements read again while in cache: float32 sums of 16 squares, added in double; within
 * about 1e-6 of the exact sum. A gradient's last addition takes its norm without another pass over memory. The
 * order of the sum depends only on numel and the number of threads.
 */
int tawpipe_accumulate_squares_cpu(float* acc, const void* src, int src_dtype, int64_t numel, float alpha,
                                   int num_threads, double* sum_of_squares);

/* Declared compatibly with cuda_runtime_api.h, so this header needs no CUDA include. */
struct CUstream_st;

/*
 * TAWPIPE_OK if shard work may be enqueued on stream, TAWPIPE_ERR_STREAM_CAPTURING while the
 * stream captures a CUDA graph (a replay would re-read a host table that has since changed), or
 * TAWPIPE_ERR_CUDA. Lets callers refuse before allocating anything.
 */
int tawpipe_shard_cuda_check_stream(struct CUstream_st* stream);

/*
 * Tables of at most this many segments travel in the kernel's launch parameters: they need no
 * workspace and no host-to-device copy (a layer chunk has tens of tensors).
 */
#define TAWPIPE_SHARD_CUDA_INLINE_SEGMENTS 64

/*
 * Bytes of device workspace (and of optional host staging) needed for num_segments segments:
 * 0 up to TAWPIPE_SHARD_CUDA_INLINE_SEGMENTS.
 */
size_t tawpipe_shard_cuda_workspace_bytes(int64_t num_segments);

/*
 * Device memory of the current device. Enqueues exactly one kernel (plus, for a table of more
 * than TAWPIPE_SHARD_CUDA_INLINE_SEGMENTS non-empty segments, one host-to-device copy of the
 * table into device_workspace) on stream; returns without synchronising. Checks the stream as
 * tawpipe_shard_cuda_check_stream does.
 *
 * device_workspace: device memory of at least workspace_bytes(num_segments) bytes that stays
 *   allocated until the kernel has run (stream-ordered allocators give this for free); may be
 *   NULL when that is 0.
 * host_staging: NULL, or host memory of the same size in which the table is built and from
 *   which it is copied. Pass pinned memory for a fully asynchronous copy; the caller must then
 *   keep it unmodified until the copy has run on stream. With NULL, an internal pageable
 *   buffer is used (the copy is then staged by the driver before this call returns).
 */
int tawpipe_shard_segments_cuda(const tawpipe_segment* segments, int64_t num_segments, int accumulate,
                                float alpha, void* device_workspace, void* host_staging,
                                size_t workspace_bytes, struct CUstream_st* stream);

/* Text of the last CUDA error seen by this thread in the tawpipe_shard_cuda_* functions. */
const char* tawpipe_cuda_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TAWPIPE_SHARD_OPS_H_ */
