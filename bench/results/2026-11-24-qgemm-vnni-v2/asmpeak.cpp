#include <chrono>
#include <cstdio>
#define D12 "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n vpdpbusd %%zmm30, %%zmm31, %%zmm1\n vpdpbusd %%zmm30, %%zmm31, %%zmm2\n vpdpbusd %%zmm30, %%zmm31, %%zmm3\n vpdpbusd %%zmm30, %%zmm31, %%zmm4\n vpdpbusd %%zmm30, %%zmm31, %%zmm5\n vpdpbusd %%zmm30, %%zmm31, %%zmm6\n vpdpbusd %%zmm30, %%zmm31, %%zmm7\n vpdpbusd %%zmm30, %%zmm31, %%zmm8\n vpdpbusd %%zmm30, %%zmm31, %%zmm9\n vpdpbusd %%zmm30, %%zmm31, %%zmm10\n vpdpbusd %%zmm30, %%zmm31, %%zmm11\n"
#define RUN(name, extra) { const long N=20000000; auto t0=std::chrono::steady_clock::now(); \
  for (long i=0;i<N;i++) __asm__ volatile(D12 extra ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","xmm16","xmm17","xmm18","xmm19","xmm20"); \
  double dt=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); \
  printf("%-12s %.2f cycles per 12 dpbusd (%.3f per dpbusd)\n", name, dt/N*3.67e9, dt/N*3.67e9/12); }
#define X4(op) op "%%zmm12\n" op "%%zmm13\n" op "%%zmm14\n" op "%%zmm15\n"
int main(){
  __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n vpxord %%zmm31,%%zmm31,%%zmm31\n vpxord %%zmm29,%%zmm29,%%zmm29\n" ::: "xmm29","xmm30","xmm31");
  for (int r=0;r<2;r++){
  RUN("none", "")
  RUN("fma x4", X4("vfmadd231ps %%zmm30, %%zmm31, "))
  RUN("mul x4", X4("vmulps %%zmm30, %%zmm31, "))
  RUN("addps x4", X4("vaddps %%zmm30, %%zmm31, "))
  RUN("cvtdq x4", X4("vcvtdq2ps %%zmm30, "))
  RUN("and x4", X4("vpandd %%zmm30, %%zmm31, "))
  RUN("srlw x4", X4("vpsrlw $4, %%zmm30, "))
  RUN("paddd x4", X4("vpaddd %%zmm30, %%zmm31, "))
  RUN("cvtph x4", X4("vcvtph2ps %%ymm30, "))
  RUN("gf2p8 x4", X4("vgf2p8affineqb $0, %%zmm30, %%zmm31, "))
  RUN("bcastld x4", X4("vpbroadcastd (%%rsp), "))
  RUN("ld512 x4", X4("vmovdqu64 -128(%%rsp), "))
  RUN("maddubsw x4", X4("vpmaddubsw %%zmm30, %%zmm31, "))
  RUN("maddwd x4", X4("vpmaddwd %%zmm30, %%zmm31, "))
  RUN("mulld x4", X4("vpmulld %%zmm30, %%zmm31, "))
  RUN("mullw x4", X4("vpmullw %%zmm30, %%zmm31, "))
  RUN("dpwssd x4", X4("vpdpwssd %%zmm30, %%zmm31, "))
  RUN("dpbf16 x4", X4("vdpbf16ps %%zmm30, %%zmm31, "))
  RUN("sadbw x4", X4("vpsadbw %%zmm30, %%zmm31, "))
  RUN("permb x4", X4("vpermb %%zmm30, %%zmm31, "))
  RUN("pshufb x4", X4("vpshufb %%zmm30, %%zmm31, "))
  RUN("scalef x4", X4("vscalefps %%zmm30, %%zmm31, "))
  RUN("addps x8", X4("vaddps %%zmm30, %%zmm31, ") X4("vaddps %%zmm29, %%zmm31, "))
  RUN("cvtdq x8", X4("vcvtdq2ps %%zmm30, ") X4("vcvtdq2ps %%zmm29, "))
  RUN("ymmfma x4", "vfmadd231ps %%ymm30, %%ymm31, %%ymm12\n vfmadd231ps %%ymm30, %%ymm31, %%ymm13\n vfmadd231ps %%ymm30, %%ymm31, %%ymm14\n vfmadd231ps %%ymm30, %%ymm31, %%ymm15\n")
  }
}
