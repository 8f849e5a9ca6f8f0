// What the binned-sum kernels (mpishard/kernels/deposit_cuda.py) use beyond shim.h.
#include <cstdint>
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline long long __double_as_longlong(double f) { long long i; std::memcpy(&i, &f, 8); return i; }
// A block's threads are std::threads: a real atomic.
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
using std::ldexp; using std::trunc;
