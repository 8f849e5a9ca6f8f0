// A CPU stand-in for the CUDA built-ins the row and attention kernels use: one
// std::thread per CUDA thread, std::barrier for __syncthreads and for each warp's
// shuffles and __syncwarp.
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <memory>
struct dim { unsigned x, y, z; };
thread_local dim threadIdx, blockIdx;
dim blockDim, gridDim;
static std::barrier<>* block_bar;
static std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
static double shfl_slots[1024];
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static   // one block runs at a time: a static is its shared memory
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_bars[threadIdx.x >> 5]->arrive_and_wait(); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int o) {
    int t = threadIdx.x, w = t >> 5;
    warp_bars[w]->arrive_and_wait();
    shfl_slots[t] = (double)v;   // exact for float and double
    warp_bars[w]->arrive_and_wait();
    T r = (T)shfl_slots[t ^ o];
    warp_bars[w]->arrive_and_wait();
    return r;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double __longlong_as_double(long long i) { double f; std::memcpy(&f, &i, 8); return f; }
using std::exp; using std::log; using std::sqrt;
