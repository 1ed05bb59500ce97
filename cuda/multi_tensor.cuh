// The CUDA multi-tensor engine: one packer for every op over a list of tensors, and the lookup
// each block makes of its share. An op supplies its per-range functor (the kernel's work on
// elements [start, start + count) of one tensor), the fields of its by-value argument that name a
// piece's arrays, and the launch; this file does the rest.
//
// Layout: a list is cut into pieces of whole chunks (kChunk elements; a tensor's last chunk may
// be shorter), one block per chunk. A launch's argument carries up to K pieces and is passed by
// value under the 4 KB parameter limit; a launch is made when the argument or the grid (max
// blocks) is full, and once at the end. A tensor that does not fit the blocks left is split at a
// chunk boundary, which keeps its alignment modulo 16 bytes. All counts are 64-bit.
#pragma once

#include <stdint.h>

#include "access.cuh"

namespace mp_cuda {

constexpr int64_t kChunk = 65536;          // elements per block
constexpr int64_t kMaxBlocks = 1 << 30;    // blocks per launch (grid.x < 2^31)

// The pieces of one launch: piece k is n[k] elements covered by blocks first_block[k] ..
// first_block[k + 1] - 1 (the last piece's run to the grid's end); first_block is strictly
// increasing and starts at 0.
template <int K>
struct PieceTable {
  int64_t n[K];
  uint32_t first_block[K];
  int32_t npieces;
};

// The piece of block `block`: the last k with first_block[k] <= block, by binary search.
MP_CUDA_HD int piece_of_block(const uint32_t* first_block, int npieces, uint32_t block) {
  int lo = 0, hi = npieces - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// What block `block` of a launch works on: elements [start, start + count) of piece k.
struct BlockRange {
  int k;
  int64_t start, count;
};

template <int K>
MP_CUDA_HD BlockRange block_range(const PieceTable<K>& t, uint32_t block) {
  const int k = piece_of_block(t.first_block, t.npieces, block);
  const int64_t start = static_cast<int64_t>(block - t.first_block[k]) * kChunk;
  const int64_t rest = t.n[k] - start;
  return {k, start, rest < kChunk ? rest : kChunk};
}

// Packs tensors 0 .. ntensors - 1 (tensor s has size(s) elements; empty ones take no piece) into
// the pieces of `table`: place(i, s, done) records that piece i is tensor s from element done
// on, and launch(blocks) makes one launch of the argument as it stands. Returns the first
// failing launch's status (nothing further is launched), else MP_OK.
template <int K, class Size, class Place, class Launch>
mp_status pack_launches(PieceTable<K>& table, int64_t ntensors, Size&& size, Place&& place,
                        Launch&& launch) {
  const int64_t max_blocks = cap_blocks(kMaxBlocks);
  const int max_pieces = cap_pieces(K);
  table.npieces = 0;
  int64_t blocks = 0;
  for (int64_t s = 0; s < ntensors; ++s) {
    const int64_t n = size(s);
    int64_t done = 0;
    while (done < n) {
      const int64_t chunks = (n - done + kChunk - 1) / kChunk;
      const int64_t take = chunks < max_blocks - blocks ? chunks : max_blocks - blocks;
      const int64_t count = n - done < take * kChunk ? n - done : take * kChunk;
      const int i = table.npieces++;
      table.n[i] = count;
      table.first_block[i] = static_cast<uint32_t>(blocks);
      place(i, s, done);
      blocks += take;
      done += count;
      if (table.npieces == max_pieces || blocks == max_blocks) {
        const mp_status st = launch(blocks);
        if (st != MP_OK) return st;
        table.npieces = 0;
        blocks = 0;
      }
    }
  }
  return table.npieces > 0 ? launch(blocks) : MP_OK;
}

}  // namespace mp_cuda
