"""Which instructions share execution ports with `vpdpbusd` on this CPU: eight independent
`vpdpbusd` zmm chains, alone and interleaved with eight chains of another instruction, in raw
assembly (no compiler register moves or spills), one thread, best of 5 passes. Where the other
instruction leaves `vpdpbusd`'s rate as it was alone, it issues elsewhere; where both fall to
about half, they share the ports. The prefill tiles' cost model in docs/guides/quantized.md
comes from this table (AVX-512 VNNI CPUs only; needs g++).

    .venv/bin/python benchmarks/vnni_ports.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

#: The other instruction of each row: AT&T syntax on register %%zmm{i} (i = 8..15), with
#: zmm16, zmm17 and zmm18 as sources and %1 a pointer to 64 readable bytes.
OTHERS = {
    "vfmadd231ps": "vfmadd231ps %%zmm17,%%zmm16,%%zmm{i}",
    "vmulps": "vmulps %%zmm17,%%zmm{i},%%zmm{i}",
    "vaddps": "vaddps %%zmm17,%%zmm{i},%%zmm{i}",
    "vcvtdq2ps": "vcvtdq2ps %%zmm18,%%zmm{i}",
    "vpandd": "vpandd %%zmm17,%%zmm{i},%%zmm{i}",
    "vpaddd": "vpaddd %%zmm17,%%zmm{i},%%zmm{i}",
    "vpternlogd": "vpternlogd $0xE4,%%zmm17,%%zmm16,%%zmm{i}",
    "vpsrlw": "vpsrlw $1,%%zmm{i},%%zmm{i}",
    "vpshufb": "vpshufb %%zmm17,%%zmm{i},%%zmm{i}",
    "vpmulld": "vpmulld %%zmm17,%%zmm{i},%%zmm{i}",
    "vgf2p8affineqb": "vgf2p8affineqb $0,%%zmm17,%%zmm{i},%%zmm{i}",
    "vpbroadcastd m32": "vpbroadcastd (%1),%%zmm{i}",
    "vbroadcastss m32": "vbroadcastss (%1),%%zmm{i}",
    "vinserti64x4 m256": "vinserti64x4 $1,(%1),%%zmm{i},%%zmm{i}",
    "vmovdqu64 m512": "vmovdqu64 (%1),%%zmm{i}",
    "vmovdqu64 m512 {k} (merge)": "vmovdqu64 32(%1),%%zmm{i}%{{%%k1%}}",
}

SOURCE = r"""
#include <stdio.h>
#include <time.h>
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
alignas(64) static int mem[32];
#define DP(i) "vpdpbusd %%zmm17,%%zmm16,%%zmm" #i "\n"
#define DP8 DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7)
// vpdpbusd's rate (G/s) with `body` (8 vpdpbusd + 8 others) as the loop.
#define RATE(body) [] { double best = 1e9; const long n = 20000000; \
  for (int r = 0; r < 5; ++r) { long c = n; double t = now(); \
    asm volatile("vpxord %%zmm16,%%zmm16,%%zmm16\n vpxord %%zmm17,%%zmm17,%%zmm17\n" \
                 "vpxord %%zmm18,%%zmm18,%%zmm18\n mov $0xF0,%%eax\n kmovw %%eax,%%k1\n" \
                 "1:\n" body "dec %0\n jnz 1b\n" : "+r"(c) : "r"(mem) : "memory", "eax", "k1", \
                 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
                 "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18"); \
    t = now() - t; if (t < best) best = t; } \
  return 8.0 * n / best / 1e9; }()
int main() {
  printf("%-28s %6.2f G/s\n", "vpdpbusd alone", RATE(DP8));
ROWS
}
"""


def main() -> None:
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        sys.exit("vnni_ports: this CPU has no AVX-512 VNNI")
    rows = []
    for name, op in OTHERS.items():
        body = " ".join(f'"{op.format(i=i)}\\n"' for i in range(8, 16))
        rows.append(f'  printf("%-28s %6.2f G/s each\\n", "+ {name}", RATE(DP8 {body}));')
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ports.cpp", Path(tmp) / "ports"
        src.write_text(SOURCE.replace("ROWS", "\n".join(rows)))
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
