#include <chrono>
#include <cstdio>
#define RUN(name, body, per) { const long N=20000000; auto t0=std::chrono::steady_clock::now(); \
  for (long i=0;i<N;i++) __asm__ volatile(body ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8"); \
  double dt=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); \
  printf("%-14s %.2f cycles per op\n", name, dt/N*3.67e9/per); }
#define C4(op) op "%%zmm0\n" op "%%zmm0\n" op "%%zmm0\n" op "%%zmm0\n"
int main(){
  __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n vpxord %%zmm31,%%zmm31,%%zmm31\n" ::: "xmm30","xmm31");
  RUN("dpbusd lat", C4("vpdpbusd %%zmm30, %%zmm31, "), 4)
  RUN("fma lat", C4("vfmadd231ps %%zmm30, %%zmm31, "), 4)
  RUN("dpbusd 4ch", "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n vpdpbusd %%zmm30, %%zmm31, %%zmm1\n vpdpbusd %%zmm30, %%zmm31, %%zmm2\n vpdpbusd %%zmm30, %%zmm31, %%zmm3\n", 4)
  RUN("dpbusd 8ch", "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n vpdpbusd %%zmm30, %%zmm31, %%zmm1\n vpdpbusd %%zmm30, %%zmm31, %%zmm2\n vpdpbusd %%zmm30, %%zmm31, %%zmm3\n vpdpbusd %%zmm30, %%zmm31, %%zmm4\n vpdpbusd %%zmm30, %%zmm31, %%zmm5\n vpdpbusd %%zmm30, %%zmm31, %%zmm6\n vpdpbusd %%zmm30, %%zmm31, %%zmm7\n", 8)
  RUN("dpbusd bcast", "vpdpbusd (%%rsp)%{1to16%}, %%zmm31, %%zmm0\n vpdpbusd 4(%%rsp)%{1to16%}, %%zmm31, %%zmm1\n vpdpbusd 8(%%rsp)%{1to16%}, %%zmm31, %%zmm2\n vpdpbusd 12(%%rsp)%{1to16%}, %%zmm31, %%zmm3\n vpdpbusd 16(%%rsp)%{1to16%}, %%zmm31, %%zmm4\n vpdpbusd 20(%%rsp)%{1to16%}, %%zmm31, %%zmm5\n vpdpbusd 24(%%rsp)%{1to16%}, %%zmm31, %%zmm6\n vpdpbusd 28(%%rsp)%{1to16%}, %%zmm31, %%zmm7\n", 8)
}
