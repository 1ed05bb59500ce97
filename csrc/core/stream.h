/* Internal to the C core: non-temporal (streaming) stores for outputs too large to stay in
 * cache. A normal store first reads the destination line into cache (read-for-ownership), so
 * writing n bytes costs 2n of memory traffic; a streaming store writes the line directly. For
 * a cast writing half or twice as many bytes as it reads, that is 25-33% less traffic.
 *
 * Only into memory that was written before: a destination just allocated has no line to read
 * (its pages fault in on the first store, and the kernel zeroes each one, leaving its lines in
 * cache), so a streaming store saves nothing there and must first evict the line the kernel
 * wrote: on an Intel Xeon with AMX a 16M-element cast into a fresh tensor took 1.5-1.7x the
 * time of plain stores, while into a written one streaming gained 0-13%. The caller knows
 * which it is and says so (stream).
 *
 * mp_convert_streamed() runs a conversion kernel block by block into a small buffer that stays
 * in L1 and streams each block to the destination. Only the AVX builds have streaming stores;
 * elsewhere (and for small outputs) the kernel writes the destination directly. */
#ifndef MPEXT_CORE_STREAM_H
#define MPEXT_CORE_STREAM_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#define MP_HAVE_STREAM 1
#endif

/* Outputs of at least this many bytes (per call, i.e. per thread) are streamed: smaller ones
 * are likely to be read again while still in the last-level cache, which streaming bypasses. */
#define MP_STREAM_MIN_BYTES ((int64_t)8 << 20)
/* Elements per block: the block buffer is at most 4 KiB (fp32 output). */
#define MP_STREAM_BLOCK 1024

typedef void (*mp_convert_fn)(const void* src, void* dst, int64_t n);

#if defined(MP_HAVE_STREAM)
/* Streams bytes (a multiple of 32) from src to a 32-byte-aligned dst. */
static inline void mp_stream_bytes(void* dst, const void* src, int64_t bytes) {
  __m256i* d = (__m256i*)dst;
  const char* s = (const char*)src;
  for (int64_t i = 0; i < bytes / 32; ++i) {
    _mm256_stream_si256(d + i, _mm256_loadu_si256((const __m256i*)(s + 32 * i)));
  }
}
#endif

/* convert(src, dst, n) for n elements of in_size bytes into out_size bytes, streaming the output
 * when stream is nonzero and the output is large. convert must be a pure element-wise kernel
 * (element i depends on src[i]). */
static inline void mp_convert_streamed(mp_convert_fn convert, const void* src, void* dst,
                                       int64_t n, int in_size, int out_size, int stream) {
#if defined(MP_HAVE_STREAM)
  if (stream && n * out_size >= MP_STREAM_MIN_BYTES) {
    const char* s = (const char*)src;
    char* d = (char*)dst;
    /* Head: whole elements until dst is 32-byte aligned (dst is out_size-aligned). */
    int64_t head = (int64_t)((32u - ((uintptr_t)d & 31u)) & 31u) / out_size;
    convert(s, d, head);
    int64_t i = head;
    _Alignas(32) char block[MP_STREAM_BLOCK * 4];
    for (; i + MP_STREAM_BLOCK <= n; i += MP_STREAM_BLOCK) {
      convert(s + i * in_size, block, MP_STREAM_BLOCK);
      mp_stream_bytes(d + i * out_size, block, (int64_t)MP_STREAM_BLOCK * out_size);
    }
    _mm_sfence(); /* order the streaming stores before anything that follows */
    convert(s + i * in_size, d + i * out_size, n - i);
    return;
  }
#else
  (void)in_size;
  (void)out_size;
  (void)stream;
#endif
  convert(src, dst, n);
}

#endif /* MPEXT_CORE_STREAM_H */
