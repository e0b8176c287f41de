"""Builds the optional C kernels; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("paramserver.base._kernels", ["src/paramserver/base/_kernels.c"],
                             extra_compile_args=["-O3", "-fno-math-errno"], optional=True)])
