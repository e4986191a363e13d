#!/bin/sh
# CMAKE_ARGS for building llama-cpp-python from source on this CPU (used by `make bench-deps`).
# Instruction sets are read from /proc/cpuinfo instead of -march=native, and AMX is always off:
# a native build used AMX tiles and died with SIGILL (tileloadd) on a Xeon VM that lists amx_*
# flags. The AMD hosts have AVX2 and no AVX-512, so only what the CPU lists is turned on.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
isa=""
for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
            avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
            avx512_bf16:AVX512_BF16; do
  flag=${pair%%:*}
  opt=${pair##*:}
  case "$flags" in
    *" $flag "*) isa="$isa -DGGML_$opt=ON" ;;
  esac
done
echo "-DGGML_NATIVE=OFF$isa -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
     "-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAVA_BUILD=OFF" \
     "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF" \
     "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF"
