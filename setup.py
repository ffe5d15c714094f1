"""Builds the C core (csrc/) into a plain shared library inside the package.

It is compiled as an Extension only so that `pip install` builds it; it exports no Python
module init and is loaded with ctypes by AutoXLA/_native/.
"""
import glob

from setuptools import Extension, setup

core = Extension(
    "AutoXLA._axl_core",
    sources=sorted(glob.glob("csrc/src/*.c")),
    include_dirs=["csrc/include"],
    # Headers too: a changed header (an ABI bump) must rebuild every object, not only the .c
    # files that changed.
    depends=sorted(glob.glob("csrc/include/*.h") + glob.glob("csrc/src/*.h")),
    # -ffp-contract=off: no mul+add fused into an FMA, so the quantization kernels give the
    # same bits on every ISA as their scalar reference (csrc/src/quant_ref.c).
    extra_compile_args=[
        "-std=c11", "-O3", "-ffp-contract=off", "-fvisibility=hidden", "-pthread", "-Wall",
        "-Wextra",
    ],
    extra_link_args=["-pthread"],
    libraries=["m"],
    py_limited_api=False,
)

setup(ext_modules=[core])
